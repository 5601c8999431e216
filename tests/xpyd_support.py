"""What the xPyD tests share: 2P2D real vLLM servers behind ``kvmux proxy``, and a client.

On loopback (``test_proxy_xpyd_vllm.py``) or with every server and the proxy on
a host of its own (``test_vllm_xpyd_netns.py``): :attr:`Xpyd.network` is the
network the client's sockets are opened in (a host's ``entered``, or loopback's
own). Decode servers run without vLLM's prefix cache, so each proxied request
loads its whole prompt's KV and the load counters on ``/metrics`` show which
decode loaded what. The reference tokens are a plain request to a decode
server (no ``kv_transfer_params``): one instance computing the whole prompt.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvmux.demo.run import BLOCK_SIZE, MODELS, kv_transfer_config, request_body, server_args
from kvmux.models import random_prompts

SPEC = MODELS["tiny"]
PROMPT_TOKENS = 300  # three blocks of 128
MAX_TOKENS = 12
PATH = "/v1/completions"
BLOCKS = math.ceil(PROMPT_TOKENS / BLOCK_SIZE)


def prefill_args(**backend: Any) -> list[str]:
    """A ``kv_producer`` server's flags; ``backend`` adds to ``{"backend": "tcp"}``."""
    return server_args(_transfer("kv_producer", backend))


def decode_args(**backend: Any) -> list[str]:
    """A ``kv_consumer`` server's flags, vLLM's prefix cache off (see the module doc)."""
    return [*server_args(_transfer("kv_consumer", backend)), "--no-enable-prefix-caching"]


def _transfer(role: str, backend: Mapping[str, Any]) -> dict[str, Any]:
    config = kv_transfer_config(role, "tcp")
    config["kv_connector_extra_config"].update(backend)
    return config


@dataclass
class Served:
    """One answer through the proxy and the upstreams that served it."""

    token_ids: list[int]
    prefill: str
    decode: str


@dataclass
class Xpyd:
    """The servers' URLs, the proxy's, and the network a client reaches them from."""

    prefill_urls: list[str]
    decode_urls: list[str]
    proxy_url: str
    network: Callable[[], contextlib.AbstractContextManager[None]] = field(
        default=contextlib.nullcontext
    )

    def reference(self, prompt: list[int]) -> list[int]:
        """The tokens of one instance computing the whole prompt itself."""
        body = request_body(prompt, MAX_TOKENS, stream=False)
        return token_ids(self._post(self.decode_urls[0], body)[1])

    def ask(self, prompt: list[int], *, stream: bool = False) -> Served:
        body = request_body(prompt, MAX_TOKENS, stream=stream)
        headers, answer = self._post(self.proxy_url, body)
        return Served(token_ids(answer), headers["X-Kvmux-Prefill"], headers["X-Kvmux-Decode"])

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        """The proxy's ``/stats`` by role, then by URL."""
        with self.network(), urllib.request.urlopen(self.proxy_url + "/stats", timeout=10) as r:
            report = json.loads(r.read())
        return {role: {u["url"]: u for u in report[role]} for role in ("prefill", "decode")}

    def loaded_blocks(self, url: str) -> float:
        """Blocks a decode server loaded so far, from its ``/metrics``."""
        from prometheus_client.parser import text_string_to_metric_families

        with self.network(), urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "vllm:kvmux_stat_total" and sample.labels.get("stat") == (
                    "load_blocks_ok"
                ):
                    total += sample.value
        return total

    def wait_loaded(self, url: str, at_least: float, timeout_s: float = 30) -> None:
        """Counters reach ``/metrics`` with the engine's step outputs, so they may lag."""
        deadline = time.monotonic() + timeout_s
        while (now := self.loaded_blocks(url)) < at_least:
            assert time.monotonic() < deadline, f"{url} loaded {now:g} blocks, not {at_least:g}"
            time.sleep(0.3)

    def _post(
        self, base_url: str, body: Mapping[str, Any]
    ) -> tuple[Mapping[str, str], dict[str, Any]]:
        with self.network():
            return post(base_url, body)


def check_answers_equal_one_instance_and_every_server_is_used(client: Xpyd, seed: int) -> None:
    """Four prompts through the proxy (half of them streamed): each answer is one
    instance's, every prefill and decode served one, each decode loaded every block
    of each prompt it decoded (its prefix cache is off: from the prefill that served
    it), and the proxy has every server in rotation and idle after."""
    prompts = prompts_of(4, seed)
    references = [client.reference(p) for p in prompts]
    before = {url: client.loaded_blocks(url) for url in client.decode_urls}
    served = [client.ask(p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
    for got, want in zip(served, references, strict=True):
        assert len(want) == MAX_TOKENS
        assert got.token_ids == want
    assert {s.prefill for s in served} == set(client.prefill_urls)
    assert {s.decode for s in served} == set(client.decode_urls)
    for url in client.decode_urls:
        expected = before[url] + BLOCKS * sum(s.decode == url for s in served)
        client.wait_loaded(url, expected)
    stats = client.stats()
    for role in ("prefill", "decode"):
        for url, state in stats[role].items():
            assert state["in_rotation"] and state["in_flight"] == 0, (url, state)


@dataclass
class Outage:
    """Eight requests sent while a prefill failed: see :func:`ask_through_a_prefill_fault`."""

    prompts: list[list[int]]
    """Ten prompts; the last two were not sent (for the caller, once the victim is back)."""
    references: list[list[int]]
    done_before: int
    """Requests answered before the fault."""
    slowest_after_s: float
    """The longest a request started after the fault took."""
    victim: dict[str, Any]
    """The proxy's ``/stats`` of the failed prefill, right after the requests."""


def ask_through_a_prefill_fault(
    client: Xpyd, victim: str, fault: Callable[[], None], *, seed: int, fault_name: str
) -> Outage:
    """Two clients send eight of ten prompts through the proxy (half of them
    streamed); once the first is answered, ``fault()`` takes the prefill ``victim``
    down (``fault_name`` says how, in messages). Checks that no request failed,
    each answer is one instance's, the proxy took the victim out, and every
    request started after the fault (at least two) was prefilled on the other
    prefill (retried there if it went to the victim first), whose KV both decodes
    loaded, every block of each prompt they decoded (one under way at the fault
    may have lost its load: it was recomputed, and its tokens are checked like
    the rest)."""
    prompts = prompts_of(10, seed)
    references = [client.reference(p) for p in prompts]
    (survivor,) = set(client.prefill_urls) - {victim}
    before = {url: client.loaded_blocks(url) for url in client.decode_urls}
    served: dict[int, Served] = {}
    started: dict[int, float] = {}
    took: dict[int, float] = {}
    errors: list[BaseException] = []
    first_done = threading.Event()

    def ask(indices: range) -> None:
        for i in indices:
            started[i] = time.monotonic()
            try:
                served[i] = client.ask(prompts[i], stream=i % 2 == 1)
            except BaseException as exc:  # reported below
                errors.append(exc)
            took[i] = time.monotonic() - started[i]
            first_done.set()

    clients = [threading.Thread(target=ask, args=(range(k, 8, 2),)) for k in range(2)]
    for thread in clients:
        thread.start()
    try:
        assert first_done.wait(120), "no answer through the proxy"
        fault()
        fault_at = time.monotonic()
        done_before = len(served)
    finally:
        for thread in clients:
            thread.join(300)
    assert not errors, errors
    assert [served[i].token_ids for i in range(8)] == references[:8]
    stats = client.stats()["prefill"]
    assert stats[victim]["in_rotation"] is False
    assert stats[victim]["taken_out"] >= 1
    late = [served[i] for i in range(8) if started[i] > fault_at]
    too_late = f"{done_before} of 8 were done before the {fault_name}: {fault_name} sooner"
    assert len(late) >= 2, too_late
    assert all(s.prefill == survivor for s in late), late
    from_survivor = [s for s in served.values() if s.prefill == survivor]
    assert {s.decode for s in from_survivor} == set(client.decode_urls)
    for url in client.decode_urls:
        pulled = sum(s.decode == url for s in from_survivor)
        client.wait_loaded(url, before[url] + BLOCKS * pulled)
    slowest = max(took[i] for i in range(8) if started[i] > fault_at)
    return Outage(prompts, references, done_before, slowest, stats[victim])


def prompts_of(n: int, seed: int) -> list[list[int]]:
    return [
        random_prompts(1, PROMPT_TOKENS, seed=seed + i, vocab_size=SPEC.vocab_size)[0]
        for i in range(n)
    ]


def post(base_url: str, body: Mapping[str, Any]) -> tuple[Mapping[str, str], dict[str, Any]]:
    """One completion (streamed or not): the response headers and the whole answer
    (a stream's chunks joined into one choice with all their token ids)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=180)
    try:
        conn.request("POST", PATH, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.status == 200, f"{base_url}: HTTP {resp.status}: {raw[:500]!r}"
        headers = {k: v for k, v in resp.getheaders()}
    finally:
        conn.close()
    if not body.get("stream"):
        return headers, json.loads(raw)
    ids: list[int] = []
    for line in raw.decode().splitlines():
        data = line.removeprefix("data: ").strip()
        if not line.startswith("data: ") or data == "[DONE]":
            continue
        event = json.loads(data)
        assert "error" not in event, event
        for choice in event.get("choices") or ():
            ids += choice.get("token_ids") or []
    return headers, {"choices": [{"token_ids": ids}]}


def token_ids(answer: Mapping[str, Any]) -> list[int]:
    return [int(i) for i in answer["choices"][0]["token_ids"]]


def wait_for(check: Callable[[], Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        for stat in Path("/proc").glob("[0-9]*/stat"):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False
