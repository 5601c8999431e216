"""``kvmux bench serve``: colocated serving against 1P1D through kvmux, under load.

For each topology (:mod:`~kvmux.bench.serve.topology`) the servers start once;
then every rate's planned requests (:mod:`~kvmux.bench.serve.workload`, the
same for every topology) are sent by the load generator
(:mod:`~kvmux.bench.serve.load`) and summarised
(:mod:`~kvmux.bench.serve.metrics`). One point is replayed by vLLM's own
serving benchmark (:mod:`~kvmux.bench.serve.crosscheck`). The results go to
``--out``: ``results.json`` (everything, every token gap included),
``summary.md`` and two PNG plots (:mod:`~kvmux.bench.serve.plots`).

The defaults are sized for a 2-core machine and about 20 minutes: the step
profile (:mod:`~kvmux.bench.serve.steps`, ~2 min), four topologies of ~40 s
start-up each, five rates of 40 s of arrivals each (and their drains).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmux.bench.serve.crosscheck import CrossCheck, cross_check
from kvmux.bench.serve.load import run_load
from kvmux.bench.serve.metrics import RunMetrics, summarize
from kvmux.bench.serve.plots import missing_reason, write_plots
from kvmux.bench.serve.report import ServeReport, markdown, verdicts, write_json
from kvmux.bench.serve.settings import SERVE_MODEL, ServeSettings
from kvmux.bench.serve.steps import StepProfile, profile_steps
from kvmux.bench.serve.topology import (
    SERVED_MODEL,
    ServerSettings,
    Topology,
    kvmux_counters,
    serving,
)
from kvmux.bench.serve.workload import PlannedRequest, RequestMix
from kvmux.demo.servers import ServerError
from kvmux.errors import KvmuxError
from kvmux.models import random_prompts, tiny_model

#: The decode side's counters that show KV moved (or did not).
KV_STATS = ("load_blocks_ok", "load_bytes", "load_blocks_failed", "load_blocks_missing")


class ServeBenchError(KvmuxError, RuntimeError):
    """A topology that cannot serve at all (its warm-up failed): no figure would mean much."""


@dataclass
class _Results:
    """What the topologies have measured so far."""

    runs: list[RunMetrics] = field(default_factory=list)
    kv: dict[str, dict[str, float]] = field(default_factory=dict)
    check: CrossCheck | None = None
    check_error: str | None = None
    steps: StepProfile | None = None
    notes: list[str] = field(default_factory=list)


def run_serve(
    settings: ServeSettings, out: Path, progress: Callable[[str], None] = print
) -> ServeReport:
    """Every topology at every rate; writes ``out``/results.json, summary.md, *.png.

    A topology that cannot start or serve is reported (in the notes) and the
    others still run: a long run never ends with nothing written.
    """
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    out.mkdir(parents=True, exist_ok=True)
    results = _Results()
    no_plots = missing_reason()
    if no_plots is not None:
        progress(no_plots)
        results.notes.append(no_plots)
    results.notes.append(f"load average at the start {_load_average()} (1, 5, 15 min)")
    model_dir = tiny_model(SERVE_MODEL)
    pds = [t for t in settings.topologies() if t.kind == "pd"]
    checked = pds[0] if settings.crosscheck and pds else None
    if settings.step_batches and pds:
        progress(f"step profile: decode step vs batch {list(settings.step_batches)}, one core")
        try:
            results.steps = profile_steps(
                model_dir,
                out / "logs" / "steps",
                _server_settings(settings),
                pds[0],
                settings.step_batches,
                settings.step_tokens,
                settings.prefill_lengths(),
                settings.mix.long_prompt_tokens,
            )
        except (ServerError, OSError) as exc:
            results.notes.append(f"the step profile was not measured: {exc}")
            progress(results.notes[-1])
        else:
            for point in results.steps.steps:
                itl = point.itl
                progress(
                    f"  {point.path}, batch {point.batch}: "
                    f"ITL p50/p99 {itl.p50_ms:.1f}/{itl.p99_ms:.1f} ms"
                )
            for prefill in results.steps.prefills:
                progress(f"  prefill of {prefill.prompt_tokens} tokens: {prefill.ttft_ms:.0f} ms")
    for topology in settings.topologies():
        progress(f"{topology.name}: starting servers (logs in {out / 'logs'})")
        try:
            _measure(topology, settings, model_dir, out, results, progress, topology == checked)
        except (ServerError, ServeBenchError, OSError) as exc:
            results.notes.append(f"{topology.name} was not measured in full: {exc}")
            progress(results.notes[-1])
    results.notes.append(
        f"load average at the end {_load_average()} (this benchmark's own processes make "
        "2 or more under load; well above that, other processes shared the pinned cores)"
    )
    report = ServeReport(
        settings=settings.model_dump(mode="json"),
        model=SERVE_MODEL.model_dump(mode="json", exclude_defaults=True),
        cpus=os.cpu_count() or 0,
        started_at=started_at,
        wall_s=time.perf_counter() - started,
        runs=results.runs,
        verdicts=verdicts(results.runs),
        crosscheck=results.check,
        crosscheck_error=results.check_error,
        kv_loaded=results.kv,
        steps=results.steps,
        notes=results.notes,
    )
    write_json(report, out / "results.json")
    plots = [] if no_plots is not None else write_plots(results.runs, out)
    (out / "summary.md").write_text(markdown(report, [str(p) for p in plots]))
    return report


def _measure(
    topology: Topology,
    settings: ServeSettings,
    model_dir: Path,
    out: Path,
    results: _Results,
    progress: Callable[[str], None],
    cross_checked: bool,
) -> None:
    """One topology: start it, every rate (and the cross-check, if this is the topology
    for it), then its decode's kvmux counters."""
    with serving(topology, model_dir, out / "logs", _server_settings(settings)) as served:
        _warm_up(served.url, settings.mix, settings.request_timeout_s)
        # The lowest rate is cross-checked: the least noisy point to measure again,
        # right after kvmux's own run of it (crosscheck: like with like).
        checked_index = settings.rates.index(min(settings.rates)) if cross_checked else None
        for index, rate in enumerate(settings.rates):
            planned = settings.plan_for(index)
            progress(f"{topology.name}: {rate:g} req/s, {len(planned)} requests")
            wall, client, proxy = (
                time.perf_counter(),
                time.process_time(),
                served.proxy_cpu_seconds(),
            )
            timings = asyncio.run(
                run_load(served.url, SERVED_MODEL, planned, settings.request_timeout_s)
            )
            wall = time.perf_counter() - wall
            used = {
                "load_average": round(os.getloadavg()[0], 2),
                "client_cores": round((time.process_time() - client) / wall, 3),
                "proxy_cores": round((served.proxy_cpu_seconds() - proxy) / wall, 3),
            }
            run = summarize(topology.name, rate, timings, settings.slo).model_copy(update=used)
            results.runs.append(run)
            progress("  " + one_line(run))
            if index == checked_index:
                progress(f"{topology.name}: cross-check with vLLM's benchmark at {rate:g} req/s")
                try:
                    results.check = cross_check(
                        topology.name,
                        rate,
                        served.url,
                        SERVED_MODEL,
                        model_dir,
                        (settings.plan_for(index, replay=1), settings.plan_for(index, replay=2)),
                        settings.slo,
                        out / "logs" / "vllm-benchmark.log",
                        settings.request_timeout_s,
                    )
                except (ImportError, ValueError, KeyError) as exc:
                    results.check_error = f"the cross-check failed: {type(exc).__name__}: {exc}"
                    progress(results.check_error)
        if served.decode_urls:
            counters = [kvmux_counters(u) for u in served.decode_urls]
            kv = {k: sum(c.get(k, 0.0) for c in counters) for k in KV_STATS}
            results.kv[topology.name] = kv
            progress(f"{topology.name}: decode's kvmux counters {kv}")


def _server_settings(settings: ServeSettings) -> ServerSettings:
    return ServerSettings(
        max_model_len=settings.mix.longest_sequence,
        max_num_seqs=settings.max_num_seqs,
        request_timeout_s=settings.request_timeout_s,
    )


def one_line(run: RunMetrics) -> str:
    itl = run.itl
    ttft = run.ttft
    return (
        f"{run.completed}/{run.requests} done, {run.output_throughput:.1f} tok/s, "
        f"goodput {run.goodput:.2f} req/s, TTFT p50 {ttft.p50_ms if ttft else 0:.0f} ms, "
        f"ITL p50/p99 {itl.p50_ms if itl else 0:.0f}/{itl.p99_ms if itl else 0:.0f} ms, "
        f"load average {run.load_average}, client/proxy {run.client_cores}/{run.proxy_cores} "
        "cores"
    )


def _load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def _warm_up(url: str, mix: RequestMix, timeout_s: float) -> None:
    """Two long prompts (one per colocated instance) before any timing: first requests
    pay one-off costs (allocations, lazy imports) that no rate should see."""
    prompts: Sequence[list[int]] = random_prompts(
        2, mix.long_prompt_tokens, seed=999_999, vocab_size=SERVE_MODEL.vocab_size
    )
    warm = [PlannedRequest(i, "long-prompt", p, 4, 0.0) for i, p in enumerate(prompts)]
    timings = asyncio.run(run_load(url, SERVED_MODEL, warm, timeout_s))
    failed = [t.error for t in timings if not t.ok]
    if failed:
        raise ServeBenchError(f"warm-up requests failed at {url}: {failed[0]}")
