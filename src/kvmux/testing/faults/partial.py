"""A transfer that breaks part-way: the classic "connection reset at block N"."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence

from kvmux.backend import Address, Backend
from kvmux.handle import Outcome, failed
from kvmux.keys import BlockKey
from kvmux.testing.faults.wrapper import FaultWrapper


class FailMidBatch(FaultWrapper):
    """In each save or load (as chosen by ``ops``), the first ``after`` keys go to the
    backend and the rest fail without reaching it.

    Lets a caller check that it keeps the blocks that did arrive and redoes only
    the others, rather than treating the whole batch as lost (or as done).
    """

    def __init__(
        self, inner: Backend, after: int, *, ops: Collection[str] = ("save", "load")
    ) -> None:
        super().__init__(inner)
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        unknown = set(ops) - {"save", "load"}
        if unknown:
            raise ValueError(f"ops must be 'save' and/or 'load', got {sorted(unknown)}")
        self.after = after
        self.ops = frozenset(ops)

    def _injected(self, n: int) -> list[Outcome | None]:
        reason = f"injected fault: transfer broke after {self.after} of {n} blocks"
        cut = min(self.after, n)
        self.counters.add("injected_failed", n - cut)
        return [None] * cut + [failed(reason)] * (n - cut)

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        if "save" not in self.ops:
            return super().save(keys, block_ids)
        deadline = time.monotonic() + self.config.timeout_s
        return self.split(
            keys,
            block_ids,
            self._injected(len(keys)),
            lambda ks, bs: self.inner_runner.save(ks, bs, deadline),
            deadline,
        )

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> Sequence[Outcome]:
        if "load" not in self.ops:
            return super().load(keys, block_ids, source, deadline)
        return self.split(
            keys,
            block_ids,
            self._injected(len(keys)),
            lambda ks, bs: self.inner_runner.load(ks, bs, source, deadline),
            deadline,
        )
