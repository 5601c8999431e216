"""Counters every connector keeps, so operators see the same numbers for every backend."""

from __future__ import annotations

import threading
from collections import Counter

from kvmux.handle import Status, TransferResult


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
        statuses = Counter(o.status for o in result.outcomes)
        with self._lock:
            self._counts[f"{op}_calls"] += 1
            self._counts[f"{op}_blocks_ok"] += statuses[Status.OK]
            self._counts[f"{op}_blocks_missing"] += statuses[Status.MISSING]
            self._counts[f"{op}_blocks_failed"] += statuses[Status.FAILED]
            self._counts[f"{op}_bytes"] += result.nbytes
            name = f"{op}_seconds"
            self._seconds[name] = self._seconds.get(name, 0.0) + result.seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out.update(self._seconds)
        return out
