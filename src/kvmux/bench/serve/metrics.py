"""What a client saw, turned into the serving figures: TTFT, ITL, end-to-end, goodput.

Definitions follow vLLM's serving benchmark (``vllm.benchmarks.serve``), so
the two can be compared figure for figure:

* **TTFT** - from sending the request to the first streamed chunk with a token;
* **ITL** - the gap between two consecutive streamed chunks of one request
  (every gap of every request is one sample: a stall shows in the tail);
* **end-to-end** - from sending the request to its last token chunk;
* **output throughput** - generated tokens of all completed requests over the
  run's duration (from the run's start, time 0, to the last token);
* **goodput** - completed requests per second that met the SLO.

The SLO is on TTFT and on the *longest* gap of a request: the claim under test
is about stalls (a decode step held back by someone else's prefill), and a
mean per-token time would average a stall away.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from kvmux.bench.serve.workload import RequestKind

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it; times in seconds since the run started."""

    kind: RequestKind
    sent_s: float
    chunk_times_s: tuple[float, ...]
    """When each streamed chunk carrying output arrived."""
    output_tokens: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times_s)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.chunk_times_s[-1] - self.sent_s

    @property
    def itls_s(self) -> list[float]:
        return inter_token_latencies(self.chunk_times_s)


def inter_token_latencies(times_s: Sequence[float]) -> list[float]:
    """Gaps between consecutive token timestamps (none for fewer than two)."""
    if any(later < earlier for earlier, later in itertools.pairwise(times_s)):
        raise ValueError("token timestamps must not go backwards")
    return [later - earlier for earlier, later in itertools.pairwise(times_s)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linearly interpolated (numpy's and vLLM's default)."""
    if not values:
        raise ValueError("no values to take a percentile of")
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


class Slo(BaseModel):
    """A request is *good* when its TTFT and every one of its token gaps are within bounds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float = Field(2000.0, gt=0, description="longest acceptable time to first token")
    itl_ms: float = Field(
        150.0, gt=0, description="longest acceptable gap between two tokens of a request"
    )

    def met_by(self, timing: RequestTiming) -> bool:
        if not timing.ok:
            return False
        gaps = timing.itls_s
        worst_gap = max(gaps) if gaps else 0.0
        return timing.ttft_s * 1e3 <= self.ttft_ms and worst_gap * 1e3 <= self.itl_ms


class LatencyStats(BaseModel):
    """p50/p90/p99 and mean of one latency, in milliseconds."""

    model_config = ConfigDict(frozen=True)

    samples: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencyStats | None:
        if not seconds:
            return None
        p50, p90, p99 = (percentile(seconds, q) * 1e3 for q in PERCENTILES)
        mean = float(np.mean(np.asarray(seconds, dtype=np.float64))) * 1e3
        return cls(samples=len(seconds), mean_ms=mean, p50_ms=p50, p90_ms=p90, p99_ms=p99)


class RunMetrics(BaseModel):
    """The figures of one topology at one offered rate."""

    model_config = ConfigDict(frozen=True)

    topology: str
    rate: float
    """Offered load, requests/s."""
    requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_throughput: float
    """Generated tokens/s."""
    request_throughput: float
    goodput: float
    """Requests/s that met the SLO."""
    slo: Slo
    ttft: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    itl_long_output: LatencyStats | None = None
    """ITL of the long-output requests alone: the decodes a prefill can stall."""
    errors: list[str] = Field(default_factory=list)
    """The first few distinct errors, to say why requests failed."""
    itls_ms: list[float] = Field(default_factory=list, repr=False)
    """Every gap, for the CDF plot."""
    load_average: float | None = None
    """The machine's 1-minute load average as the run ended. The benchmark's own
    processes count (two servers of an API and an engine process each, the client):
    2 or more under load on their own; well above that, others shared the cores."""
    client_cores: float | None = None
    """CPU time the load generator's process used over the run's wall time (cores);
    it is not pinned, so this much was taken from the servers' cores."""
    proxy_cores: float | None = None
    """The same for the proxy's process."""


def summarize(topology: str, rate: float, timings: Sequence[RequestTiming], slo: Slo) -> RunMetrics:
    """The figures of one run from its requests' timings."""
    done = [t for t in timings if t.ok]
    duration = max((t.chunk_times_s[-1] for t in done), default=0.0)
    tokens = sum(t.output_tokens for t in done)
    itls = [gap for t in done for gap in t.itls_s]
    long_output = [gap for t in done if t.kind == "long-output" for gap in t.itls_s]
    good = sum(1 for t in done if slo.met_by(t))
    errors = sorted({t.error for t in timings if t.error})[:5]
    per_s = 1.0 / duration if duration > 0 else 0.0
    return RunMetrics(
        topology=topology,
        rate=rate,
        requests=len(timings),
        completed=len(done),
        failed=len(timings) - len(done),
        duration_s=duration,
        output_tokens=tokens,
        output_throughput=tokens * per_s,
        request_throughput=len(done) * per_s,
        goodput=good * per_s,
        slo=slo,
        ttft=LatencyStats.of([t.ttft_s for t in done]),
        itl=LatencyStats.of(itls),
        e2e=LatencyStats.of([t.e2e_s for t in done]),
        itl_long_output=LatencyStats.of(long_output),
        errors=errors,
        itls_ms=[round(gap * 1e3, 3) for gap in itls],
    )
