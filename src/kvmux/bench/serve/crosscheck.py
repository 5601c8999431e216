"""The cross-check: vLLM's own serving benchmark on the same point, figure for figure.

``vllm.benchmarks.serve.benchmark`` (importable although the ``vllm`` CLI is
not, shared/NOTES.md) is driven on the same topology with the same arrival
schedule (its ``self_timed`` mode replays our arrival times). Like is compared
with like: right after kvmux's run of the point (which warms the servers),
vLLM's benchmark replays it, then kvmux's load generator replays it again;
each replay has fresh prompts of the same kinds and lengths (the same prompts
again would be prefix-cache hits), so the two clients meet equally warm
servers, back to back, and neither shares a process with the proxy
(:mod:`~kvmux.bench.serve.proxy_process`). The first run of the point, on
servers that had served only the warm-up, is not what vLLM's replay is held
against. Two comparisons come out of it:

* **client vs client** - kvmux's replay and vLLM's replay of that point: output
  throughput, mean TTFT and median ITL should agree within 10% (two runs on
  a noisy machine: no tails, which differ by nature; and the mean TTFT, since
  TTFTs of a mix of long and short prompts fall in two clusters whose median
  jumps from one to the other);
* **definitions** - kvmux's :func:`~kvmux.bench.serve.metrics.summarize` over
  vLLM's own per-request timings must give vLLM's figures (exact up to the
  duration each counts): proof that both mean the same by TTFT and ITL.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvmux.bench.serve.load import run_load
from kvmux.bench.serve.metrics import RequestTiming, RunMetrics, Slo, summarize
from kvmux.bench.serve.workload import PlannedRequest

#: Relative difference within which two figures agree.
TOLERANCE = 0.10


class FigureCheck(BaseModel):
    model_config = ConfigDict(frozen=True)

    figure: str
    kvmux: float
    vllm: float

    @property
    def relative_difference(self) -> float:
        return abs(self.kvmux - self.vllm) / abs(self.vllm) if self.vllm else float("inf")

    @property
    def agrees(self) -> bool:
        return self.relative_difference <= TOLERANCE


class CrossCheck(BaseModel):
    model_config = ConfigDict(frozen=True)

    topology: str
    rate: float
    clients: list[FigureCheck]
    """kvmux's replay against vLLM's replay of the same point."""
    definitions: list[FigureCheck]
    """kvmux's metrics over vLLM's timings against vLLM's metrics over them."""
    vllm_log: str

    @property
    def agrees(self) -> bool:
        return all(c.agrees for c in [*self.clients, *self.definitions])


def vllm_benchmark(
    url: str, model: str, tokenizer_dir: Path, requests: Sequence[PlannedRequest], log: Path
) -> dict[str, Any]:
    """vLLM's serving benchmark over ``requests`` (their arrival times replayed);
    its result dict. What it prints goes to ``log``, its per-request figures beside it
    (``.json``)."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType, benchmark
    from vllm.tokenizers import get_tokenizer

    samples = [
        SampleRequest(
            prompt=r.prompt,
            prompt_len=len(r.prompt),
            expected_output_len=r.max_tokens,
            timestamp=r.arrival_s,
        )
        for r in requests
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result: dict[str, Any] = asyncio.run(
            benchmark(
                task_type=TaskType.GENERATION,
                endpoint_type="openai",
                api_url=url + "/v1/completions",
                base_url=url,
                model_id=model,
                model_name=model,
                tokenizer=get_tokenizer(str(tokenizer_dir)),
                input_requests=samples,
                logprobs=None,
                request_rate=float("inf"),
                burstiness=1.0,
                disable_tqdm=True,
                num_warmups=0,
                profile=False,
                selected_percentile_metrics=["ttft", "itl", "e2el"],
                selected_percentiles=[50.0, 90.0, 99.0],
                ignore_eos=True,
                goodput_config_dict={},
                max_concurrency=None,
                lora_modules=None,
                extra_headers=None,
                extra_body={"temperature": 0.0},
                ready_check_timeout_sec=0,  # its probe request would warm the prefix cache
                self_timed=True,
            )
        )
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(printed.getvalue())
    raw = {k: v for k, v in result.items() if k != "generated_texts"}
    log.with_suffix(".json").write_text(json.dumps(raw, default=str) + "\n")
    return result


def timings_from_vllm(
    result: dict[str, Any], requests: Sequence[PlannedRequest]
) -> list[RequestTiming]:
    """vLLM's per-request outputs as kvmux timings (chunk times rebuilt from TTFT + ITLs)."""
    starts = result["start_times"]
    # vLLM's clock starts when its benchmark does: the first request went out at
    # its arrival time after that.
    origin = starts[0] - requests[0].arrival_s
    timings = []
    for i, request in enumerate(requests):
        error = result["errors"][i] or None
        if error is not None or result["ttfts"][i] is None:
            timings.append(
                RequestTiming(request.kind, starts[i] - origin, (), 0, error or "failed")
            )
            continue
        sent = starts[i] - origin
        times = [sent + result["ttfts"][i]]
        for gap in result["itls"][i]:
            times.append(times[-1] + gap)
        timings.append(RequestTiming(request.kind, sent, tuple(times), result["output_lens"][i]))
    return timings


def compare(
    ours: RunMetrics, result: dict[str, Any], theirs_as_ours: RunMetrics
) -> tuple[list[FigureCheck], list[FigureCheck]]:
    """(client vs client, definitions) checks; see the module docstring."""
    if ours.ttft is None or ours.itl is None:
        raise ValueError(f"{ours.topology} at {ours.rate}/s completed no request to compare")
    if theirs_as_ours.ttft is None or theirs_as_ours.itl is None:
        raise ValueError("vLLM's benchmark completed no request to compare")
    clients = [
        FigureCheck(
            figure="output throughput (tok/s)",
            kvmux=ours.output_throughput,
            vllm=result["output_throughput"],
        ),
        FigureCheck(figure="mean TTFT (ms)", kvmux=ours.ttft.mean_ms, vllm=result["mean_ttft_ms"]),
        FigureCheck(figure="median ITL (ms)", kvmux=ours.itl.p50_ms, vllm=result["median_itl_ms"]),
    ]
    definitions = [
        FigureCheck(
            figure=f"p{q} {name} (ms), same timings",
            kvmux=getattr(stats, f"p{q}_ms"),
            vllm=result[f"p{q}_{key}_ms"],
        )
        for name, key, stats in (
            ("TTFT", "ttft", theirs_as_ours.ttft),
            ("ITL", "itl", theirs_as_ours.itl),
        )
        for q in (50, 99)
    ]
    return clients, definitions


def cross_check(
    topology: str,
    rate: float,
    url: str,
    model: str,
    tokenizer_dir: Path,
    replays: tuple[Sequence[PlannedRequest], Sequence[PlannedRequest]],
    slo: Slo,
    log: Path,
    timeout_s: float,
) -> CrossCheck:
    """vLLM's benchmark over ``replays[0]``, then kvmux's load generator over
    ``replays[1]`` (the same schedule and kinds, other fresh prompts), and compare."""
    theirs, ours_planned = replays
    result = vllm_benchmark(url, model, tokenizer_dir, theirs, log)
    ours = summarize(
        topology, rate, asyncio.run(run_load(url, model, ours_planned, timeout_s)), slo
    )
    theirs_as_ours = summarize(topology, rate, timings_from_vllm(result, theirs), slo)
    clients, definitions = compare(ours, result, theirs_as_ours)
    return CrossCheck(
        topology=topology,
        rate=rate,
        clients=clients,
        definitions=definitions,
        vllm_log=str(log),
    )
