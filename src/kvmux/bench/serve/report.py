"""The claim checked, and the results written out: JSON, a Markdown summary.

The claim (the seed's, after Mooncake's SGLang test on an A10: p99 ITL
19.7 ms for 1P1D against 294.9 ms for two colocated instances at the same
throughput): disaggregation bounds tail ITL, because a long prefill no longer
stalls the decode steps of other requests, but it does not add throughput.
So the check compares 1P1D with colocated serving *at equal throughput*
(within 10%), and there asks for 1P1D's p99 ITL to be at most half of
colocated's. Where throughputs part (one side saturates first), the crossover
is reported instead of a verdict.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvmux.bench.serve.crosscheck import CrossCheck
from kvmux.bench.serve.metrics import LatencyStats, RunMetrics
from kvmux.bench.serve.steps import StepProfile

#: Throughputs within this relative difference count as equal.
EQUAL_THROUGHPUT = 0.10
#: The claim: 1P1D's p99 ITL at most this fraction of colocated's.
ITL_RATIO_CLAIMED = 0.5
ANCHOR = (
    "Mooncake's SGLang test (A10): p99 ITL 19.7 ms for 1P1D vs 294.9 ms for two "
    "colocated instances at the same throughput"
)


class ClaimPoint(BaseModel):
    """1P1D against the colocated configuration it is compared with, at one rate."""

    model_config = ConfigDict(frozen=True)

    rate: float
    pd: str
    colocated: str
    pd_throughput: float
    colocated_throughput: float
    pd_p99_itl_ms: float
    colocated_p99_itl_ms: float
    pd_goodput: float
    colocated_goodput: float

    @property
    def throughput_difference(self) -> float:
        """(1P1D - colocated) / colocated."""
        return (self.pd_throughput - self.colocated_throughput) / self.colocated_throughput

    @property
    def equal_throughput(self) -> bool:
        return abs(self.throughput_difference) <= EQUAL_THROUGHPUT

    @property
    def itl_ratio(self) -> float:
        return self.pd_p99_itl_ms / self.colocated_p99_itl_ms

    @property
    def holds(self) -> bool:
        return self.equal_throughput and self.itl_ratio <= ITL_RATIO_CLAIMED


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    pd: str
    points: list[ClaimPoint]
    direction_matches: bool
    """At every rate with equal throughput (and there is one) the claim holds."""
    crossover: str


class ServeReport(BaseModel):
    model_config = ConfigDict(frozen=True)

    settings: dict[str, Any]
    model: dict[str, Any]
    cpus: int
    started_at: str
    wall_s: float
    runs: list[RunMetrics]
    verdicts: list[Verdict]
    crosscheck: CrossCheck | None = None
    crosscheck_error: str | None = None
    kv_loaded: dict[str, dict[str, float]] = {}
    """Per 1P1D topology, its decode server's kvmux load counters over all its runs."""
    steps: StepProfile | None = None
    """Decode step vs batch and prefill vs length on one core (the mechanism)."""
    notes: list[str] = []


def _comparable(run: RunMetrics) -> bool:
    return run.itl is not None and run.output_throughput > 0


def pair(pd: RunMetrics, colocated: RunMetrics) -> ClaimPoint | None:
    """1P1D against one colocated run of the same rate; None if either has no ITL."""
    if not (_comparable(pd) and _comparable(colocated)):
        return None
    assert pd.itl is not None and colocated.itl is not None
    return ClaimPoint(
        rate=pd.rate,
        pd=pd.topology,
        colocated=colocated.topology,
        pd_throughput=pd.output_throughput,
        colocated_throughput=colocated.output_throughput,
        pd_p99_itl_ms=pd.itl.p99_ms,
        colocated_p99_itl_ms=colocated.itl.p99_ms,
        pd_goodput=pd.goodput,
        colocated_goodput=colocated.goodput,
    )


def claim_point(pd: RunMetrics, colocated: Sequence[RunMetrics]) -> ClaimPoint | None:
    """1P1D at one rate against the colocated run that serves it best: among those at
    equal throughput, the one with the lowest p99 ITL (the strongest opponent); if none
    is at equal throughput, the one with the highest throughput."""
    points = [p for p in (pair(pd, c) for c in colocated) if p is not None]
    if not points:
        return None
    equal = [p for p in points if p.equal_throughput]
    if equal:
        return min(equal, key=lambda p: p.colocated_p99_itl_ms)
    return max(points, key=lambda p: p.colocated_throughput)


def every_pair(runs: Sequence[RunMetrics]) -> list[ClaimPoint]:
    """Each 1P1D run against each colocated run of its rate: where the claim holds
    against which chunk size, not only against the strongest."""
    pds = [r for r in runs if r.topology.startswith("1P1D")]
    colocated = [r for r in runs if r.topology.startswith("colocated")]
    pairs = [pair(p, c) for p in pds for c in colocated if c.rate == p.rate]
    return sorted((p for p in pairs if p is not None), key=lambda p: (p.pd, p.colocated, p.rate))


def crossover(points: Sequence[ClaimPoint]) -> str:
    """The lowest rate from which colocated serving does better than 1P1D: more
    goodput, or 1P1D's throughput more than 10% lower (saturated first)."""
    ordered = sorted(points, key=lambda p: p.rate)
    for p in ordered:
        saturated = p.throughput_difference < -EQUAL_THROUGHPUT
        if saturated or p.colocated_goodput > p.pd_goodput:
            why = (
                f"1P1D's throughput is {-p.throughput_difference:.0%} below"
                if saturated
                else f"goodput {p.colocated_goodput:.2f} vs {p.pd_goodput:.2f} req/s"
            )
            where = "already at" if p is ordered[0] else "at"
            return f"{where} {p.rate:g} req/s ({p.colocated} over {p.pd}: {why})"
    if not ordered:
        return "no rate where both topologies completed requests"
    return f"none up to {ordered[-1].rate:g} req/s (1P1D's goodput never fell below colocated's)"


def verdicts(runs: Sequence[RunMetrics]) -> list[Verdict]:
    pd_names = sorted({r.topology for r in runs if r.topology.startswith("1P1D")})
    colocated = [r for r in runs if r.topology.startswith("colocated")]
    out = []
    for name in pd_names:
        points = []
        for pd in sorted((r for r in runs if r.topology == name), key=lambda r: r.rate):
            p = claim_point(pd, [c for c in colocated if c.rate == pd.rate])
            if p is not None:
                points.append(p)
        equal = [p for p in points if p.equal_throughput]
        out.append(
            Verdict(
                pd=name,
                points=points,
                direction_matches=bool(equal) and all(p.holds for p in equal),
                crossover=crossover(points),
            )
        )
    return out


# ------------------------------------------------------------------ writing


def _steps_section(steps: StepProfile | None) -> list[str]:
    """The measured mechanism: how a decode step grows with the batch on one core
    (1P1D's decode server holds every decode), and what a prefill chunk costs
    (what it adds to a colocated decode step)."""
    if steps is None:
        return []
    paths = list(dict.fromkeys(s.path for s in steps.steps))
    batches = sorted({s.batch for s in steps.steps})
    lines = [
        "## The mechanism, measured on one core",
        "",
        "Decode step vs batch: `n` requests of 64-token prompts decoding together on one "
        "pinned server; their token gaps, p50 / p99 ms.",
        "",
        "| batch | " + " | ".join(paths) + " |",
        "|---:|" + "---:|" * len(paths),
    ]
    for b in batches:
        cells = []
        for path in paths:
            point = steps.step(path, b)
            cells.append(
                "-" if point is None else f"{point.itl.p50_ms:.1f} / {point.itl.p99_ms:.1f}"
            )
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Prefill vs length (one request alone, time to first token; a colocated chunk of "
        "that many tokens adds about this to the decode step it shares):",
        "",
        "| prompt tokens | " + " | ".join(str(p.prompt_tokens) for p in steps.prefills) + " |",
        "|---|" + "---:|" * len(steps.prefills),
        "| TTFT ms | " + " | ".join(f"{p.ttft_ms:.0f}" for p in steps.prefills) + " |",
        "",
    ]
    return lines


def write_json(report: ServeReport, path: Path) -> None:
    path.write_text(json.dumps(report.model_dump(mode="json"), indent=1) + "\n")


def _triple(stats: LatencyStats | None) -> str:
    if stats is None:
        return "-"
    return f"{stats.p50_ms:.0f} / {stats.p90_ms:.0f} / {stats.p99_ms:.0f}"


def _where_it_holds(points: Sequence[ClaimPoint]) -> str:
    """The rates of equal throughput split by whether the claim holds there."""
    equal = [p for p in points if p.equal_throughput]
    held = [f"{p.rate:g}" for p in equal if p.holds]
    not_held = [f"{p.rate:g}" for p in equal if not p.holds]
    return (
        f"It holds at {', '.join(held) or 'no rate'} req/s and not at "
        f"{', '.join(not_held) or 'any other'} req/s of equal throughput."
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _load_of(report: ServeReport, topology: str, rate: float) -> str:
    run = next((r for r in report.runs if r.topology == topology and r.rate == rate), None)
    return "-" if run is None or run.load_average is None else f"{run.load_average:.1f}"


def markdown(report: ServeReport, plots: Sequence[str] = ()) -> str:
    """The summary a reader looks at first: settings, every run, the claim, the cross-check."""
    s = report.settings
    slo = report.runs[0].slo if report.runs else None
    lines = [
        "# kvmux bench serve",
        "",
        f"Started {report.started_at}, {report.wall_s / 60:.1f} min, {report.cpus} cores. "
        f"Rates {s.get('rates')} req/s, {s.get('duration_s')} s of Poisson arrivals each "
        f"(seed {s.get('seed')}); mix {s.get('mix')}.",
        f"Model: {report.model}.",
    ]
    if slo is not None:
        lines.append(
            f"Goodput SLO: TTFT <= {slo.ttft_ms:g} ms and every token gap <= {slo.itl_ms:g} ms."
        )
    lines += [*(f"Note: {n}" for n in report.notes), "", "## Runs", ""]
    lines += [
        "| topology | rate (req/s) | done / sent | output tok/s | goodput req/s | "
        "TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | E2E p50/p90/p99 ms | load | "
        "client / proxy cores |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.runs:
        load = "-" if r.load_average is None else f"{r.load_average:.1f}"
        used = (
            "-"
            if r.client_cores is None or r.proxy_cores is None
            else f"{r.client_cores:.2f} / {r.proxy_cores:.2f}"
        )
        lines.append(
            f"| {r.topology} | {r.rate:g} | {r.completed} / {r.requests} | "
            f"{r.output_throughput:.1f} | {r.goodput:.2f} | {_triple(r.ttft)} | "
            f"{_triple(r.itl)} | {_triple(r.e2e)} | {load} | {used} |"
        )
    lines.append(
        "\nload: the 1-minute load average as the run ended. This benchmark's own processes "
        "count (two servers of an API and an engine process each, the client and proxy): "
        "2 or more under load on their own; well above that, other processes "
        "shared the pinned cores. client / proxy cores: CPU time of the load generator's "
        "and the proxy's processes over the run's wall time; both are unpinned, so this "
        "much CPU was taken from the servers' two cores."
    )
    failed = [r for r in report.runs if r.errors]
    for r in failed:
        lines.append(f"\n{r.topology} at {r.rate:g} req/s: {r.failed} failed, e.g. {r.errors[0]}")
    for name, kv in report.kv_loaded.items():
        lost = kv.get("load_blocks_failed", 0) + kv.get("load_blocks_missing", 0)
        lines.append(
            f"\n{name}: the decode server loaded {kv.get('load_blocks_ok', 0):.0f} blocks "
            f"({kv.get('load_bytes', 0) / 2**20:.0f} MiB) through kvmux, {lost:.0f} failed or "
            "missing (its own counters)"
            + ("" if kv.get("load_blocks_ok", 0) else ": NO KV MOVED, decode recomputed prompts")
        )
    lines += ["", "## The claim", "", f"Anchor: {ANCHOR}.", ""]
    for v in report.verdicts:
        lines += [
            f"### {v.pd} against the best colocated configuration at each rate",
            "",
            "| rate | colocated | tok/s 1P1D / colo | equal (±10%) | p99 ITL 1P1D / colo ms "
            "| ratio | holds (<= 0.5) |",
            "|---:|---|---:|---|---:|---:|---|",
        ]
        for p in v.points:
            lines.append(
                f"| {p.rate:g} | {p.colocated} | {p.pd_throughput:.1f} / "
                f"{p.colocated_throughput:.1f} | {'yes' if p.equal_throughput else 'no'} | "
                f"{p.pd_p99_itl_ms:.0f} / {p.colocated_p99_itl_ms:.0f} | {p.itl_ratio:.2f} | "
                f"{'yes' if p.holds else 'no'} |"
            )
        lines += [
            "",
            f"Direction as claimed: **{'yes' if v.direction_matches else 'no'}** (at every rate "
            f"of equal throughput). {_where_it_holds(v.points)} Crossover: {v.crossover}.",
            "",
        ]
    pairs = every_pair(report.runs)
    if pairs:
        lines += [
            "### 1P1D against every colocated configuration",
            "",
            "| 1P1D | colocated | rate | tok/s 1P1D / colo | p99 ITL 1P1D / colo ms | ratio "
            "| holds |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {p.pd} | {p.colocated} | {p.rate:g} | {p.pd_throughput:.1f} / "
            f"{p.colocated_throughput:.1f} | {p.pd_p99_itl_ms:.0f} / "
            f"{p.colocated_p99_itl_ms:.0f} | {p.itl_ratio:.2f} | {_yes(p.holds)} |"
            for p in pairs
        ]
        lines.append("")
    if report.verdicts:
        lines += [
            "Throughput is vLLM's: generated tokens over the whole run, its drain included; "
            "at a rate both sustain, the one with the slower tail reads lower.",
            "",
        ]
    lines += _steps_section(report.steps)
    lines += ["## Cross-check with vLLM's serving benchmark", ""]
    c = report.crosscheck
    if c is None:
        lines.append(report.crosscheck_error or "Not run.")
    else:
        lines += [
            f"{c.topology} at {c.rate:g} req/s: after kvmux's run of that point, its arrival "
            "schedule replayed by `vllm.benchmarks.serve`, then by kvmux's load generator, "
            "back to back on the same (equally warm) servers, fresh prompts of the same kinds "
            f"each (log: {c.vllm_log}). The two replays agree within 10%: "
            f"**{_yes(all(f.agrees for f in c.clients))}**; kvmux's metrics over vLLM's own "
            f"timings equal vLLM's: **{_yes(all(f.agrees for f in c.definitions))}**. "
            f"Load average at the end of kvmux's run: {_load_of(report, c.topology, c.rate)}.",
            "",
            "| figure | kvmux | vLLM | difference | within 10% |",
            "|---|---:|---:|---:|---|",
        ]
        for f in [*c.clients, *c.definitions]:
            lines.append(
                f"| {f.figure} | {f.kvmux:.2f} | {f.vllm:.2f} | {f.relative_difference:.1%} | "
                f"{'yes' if f.agrees else 'no'} |"
            )
    if plots:
        lines += ["", "## Plots", "", *(f"![{Path(p).stem}]({Path(p).name})" for p in plots)]
    return "\n".join(lines) + "\n"
