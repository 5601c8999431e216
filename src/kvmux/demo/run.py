"""``kvmux demo``: real vLLM prefill and decode servers joined by kvmux, checked against one server.

Three vLLM API servers run the same tiny model: a *reference* (no connector),
a *prefill* (``kv_producer``) and a *decode* (``kv_consumer``), the last two
using kvmux's vLLM adapter over ``shm`` (or ``tcp``). The kvmux proxy sits in
front of prefill and decode. Every prompt goes through the proxy and, directly,
to the reference, greedily; the demo passes only if every answer's token ids
are identical, which they can only be if the KV cache the decode server loaded
is the one the prefill server computed (a wrong KV changes the tokens: the
tiny model's weights are chosen for that, see :mod:`kvmux.models.tiny`).

How much KV moved is shown twice: computed from the model's layout, and as the
decode server itself counted it (the adapter's counters reach vLLM's connector
stats, which vLLM logs as ``KV Transfer metrics: ...``; the decode server logs
them every second and the demo reads its log). A P/D setup that silently
recomputes the prompt would give identical tokens too; the counters are what
show it did not.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmux.demo.servers import ProxyThread, VllmServer
from kvmux.errors import KvmuxError
from kvmux.models import TinyModelSpec, random_prompts, tiny_model
from kvmux.stats import is_level

#: vLLM's CPU block size; passed explicitly so the layout arithmetic below holds.
BLOCK_SIZE = 128
#: Longest sequence (prompt plus answer) every server accepts.
MAX_MODEL_LEN = 2048
#: One name on all three servers, so one request body fits each of them.
SERVED_MODEL = "kvmux-demo"
#: vLLM runs every model in float32 here: bf16 rounds a loaded prefix differently from a
#: full prefill (shared/NOTES.md), and the demo's check is exact token identity.
DTYPE_BYTES = 4

ModelName = Literal["tiny", "medium", "large"]

#: ``medium`` is the default: 8 KiB of KV per token, so a 1000-token prompt moves 8 MiB,
#: while three servers still start and answer within the demo's time budget on 2 cores.
MODELS: dict[ModelName, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "medium": TinyModelSpec(layers=4, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64),
    "large": TinyModelSpec(layers=8, hidden_size=512, num_heads=8, num_kv_heads=8, head_dim=64),
}


class DemoError(KvmuxError, RuntimeError):
    """A server answered with an error or something the demo cannot read."""


class DemoSettings(BaseModel):
    """What ``kvmux demo`` runs; the defaults are the demo ``make demo`` shows."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["shm", "tcp"] = Field(
        "shm", description="kvmux backend between prefill and decode (shm: same host)"
    )
    model: ModelName = Field("medium", description="size of the tiny random-weight model")
    prompt_tokens: tuple[int, ...] = Field(
        (300, 520, 760, 1000), min_length=1, description="one prompt of each length"
    )
    max_tokens: int = Field(16, ge=1, description="tokens generated per prompt")
    log_dir: Path | None = Field(None, description="server logs; default a new temp directory")
    start_timeout_s: float = Field(300.0, gt=0, description="longest wait for a server's /health")
    request_timeout_s: float = Field(180.0, gt=0, description="longest wait for one request")
    stats_timeout_s: float = Field(
        8.0, gt=0, description="longest wait for decode's logged counters after a request"
    )

    @model_validator(mode="after")
    def _prompts_fit(self) -> DemoSettings:
        """A prompt vLLM would refuse should fail here, before three servers start."""
        longest = MAX_MODEL_LEN - self.max_tokens
        bad = [n for n in self.prompt_tokens if not 1 <= n <= longest]
        if bad:
            raise ValueError(f"prompt lengths must be 1..{longest} tokens, got {bad}")
        return self


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """Keys and values, every layer, every KV head: what one token's cache weighs."""
    return 2 * spec.layers * spec.num_kv_heads * spec.resolved_head_dim * DTYPE_BYTES


def layout_bytes(spec: TinyModelSpec, prompt_tokens: int) -> int:
    """KV a whole-prompt hand-off moves: whole blocks, the last one partly filled."""
    return math.ceil(prompt_tokens / BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token(spec)


# ------------------------------------------------------------------ the servers


@dataclass
class Cluster:
    """Three running vLLM servers and the proxy in front of prefill and decode."""

    spec: TinyModelSpec
    model_dir: Path
    log_dir: Path
    reference: VllmServer
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    startup_s: float


def server_args(
    kv_transfer: Mapping[str, Any] | None = None,
    *,
    served_model_name: str = SERVED_MODEL,
    dtype: str = "float32",
    max_model_len: int = MAX_MODEL_LEN,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int | None = None,
) -> list[str]:
    """The flags every server shares (shared/NOTES.md "vLLM on the CPU"), plus a connector.
    The keywords are for servers that are not the demo's (``kvmux bench serve``)."""
    args = [
        "--served-model-name",
        served_model_name,
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        "--block-size",
        str(BLOCK_SIZE),
        "--disable-uvicorn-access-log",
    ]
    if max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer))]
    return args


def kv_transfer_config(role: str, backend: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": "kvmux",
        "kv_role": role,
        "kv_connector_extra_config": {"backend": backend},
    }
    if role == "kv_consumer":
        # A block that fails to load is recomputed rather than failing the request;
        # the decode log then says so, and the counters show fewer blocks loaded.
        config["kv_load_failure_policy"] = "recompute"
    return config


@contextlib.contextmanager
def cluster(settings: DemoSettings) -> Iterator[Cluster]:
    """Start all three servers at once (then wait for each) and the proxy; stop all on exit.

    Starting side by side matters: each start is ~20-40 s of mostly serial
    Python, so three in a row would triple the wait.
    """
    from kvmux.proxy import ProxyConfig

    spec = MODELS[settings.model]
    model_dir = tiny_model(spec)
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvmux-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    reference = VllmServer("reference", model_dir, server_args(), log_dir=log_dir)
    prefill = VllmServer(
        "prefill",
        model_dir,
        server_args(kv_transfer_config("kv_producer", settings.backend)),
        log_dir=log_dir,
        env=stats_logging_env(log_dir / "prefill-logging.json"),
    )
    decode = VllmServer(
        "decode",
        model_dir,
        server_args(kv_transfer_config("kv_consumer", settings.backend)),
        log_dir=log_dir,
        env=stats_logging_env(log_dir / "decode-logging.json"),
    )
    servers = (reference, prefill, decode)
    proxy: ProxyThread | None = None
    start = time.perf_counter()
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(settings.start_timeout_s)
        config = ProxyConfig(
            prefill=[prefill.url], decode=[decode.url], port=0, timeout_s=settings.request_timeout_s
        )
        proxy = ProxyThread(config)
        proxy_url = proxy.start()
        yield Cluster(
            spec=spec,
            model_dir=model_dir,
            log_dir=log_dir,
            reference=reference,
            prefill=prefill,
            decode=decode,
            proxy_url=proxy_url,
            startup_s=time.perf_counter() - start,
        )
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(servers)


def stop_all(servers: Sequence[VllmServer]) -> None:
    """Stop servers side by side: each may need its whole grace period."""
    threads = [threading.Thread(target=server.stop) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def stats_logging_env(config_path: Path) -> dict[str, str]:
    """Make a vLLM server log its connector counters every second, and never drop them.

    vLLM logs ``KV Transfer metrics`` through the same call as its throughput
    line, at DEBUG when the last two intervals generated no token. The step
    that finishes a KV load generates none (the request is still waiting for
    its KV), so under load a transfer's counters are regularly logged at
    DEBUG, which vLLM's default config drops. This config is vLLM's default
    with that one logger at DEBUG (one extra line per idle second).
    """
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "()": "vllm.logging_utils.NewLineFormatter",
                "fmt": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                "[%(fileinfo)s:%(lineno)d] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "DEBUG",
                "stream": "ext://sys.stdout",
            }
        },
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            "vllm.v1.metrics.loggers": {"level": "DEBUG"},
        },
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return {"VLLM_LOG_STATS_INTERVAL": "1", "VLLM_LOGGING_CONFIG_PATH": str(config_path)}


# ------------------------------------------------------------------ the client


@dataclass
class Answer:
    """One generation as the client saw it."""

    token_ids: list[int]
    text: str
    ttft_s: float
    """Until the first generated token (streamed) or the first byte of the answer."""
    total_s: float


def request_body(
    prompt: list[int] | str, max_tokens: int, *, stream: bool, chat: bool = False
) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens, token ids in the answer."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def complete(base_url: str, path: str, body: Mapping[str, Any], timeout_s: float) -> Answer:
    """POST ``body`` to ``base_url + path`` (completions or chat, streamed or not)."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        first_byte = time.perf_counter() - start
        if resp.status != 200:
            detail = resp.read(2000).decode(errors="replace")
            raise DemoError(f"{base_url}{path} answered HTTP {resp.status}: {detail}")
        if body.get("stream"):
            return _read_stream(resp, start)
        payload = _json(resp.read(), f"{base_url}{path}")
        ids, text = _choice(payload)
        return Answer(ids, text, first_byte, time.perf_counter() - start)
    except (OSError, http.client.HTTPException) as exc:
        raise DemoError(f"{base_url}{path} failed: {exc}") from exc
    finally:
        conn.close()


def _read_stream(resp: http.client.HTTPResponse, start: float) -> Answer:
    """Server-sent events until ``[DONE]``; the clock stops at the first token."""
    ids: list[int] = []
    text: list[str] = []
    ttft: float | None = None
    for raw in iter(resp.readline, b""):
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[len(b"data:") :].strip()
        if data == b"[DONE]":
            resp.read()  # the end of the chunked body: leaving early looks like a dropped client
            break
        event = _json(data, "stream")
        if not event.get("choices"):  # usage-only chunks
            continue
        chunk_ids, chunk_text = _choice(event)
        if ttft is None and (chunk_ids or chunk_text):
            ttft = time.perf_counter() - start
        ids += chunk_ids
        text.append(chunk_text)
    total = time.perf_counter() - start
    return Answer(ids, "".join(text), ttft if ttft is not None else total, total)


def _json(raw: bytes, where: str) -> dict[str, Any]:
    try:
        payload = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DemoError(f"{where}: not JSON ({exc}): {raw[:200]!r}") from None
    if not isinstance(payload, dict):
        raise DemoError(f"{where}: expected a JSON object, got {raw[:200]!r}")
    if "error" in payload:
        raise DemoError(f"{where}: {payload['error']}")
    return payload


def _choice(payload: Mapping[str, Any]) -> tuple[list[int], str]:
    """Token ids and text of the first choice: completions, chat, whole or a stream delta."""
    choice = payload["choices"][0]
    ids = [int(i) for i in choice.get("token_ids") or ()]
    message = choice.get("message") or choice.get("delta") or {}
    text = choice.get("text") if "text" in choice else message.get("content")
    return ids, str(text or "")


# ------------------------------------------------------------------ connector stats

_METRICS = re.compile(r"KV Transfer metrics: (.*)$", re.MULTILINE)


def transfer_totals(log_path: Path) -> dict[str, float]:
    """Sum of every ``KV Transfer metrics`` line in a server log (each covers one interval).

    Derived rates (``*_GBps``) and levels (``kvmux.stats.LEVELS``) are skipped: they
    do not add up.
    """
    totals: dict[str, float] = {}
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return totals
    for match in _METRICS.finditer(text):
        for item in match.group(1).split(","):
            name, _, value = item.strip().partition("=")
            if not name or name.endswith("_GBps") or is_level(name):
                continue
            with contextlib.suppress(ValueError):
                totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def loaded_since(log_path: Path, before: Mapping[str, float], timeout_s: float) -> dict[str, float]:
    """What the decode server counted since ``before``, once a load shows up (or timeout).

    A request is answered before its counters reach the log (vLLM logs them
    once a second), so this polls; a load that never shows gives zeros.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        now = transfer_totals(log_path)
        delta = {k: v - before.get(k, 0.0) for k, v in now.items() if v != before.get(k, 0.0)}
        if delta.get("load_calls", 0) >= 1 or time.monotonic() > deadline:
            return delta
        time.sleep(0.2)


# ------------------------------------------------------------------ the prompts


@dataclass
class PromptResult:
    index: int
    prompt_tokens: int
    stream: bool
    reference: Answer
    proxied: Answer
    layout_bytes: int
    loaded: dict[str, float]

    @property
    def identical(self) -> bool:
        return bool(self.reference.token_ids) and self.proxied.token_ids == (
            self.reference.token_ids
        )

    @property
    def loaded_blocks(self) -> int:
        return int(self.loaded.get("load_blocks_ok", 0))

    @property
    def loaded_bytes(self) -> int:
        return int(self.loaded.get("load_bytes", 0))

    @property
    def load_seconds(self) -> float:
        return float(self.loaded.get("load_seconds", 0.0))


def demo_prompts(settings: DemoSettings, spec: TinyModelSpec) -> list[list[int]]:
    """Token-id prompts of exactly the asked lengths (text would re-tokenise to other lengths)."""
    return [
        random_prompts(1, n, seed=i, vocab_size=spec.vocab_size)[0]
        for i, n in enumerate(settings.prompt_tokens)
    ]


def ask_both(
    c: Cluster, settings: DemoSettings, prompt: list[int] | str, *, stream: bool, chat: bool = False
) -> tuple[Answer, Answer, dict[str, float]]:
    """One prompt to the reference, then through the proxy: (reference, proxied, decode's
    counters for it). One at a time, so the timings are not of three servers fighting
    for two cores."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = request_body(prompt, settings.max_tokens, stream=stream, chat=chat)
    before = transfer_totals(c.decode.log_path)
    reference = complete(c.reference.url, path, body, settings.request_timeout_s)
    proxied = complete(c.proxy_url, path, body, settings.request_timeout_s)
    loaded = loaded_since(c.decode.log_path, before, settings.stats_timeout_s)
    return reference, proxied, loaded


def run_prompts(c: Cluster, settings: DemoSettings) -> list[PromptResult]:
    """Every prompt through both paths, alternately streamed and not, after a warm-up."""
    # First requests pay one-off costs (allocations, lazy imports) on every server;
    # a throw-away prompt keeps them out of the first row's TTFT.
    warm_up = random_prompts(1, 200, seed=10_000, vocab_size=c.spec.vocab_size)[0]
    ask_both(c, settings, warm_up, stream=True)
    results = []
    for i, prompt in enumerate(demo_prompts(settings, c.spec)):
        stream = i % 2 == 0
        reference, proxied, loaded = ask_both(c, settings, prompt, stream=stream)
        results.append(
            PromptResult(
                index=i + 1,
                prompt_tokens=len(prompt),
                stream=stream,
                reference=reference,
                proxied=proxied,
                layout_bytes=layout_bytes(c.spec, len(prompt)),
                loaded=loaded,
            )
        )
    return results


# ------------------------------------------------------------------ the report


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


def report(results: Sequence[PromptResult]) -> list[str]:
    """The per-prompt table and its summary lines."""
    header = (
        f"{'#':>2} {'tokens':>6} {'mode':<6} {'identical':<9} {'TTFT P/D':>8} {'TTFT 1x':>8} "
        f"{'layout MiB':>10} {'loaded':>6} {'MiB':>6} {'load ms':>7} {'GB/s':>5}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        gbps = r.loaded_bytes / r.load_seconds / 1e9 if r.load_seconds > 0 else 0.0
        lines.append(
            f"{r.index:>2} {r.prompt_tokens:>6} {'stream' if r.stream else 'whole':<6} "
            f"{'yes' if r.identical else 'NO':<9} {r.proxied.ttft_s * 1e3:>5.0f} ms "
            f"{r.reference.ttft_s * 1e3:>5.0f} ms {_mib(r.layout_bytes):>10} "
            f"{r.loaded_blocks:>6} {_mib(r.loaded_bytes):>6} {r.load_seconds * 1e3:>7.2f} "
            f"{gbps:>5.2f}"
        )
    moved = sum(r.loaded_bytes for r in results)
    expected = sum(r.layout_bytes for r in results)
    seconds = sum(r.load_seconds for r in results)
    rate = f", {moved / seconds / 1e9:.2f} GB/s" if seconds > 0 else ""
    lines += [
        "",
        f"KV loaded by the decode server (its own counters): {_mib(moved)} MiB in "
        f"{seconds * 1e3:.1f} ms{rate}; from the model's layout: {_mib(expected)} MiB "
        f"({'equal' if moved == expected else 'DIFFERENT'})",
        "TTFT P/D: through the proxy (prefill, hand-off, KV load, first token); TTFT 1x: the",
        "single reference server; 'whole' = not streamed, so TTFT = time to the first byte of",
        "the whole answer. layout MiB: whole 128-token blocks x KV per token; loaded (blocks),",
        "MiB, load ms: the decode server's kvmux counters for that request.",
    ]
    return lines


def run_demo(settings: DemoSettings) -> int:
    """The whole demo; 0 when every answer was identical and KV actually moved."""
    started = time.perf_counter()
    spec = MODELS[settings.model]
    per_token = kv_bytes_per_token(spec)
    print(
        f"kvmux demo: vLLM prefill -> kvmux ({settings.backend}) -> vLLM decode, "
        "checked token by token against a single vLLM server"
    )
    print(
        f"model '{settings.model}': {spec.layers} layers, hidden {spec.hidden_size}, "
        f"{spec.num_kv_heads} KV heads x {spec.resolved_head_dim}, float32 -> "
        f"{per_token // 1024} KiB of KV per token, {BLOCK_SIZE}-token blocks"
    )
    log_dir = settings.log_dir or Path(tempfile.mkdtemp(prefix="kvmux-demo-"))
    settings = settings.model_copy(update={"log_dir": log_dir})
    print(f"starting 3 vLLM servers (reference, prefill, decode); logs in {log_dir}", flush=True)
    results: list[PromptResult] = []
    try:
        with cluster(settings) as c:
            print(
                f"servers ready in {c.startup_s:.0f} s; proxy {c.proxy_url} -> prefill "
                f"{c.prefill.url}, decode {c.decode.url}; reference {c.reference.url}",
                flush=True,
            )
            asked = time.perf_counter()
            results = run_prompts(c, settings)
            asking = time.perf_counter() - asked
            print()
            print("\n".join(report(results)))
            print(f"\n{len(results)} prompts x 2 paths in {asking:.1f} s; stopping servers")
            stopping = time.perf_counter()
        print(f"servers stopped in {time.perf_counter() - stopping:.1f} s")
    finally:
        print(f"server logs kept in {log_dir}")
    identical = all(r.identical for r in results)
    moved = sum(r.loaded_blocks for r in results)
    print(f"all tokens identical: {'yes' if identical else 'no'}")
    if moved == 0:
        print("but no KV was loaded through kvmux: decode recomputed every prompt (see decode.log)")
    print(f"demo took {time.perf_counter() - started:.0f} s")
    return 0 if identical and moved > 0 else 1
