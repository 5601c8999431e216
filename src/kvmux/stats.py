"""What ``Connector.stats()`` reports: counters every connector keeps, and levels.

A stat is a *counter* (it only grows: calls, bytes, blocks moved, evictions)
unless its name is declared in :data:`LEVELS`: a *level* is a reading of the
present (blocks held, connections open) that goes down as well as up. The
difference matters to whoever aggregates: counters are summed as deltas,
levels are replaced by their latest value (vLLM's adapter exports them to
Prometheus as gauges). This table is the one place a level is declared; a
backend that reports a new one adds it here.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from kvmux.handle import OK, Status, TransferResult

LEVELS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "blocks_stored": "blocks the backend holds now",
        "bytes_stored": "bytes the backend holds now",
        "capacity_blocks": "most blocks it can hold",
        "pinned_blocks": "blocks pinned for peers to pull (not evictable until released)",
        "server_connections": "peer connections its server has open",
        "nixl_leases": "published batches NIXL peers may still read",
        "mooncake_pinned_slots": "pool slots pinned for Mooncake peers to read",
        "blocks": "blocks a tier of a tiered composition holds (tier.<i>.blocks)",
        "staging_blocks_free": "free blocks of a tiered composition's staging area",
        "breaker_state": "a child's circuit breaker: 0 closed, 1 half-open, 2 open",
        "published_leases": "publications a producer holds for consumers now",
        "lent_blocks": "engine blocks a borrowing producer holds (save_mode=borrow) now",
    }
)
"""Every level stat, by the last dotted part of its name, with what it measures.

Compositions prefix their children's stats (``child.1.backend.blocks_stored``,
``tier.0.capacity_blocks``); the prefix does not change what a stat is."""


def is_level(name: str) -> bool:
    """Whether the stat ``name`` is a level (see :data:`LEVELS`) rather than a counter."""
    return name.rpartition(".")[2] in LEVELS


class Stats:
    """Thread-safe counters; ``snapshot`` is what ``Connector.stats()`` returns."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._seconds: dict[str, float] = {}

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def record(self, op: str, result: TransferResult) -> None:
        """Fold one finished save or load into the counters."""
        outcomes = result.outcomes
        ok = outcomes.count(OK)
        if ok == len(outcomes):  # the usual batch: no per-outcome walk
            missing = failed = 0
        else:
            statuses = Counter(o.status for o in outcomes)
            ok, missing, failed = (
                statuses[Status.OK],
                statuses[Status.MISSING],
                statuses[Status.FAILED],
            )
        names = _NAMES.get(op) or _names(op)
        counts = self._counts
        with self._lock:
            counts[names[0]] += 1
            counts[names[1]] += ok
            counts[names[2]] += missing
            counts[names[3]] += failed
            counts[names[4]] += result.nbytes
            self._seconds[names[5]] = self._seconds.get(names[5], 0.0) + result.seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out.update(self._seconds)
        return out


_NAMES: dict[str, tuple[str, ...]] = {}
"""The counter names of each op, formatted once (``record`` runs per transfer)."""


def _names(op: str) -> tuple[str, ...]:
    names = tuple(
        f"{op}_{what}"
        for what in ("calls", "blocks_ok", "blocks_missing", "blocks_failed", "bytes", "seconds")
    )
    _NAMES[op] = names
    return names
