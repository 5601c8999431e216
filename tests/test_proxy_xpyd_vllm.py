"""``kvmux proxy`` in front of two prefill and two decode real vLLM servers (2P2D, tcp).

Four server starts are the expensive part, so one cluster serves the module
and its tests run in order on it: answers equal a single instance's and every
server gets work; then one prefill is killed with SIGKILL while two clients
keep sending requests, which all still succeed (it is taken out of rotation,
and both decodes pull from the prefill that is left); then it is restarted on
the same port and put back. Decode servers run without vLLM's prefix cache, so
each proxied request loads its whole prompt's KV and the load counters on
``/metrics`` show which decode loaded what. The reference tokens are a plain
request to a decode server (no ``kv_transfer_params``): one instance
computing the whole prompt.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvmux.demo.run import (
    BLOCK_SIZE,
    MODELS,
    kv_transfer_config,
    request_body,
    server_args,
    stop_all,
)
from kvmux.demo.servers import ProxyThread, VllmServer
from kvmux.models import random_prompts, tiny_model

pytestmark = pytest.mark.timeout(900)

SPEC = MODELS["tiny"]
PROMPT_TOKENS = 300  # three blocks of 128
MAX_TOKENS = 12
PATH = "/v1/completions"


@dataclass
class Served:
    """One answer through the proxy and the upstreams that served it."""

    token_ids: list[int]
    prefill: str
    decode: str


@dataclass
class Xpyd:
    prefill: list[VllmServer]
    decode: list[VllmServer]
    proxy_url: str
    log_dir: Path
    model_dir: Path

    def reference(self, prompt: list[int]) -> list[int]:
        """The tokens of one instance computing the whole prompt itself."""
        body = request_body(prompt, MAX_TOKENS, stream=False)
        return _token_ids(_post(self.decode[0].url, body)[1])

    def ask(self, prompt: list[int], *, stream: bool = False) -> Served:
        headers, answer = _post(self.proxy_url, request_body(prompt, MAX_TOKENS, stream=stream))
        return Served(_token_ids(answer), headers["X-Kvmux-Prefill"], headers["X-Kvmux-Decode"])

    def stats(self) -> dict[str, dict[str, dict[str, Any]]]:
        with urllib.request.urlopen(self.proxy_url + "/stats", timeout=10) as resp:
            report = json.loads(resp.read())
        return {role: {u["url"]: u for u in report[role]} for role in ("prefill", "decode")}


def _prefill_server(model_dir: Path, log_dir: Path, name: str, port: int | None) -> VllmServer:
    args = server_args(kv_transfer_config("kv_producer", "tcp"))
    return VllmServer(name, model_dir, args, log_dir=log_dir, port=port)


@pytest.fixture(scope="module")
def xpyd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Xpyd]:
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    from kvmux.proxy import ProxyConfig

    log_dir = tmp_path_factory.mktemp("xpyd-logs")
    model_dir = tiny_model(SPEC)
    decode_args = [
        *server_args(kv_transfer_config("kv_consumer", "tcp")),
        "--no-enable-prefix-caching",
    ]
    prefill = [_prefill_server(model_dir, log_dir, f"prefill-{i}", None) for i in range(2)]
    decode = [VllmServer(f"decode-{i}", model_dir, decode_args, log_dir=log_dir) for i in range(2)]
    servers = [*prefill, *decode]
    proxy: ProxyThread | None = None
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        config = ProxyConfig(
            prefill=[s.url for s in prefill],
            decode=[s.url for s in decode],
            port=0,
            timeout_s=180,
            probe_interval_s=0.5,
        )
        proxy = ProxyThread(config)
        cluster = Xpyd(prefill, decode, proxy.start(), log_dir, model_dir)
        yield cluster
        servers = [*cluster.prefill, *cluster.decode]  # a restarted prefill replaced one
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(servers)
    for server in servers:
        assert server.pid is None or not _group_alive(server.pid), f"{server} still running"


def _prompts(n: int, seed: int) -> list[list[int]]:
    return [
        random_prompts(1, PROMPT_TOKENS, seed=seed + i, vocab_size=SPEC.vocab_size)[0]
        for i in range(n)
    ]


BLOCKS = math.ceil(PROMPT_TOKENS / BLOCK_SIZE)


def test_xpyd_answers_equal_one_instance_and_every_server_is_used(xpyd: Xpyd) -> None:
    prompts = _prompts(4, seed=500)
    references = [xpyd.reference(p) for p in prompts]
    before = {s.url: _loaded_blocks(s.url) for s in xpyd.decode}
    served = [xpyd.ask(p, stream=i % 2 == 0) for i, p in enumerate(prompts)]
    for got, want in zip(served, references, strict=True):
        assert len(want) == MAX_TOKENS
        assert got.token_ids == want
    assert {s.prefill for s in served} == {s.url for s in xpyd.prefill}
    assert {s.decode for s in served} == {s.url for s in xpyd.decode}
    for server in xpyd.decode:
        expected = before[server.url] + BLOCKS * sum(s.decode == server.url for s in served)
        _wait_loaded(server.url, expected)
    stats = xpyd.stats()
    for role in ("prefill", "decode"):
        for url, state in stats[role].items():
            assert state["in_rotation"] and state["in_flight"] == 0, (url, state)


def test_xpyd_same_prompt_goes_back_to_the_servers_that_hold_its_prefix(xpyd: Xpyd) -> None:
    (prompt,) = _prompts(1, seed=600)
    first, again = xpyd.ask(prompt), xpyd.ask(prompt)
    assert (again.prefill, again.decode) == (first.prefill, first.decode)
    assert again.token_ids == first.token_ids == xpyd.reference(prompt)


def test_xpyd_a_killed_prefill_is_taken_out_and_put_back_once_restarted(xpyd: Xpyd) -> None:
    prompts = _prompts(10, seed=700)
    references = [xpyd.reference(p) for p in prompts]
    victim, survivor = xpyd.prefill
    before = {s.url: _loaded_blocks(s.url) for s in xpyd.decode}
    served: dict[int, Served] = {}
    started: dict[int, float] = {}
    errors: list[BaseException] = []
    first_done = threading.Event()

    def client(indices: range) -> None:
        for i in indices:
            started[i] = time.monotonic()
            try:
                served[i] = xpyd.ask(prompts[i], stream=i % 2 == 1)
            except BaseException as exc:  # reported below
                errors.append(exc)
            first_done.set()

    clients = [threading.Thread(target=client, args=(range(k, 8, 2),)) for k in range(2)]
    for thread in clients:
        thread.start()
    try:
        assert first_done.wait(120), "no answer through the proxy"
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)  # the whole server: API process and engine
        killed_at = time.monotonic()
        done_at_kill = len(served)
    finally:
        for thread in clients:
            thread.join(300)
    victim.stop(grace_s=5)  # reaps it; its group is gone already
    assert not errors, errors
    assert [served[i].token_ids for i in range(8)] == references[:8]
    stats = xpyd.stats()["prefill"]
    assert stats[victim.url]["in_rotation"] is False
    assert stats[victim.url]["taken_out"] >= 1
    # Every request started after the kill took its KV from the survivor, on both
    # decodes (one under way at the kill may have lost its load: it was recomputed,
    # and its tokens are equal above).
    late = [served[i] for i in range(8) if started[i] > killed_at]
    assert len(late) >= 2, f"{done_at_kill} of 8 were done before the kill: kill sooner"
    assert all(s.prefill == survivor.url for s in late), late
    from_survivor = [s for s in served.values() if s.prefill == survivor.url]
    assert {s.decode for s in from_survivor} == {s.url for s in xpyd.decode}
    for server in xpyd.decode:
        pulled = sum(s.decode == server.url for s in from_survivor)
        _wait_loaded(server.url, before[server.url] + BLOCKS * pulled)

    reborn = _prefill_server(xpyd.model_dir, xpyd.log_dir, "prefill-0-restarted", victim.port)
    xpyd.prefill[0] = reborn
    reborn.start().wait_ready(600)
    healthy_at = time.monotonic()
    _wait_for(lambda: xpyd.stats()["prefill"][reborn.url]["in_rotation"], 30)
    print(
        f"\n{done_at_kill} of 8 answered before the kill, none failed; "
        f"{stats[victim.url]['sent']} requests sent to the killed prefill in all; "
        f"restarted one back in rotation {time.monotonic() - healthy_at:.2f} s after its "
        f"/health answered (probe interval 0.5 s)"
    )
    again = [xpyd.ask(p) for p in prompts[8:]]
    assert [a.token_ids for a in again] == references[8:]
    assert reborn.url in {a.prefill for a in again}, "the restarted prefill got no request"


# -------------------------------------------------------------------------- helpers


def _post(base_url: str, body: Mapping[str, Any]) -> tuple[Mapping[str, str], dict[str, Any]]:
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


def _token_ids(answer: Mapping[str, Any]) -> list[int]:
    return [int(i) for i in answer["choices"][0]["token_ids"]]


def _loaded_blocks(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:kvmux_stat_total" and sample.labels.get("stat") == (
                "load_blocks_ok"
            ):
                total += sample.value
    return total


def _wait_loaded(url: str, at_least: float, timeout_s: float = 30) -> None:
    """Counters reach ``/metrics`` with the engine's step outputs, so they may lag."""
    deadline = time.monotonic() + timeout_s
    while (now := _loaded_blocks(url)) < at_least:
        assert time.monotonic() < deadline, f"{url} loaded {now:g} blocks, expected {at_least:g}"
        time.sleep(0.3)


def _wait_for(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
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
