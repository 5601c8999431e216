"""kvmux's stats as vLLM connector stats, and on vLLM's ``/metrics``.

Each worker reports, per step, what changed since its last report
(``worker_report``): its counters as deltas, flat, and, whenever anything
changed, all its levels (``kvmux.stats.LEVELS``) under ``levels_by_worker``
keyed by the worker's rank. vLLM merges reports with ``aggregate``, across
the workers of a step and across the steps of a logging interval alike, so
the merge has to be right for both: counters add up; a level keeps each
worker's latest value (a later report replaces an earlier one of the same
worker, other workers' are kept). ``reduce`` (the log line) and
``KvmuxPromMetrics`` (Prometheus) then read an engine's level as the **sum
over its workers**: every worker has a backend of its own (a tensor-parallel
rank holds its share of the heads), so the engine holds what its workers
hold together, as it moves what they move together. Several engines (data
parallel) are kept apart by vLLM's ``engine`` label; sum them in PromQL.
Everything is plain numbers and dicts, so it serialises between vLLM's
processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmux.stats import is_level

LEVELS_KEY = "levels_by_worker"
"""Where a report carries levels: ``{worker rank: {stat: value}}``."""

Levels = dict[str, dict[str, float]]


@dataclass
class KvmuxStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvmuxStats:
        for name, value in other.data.items():
            if name == LEVELS_KEY:
                self.data[LEVELS_KEY] = merge_levels(self.data.get(LEVELS_KEY, {}), value)
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def is_empty(self) -> bool:
        return not self.data.get(LEVELS_KEY) and not any(self.counters().values())

    def counters(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k != LEVELS_KEY}

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(sorted(self.counters().items()))
        for op in ("load", "save"):
            seconds = self.data.get(f"{op}_seconds", 0.0)
            if seconds > 0:
                out[f"{op}_GBps"] = round(self.data.get(f"{op}_bytes", 0) / seconds / 1e9, 3)
        out.update(sorted(summed(self.data.get(LEVELS_KEY, {})).items()))
        return out


def worker_report(now: dict[str, float], before: dict[str, float], worker: str) -> dict[str, Any]:
    """What one worker sends for a step: ``{}`` when nothing changed since ``before``
    (stats are snapshots of the backend's cumulative counters and present levels)."""
    counters = {
        k: v - before.get(k, 0) for k, v in now.items() if not is_level(k) and v != before.get(k, 0)
    }
    levels = {k: v for k, v in now.items() if is_level(k)}
    if not counters and all(before.get(k) == v for k, v in levels.items()):
        return {}
    return {**counters, LEVELS_KEY: {worker: levels}} if levels else counters


def worker_rank() -> str:
    """This worker's rank, which names its levels (``"0"`` when torch.distributed is not
    set up: a single worker)."""
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "0"


def merge_levels(earlier: Levels, later: Levels) -> Levels:
    """Each worker's latest levels (new dicts: reports may be shared between loggers)."""
    merged = {worker: dict(levels) for worker, levels in earlier.items()}
    for worker, levels in later.items():
        merged[worker] = {**merged.get(worker, {}), **levels}
    return merged


def summed(by_worker: Levels) -> dict[str, float]:
    """An engine's levels: each stat summed over its workers (see the module docstring)."""
    out: dict[str, float] = {}
    for levels in by_worker.values():
        for name, value in levels.items():
            out[name] = out.get(name, 0) + value
    return out


class KvmuxPromMetrics(KVConnectorPromMetrics):
    """kvmux's stats on vLLM's ``/metrics``: counters as ``vllm:kvmux_stat_total{stat=...}``,
    levels as the gauge ``vllm:kvmux_level{stat=...}``.

    One labelled metric of each kind rather than one metric per name: a
    ``multi`` composition reports per-child names (``child.1.fallbacks``)
    that are only known at run time. A gauge is set to the sum over the
    engine's workers of each one's latest level (kept here: a report carries
    only the workers whose stats changed).
    """

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counter = self._counter_cls(
            name="vllm:kvmux_stat_total",
            documentation="kvmux connector counters (bytes, blocks, seconds, per-child events)",
            labelnames=[*labelnames, "stat"],
        )
        self._gauge = self._gauge_cls(
            name="vllm:kvmux_level",
            documentation="kvmux connector levels (blocks stored, capacity, open connections), "
            "summed over the engine's workers",
            labelnames=[*labelnames, "stat"],
            multiprocess_mode="mostrecent",
        )
        self._levels: dict[int, Levels] = {}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if name != LEVELS_KEY and isinstance(value, int | float) and value > 0:
                self._counter.labels(*labels, name).inc(value)
        reported = transfer_stats_data.get(LEVELS_KEY)
        if reported:
            levels = self._levels[engine_idx] = merge_levels(
                self._levels.get(engine_idx, {}), reported
            )
            for name, value in summed(levels).items():
                self._gauge.labels(*labels, name).set(value)
