"""A transfer that breaks part-way: the classic "connection reset at block N"."""

from __future__ import annotations

from collections.abc import Collection

from kvmux.connector import Address, Connector
from kvmux.handle import Handle, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.testing.faults.wrapper import ConnectorWrapper


class FailMidBatch(ConnectorWrapper):
    """In each save or load (as chosen by ``ops``), the first ``after`` keys go to the
    backend and the rest fail without reaching it.

    Lets a caller check that it keeps the blocks that did arrive and redoes only
    the others, rather than treating the whole batch as lost (or as done).
    """

    def __init__(
        self, inner: Connector, after: int, *, ops: Collection[str] = ("save", "load")
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
        self._stats.add("injected_failed", n - cut)
        return [None] * cut + [failed(reason)] * (n - cut)

    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle:
        if "save" not in self.ops:
            return self.inner.save(keys, block_ids)
        return self._split(keys, block_ids, self._injected(len(keys)), self.inner.save)

    def _load(self, keys: list[BlockKey], block_ids: list[int], source: Address | None) -> Handle:
        if "load" not in self.ops:
            return self.inner.load(keys, block_ids, source)
        return self._split(
            keys,
            block_ids,
            self._injected(len(keys)),
            lambda ks, bs: self.inner.load(ks, bs, source),
        )
