"""The mechanism, measured: decode step time against batch size on one pinned core.

Whether 1P1D bounds tail ITL at equal throughput rests on two costs, and this
machine is not the GPU of the published anchor, so both are measured here
rather than assumed:

* **decode step vs batch** - on a GPU a decode step is memory-bound and
  hardly slower for twice the batch, so a 1P1D decode instance that holds
  every request's decode (twice a colocated instance's batch) steps about as
  fast. On a CPU each sequence adds its own compute and its own streaming
  work (the API server is pinned to the same core), so it may not. A batch of
  ``n`` short-prompt requests sent at once: their median token gap is the
  step time at batch ``n``, as a client sees it;
* **prefill vs length** - a colocated decode step that also runs a prefill
  chunk of ``c`` tokens takes about that chunk's prefill longer: the stall the
  claim is about. One request's time to first token is its prefill.

The models here import no client (the report reads them); measuring does.
Two servers start side by side, each alone on one core and probed while the
other idles: a plain one (probed directly and through the ``kvmux proxy``: what
the proxy's token relay adds) and a 1P1D decode server, kvmux connector loaded
(what the connector's per-step work adds when it has nothing to load), the
latter once more while the plain server prefills long prompts back to back, as
a 1P1D prefill server does: what one core's prefills cost the other core's
decode steps through what they share (caches, memory, the host under the VM).
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from kvmux.bench.serve.metrics import LatencyStats, RequestTiming
from kvmux.bench.serve.settings import SERVE_MODEL
from kvmux.bench.serve.topology import (
    SERVED_MODEL,
    ServerSettings,
    Topology,
    fronted,
    pd_transfer_config,
    server_args,
)
from kvmux.bench.serve.workload import PlannedRequest, RequestKind
from kvmux.demo.servers import ServerError, VllmServer
from kvmux.models import random_prompts

ProbePath = Literal[
    "direct", "via proxy", "kvmux decode server", "kvmux decode, other core prefilling"
]

#: Prompt of each decode in a batch: short, so the step is decode work alone.
DECODE_PROMPT_TOKENS = 64
#: Times each prefill length is measured (the median is reported).
PREFILL_REPEATS = 3


class StepPoint(BaseModel):
    """Token gaps of ``batch`` requests decoding together, on one path."""

    model_config = ConfigDict(frozen=True)

    path: ProbePath
    batch: int
    itl: LatencyStats


class PrefillPoint(BaseModel):
    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    ttft_ms: float
    """Median time to first token of one request alone on the server."""


class StepProfile(BaseModel):
    """What one decode step and one prefill cost on one core of this machine."""

    model_config = ConfigDict(frozen=True)

    steps: list[StepPoint]
    prefills: list[PrefillPoint]

    def step(self, path: ProbePath, batch: int) -> StepPoint | None:
        return next((s for s in self.steps if s.path == path and s.batch == batch), None)


def profile_steps(
    model_dir: Path,
    log_dir: Path,
    settings: ServerSettings,
    pd: Topology,
    batches: Sequence[int],
    decode_tokens: int,
    prefill_lengths: Sequence[int],
    long_prompt_tokens: int,
) -> StepProfile:
    """Start the two servers (plain on core 0, ``pd``'s decode server on core 1),
    measure, stop them; see the module docstring."""
    from kvmux.proxy import ProxyConfig

    whole = settings.max_model_len
    plain = VllmServer(
        "plain",
        model_dir,
        server_args(settings, whole, None),
        log_dir=log_dir,
        env={"VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)},
        cpus=(0,),
    )
    decode = VllmServer(
        "decode",
        model_dir,
        server_args(settings, whole, pd_transfer_config("kv_consumer", pd, settings)),
        log_dir=log_dir,
        env={"VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)},
        cpus=(1,),
    )
    config = ProxyConfig(colocated=True, decode=[plain.url], timeout_s=settings.request_timeout_s)
    with fronted([plain, decode], config, log_dir / "proxy.log", settings) as proxy:
        proxied = proxy.url
        urls: list[tuple[ProbePath, str]] = [
            ("direct", plain.url),
            ("via proxy", proxied),
            ("kvmux decode server", decode.url),
        ]
        prompts = _Prompts()
        for _, url in urls:  # first requests pay one-off costs
            _send(url, prompts.take(2, DECODE_PROMPT_TOKENS), 4, settings.request_timeout_s)
        steps = []
        for batch in batches:
            for path, url in urls:
                timings = _send(
                    url,
                    prompts.take(batch, DECODE_PROMPT_TOKENS),
                    decode_tokens,
                    settings.request_timeout_s,
                )
                gaps = [g for t in timings for g in t.itls_s]
                itl = LatencyStats.of(gaps)
                if itl is None:
                    raise ServerError(f"{path}: no token gap at batch {batch}")
                steps.append(StepPoint(path=path, batch=batch, itl=itl))
            busy = asyncio.run(
                _decode_while_prefilling(
                    decode.url,
                    prompts.take(batch, DECODE_PROMPT_TOKENS),
                    decode_tokens,
                    plain.url,
                    prompts.take(100, long_prompt_tokens),
                    settings.request_timeout_s,
                )
            )
            steps.append(
                StepPoint(path="kvmux decode, other core prefilling", batch=batch, itl=busy)
            )
        prefills = []
        for length in prefill_lengths:
            ttfts = [
                _send(plain.url, prompts.take(1, length), 2, settings.request_timeout_s)[0].ttft_s
                * 1e3
                for _ in range(PREFILL_REPEATS)
            ]
            prefills.append(PrefillPoint(prompt_tokens=length, ttft_ms=statistics.median(ttfts)))
        return StepProfile(steps=steps, prefills=prefills)


class _Prompts:
    """Prompts no earlier probe sent (a repeat would be a prefix-cache hit)."""

    def __init__(self) -> None:
        self._seed = 777_000

    def take(self, n: int, tokens: int) -> list[list[int]]:
        self._seed += 1
        return random_prompts(n, tokens, self._seed, SERVE_MODEL.vocab_size)


async def _decode_while_prefilling(
    decode_url: str,
    decode_prompts: Sequence[list[int]],
    decode_tokens: int,
    prefill_url: str,
    long_prompts: Sequence[list[int]],
    timeout_s: float,
) -> LatencyStats:
    """Token gaps of ``decode_prompts`` on ``decode_url`` while ``prefill_url`` prefills
    ``long_prompts`` one after another (one output token each) until they are done."""
    from kvmux.bench.serve.load import run_load

    kind: RequestKind = "long-output"
    planned = [PlannedRequest(i, kind, p, decode_tokens, 0.0) for i, p in enumerate(decode_prompts)]
    done = asyncio.Event()

    async def prefill_meanwhile() -> None:
        for prompt in long_prompts:
            if done.is_set():
                return
            await run_load(
                prefill_url,
                SERVED_MODEL,
                [PlannedRequest(0, "long-prompt", prompt, 1, 0.0)],
                timeout_s,
            )
        raise ServerError("the prefills ran out before the decodes ended")

    background = asyncio.create_task(prefill_meanwhile())
    await asyncio.sleep(0.5)  # the prefills under way first
    timings = await run_load(decode_url, SERVED_MODEL, planned, timeout_s)
    done.set()
    await background
    itl = LatencyStats.of([g for t in timings if t.ok for g in t.itls_s])
    if itl is None or not all(t.ok for t in timings):
        raise ServerError(f"decodes on {decode_url} failed while the other core prefilled")
    return itl


def _send(
    url: str, prompts: Sequence[list[int]], max_tokens: int, timeout_s: float
) -> list[RequestTiming]:
    """``prompts`` all sent at once; raises if any failed (a probe must not guess)."""
    from kvmux.bench.serve.load import run_load

    kind: RequestKind = "long-output"
    planned = [PlannedRequest(i, kind, p, max_tokens, 0.0) for i, p in enumerate(prompts)]
    timings = asyncio.run(run_load(url, SERVED_MODEL, planned, timeout_s))
    failed = [t.error for t in timings if not t.ok]
    if failed:
        raise ServerError(f"a step probe request to {url} failed: {failed[0]}")
    return timings
