"""kvmux's counters as vLLM connector stats.

Workers send a ``KvmuxStats`` per step (the backend's counters since the last
report, plus the adapter's own); vLLM sums them across workers and steps and
its logger calls ``reduce`` once per interval. Everything is a plain number,
so it serialises between vLLM's processes and exports to Prometheus as is
(``KvmuxPromMetrics``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class KvmuxStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvmuxStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(sorted(self.data.items()))
        for op in ("load", "save"):
            seconds = self.data.get(f"{op}_seconds", 0.0)
            if seconds > 0:
                out[f"{op}_GBps"] = round(self.data.get(f"{op}_bytes", 0) / seconds / 1e9, 3)
        return out


def delta(now: dict[str, float], before: dict[str, float]) -> dict[str, Any]:
    """Counters that moved since ``before`` (connector stats are cumulative)."""
    return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}


class KvmuxPromMetrics(KVConnectorPromMetrics):
    """Every kvmux counter on vLLM's ``/metrics`` as ``vllm:kvmux_stat_total{stat=...}``.

    One labelled counter rather than one metric per name: a ``multi``
    composition reports per-child names (``child.1.fallbacks``) that are only
    known at run time.
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

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            if isinstance(value, int | float) and value > 0:
                self._counter.labels(*labels, name).inc(value)
