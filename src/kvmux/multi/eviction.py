"""Eviction policies for the tiers of a ``tiered`` MultiBackend.

A tier's capacity is enforced by the multi itself, whatever bound its
backend keeps (or lacks), so the multi must decide *which* block leaves a
full tier, and demote it to the next one. Each policy here is a small
bookkeeping class over keys only: it never touches data, it answers "after
storing this key, which keys no longer fit?". New policies join the table
at the bottom of the module.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import ClassVar

from kvmux.keys import BlockKey


class EvictionPolicy(ABC):
    """Which keys a tier of ``capacity`` blocks holds (None: unbounded). Not thread-safe:
    the tiered policy holds its lock around every call."""

    name: ClassVar[str]

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least one block, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, key: BlockKey) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """Record a hit on ``key`` (a load served from this tier); unknown keys are ignored."""

    @abstractmethod
    def insert(self, key: BlockKey) -> list[BlockKey]:
        """Hold ``key`` from now on (a stored key counts as a hit); returns the keys that
        no longer fit, oldest decision first. ``key`` itself never is one of them."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` (released, or lost by the backend); unknown keys are ignored."""


class LruPolicy(EvictionPolicy):
    """Least recently used: one recency list, the coldest key leaves first."""

    name = "lru"

    def __init__(self, capacity: int | None) -> None:
        super().__init__(capacity)
        self._keys: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def touch(self, key: BlockKey) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def insert(self, key: BlockKey) -> list[BlockKey]:
        self._keys[key] = None
        self._keys.move_to_end(key)
        victims: list[BlockKey] = []
        while self.capacity is not None and len(self._keys) > self.capacity:
            victims.append(self._keys.popitem(last=False)[0])
        return victims

    def remove(self, key: BlockKey) -> None:
        self._keys.pop(key, None)


class ArcPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    Two resident lists, ``t1`` (seen once recently) and ``t2`` (seen at
    least twice), and two ghost lists of keys recently evicted from each.
    A hit on a ghost shifts the target size ``p`` of ``t1`` towards the list
    that would have kept it. The upshot for KV caches: a long scan of
    one-off prefixes (a batch of unrelated prompts) churns ``t1`` and leaves
    the frequently reused prefixes in ``t2`` alone, where LRU would flush them.
    """

    name = "arc"

    def __init__(self, capacity: int | None) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._p = 0.0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def insert(self, key: BlockKey) -> list[BlockKey]:
        if key in self:
            self.touch(key)
            return []
        c = self.capacity
        if c is None:
            self._t1[key] = None
            return []
        victims: list[BlockKey] = []
        if key in self._b1:
            self._p = min(c, self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            victims += self._replace(in_b2=False)
            self._t2[key] = None
            return victims
        if key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            victims += self._replace(in_b2=True)
            self._t2[key] = None
            return victims
        if len(self._t1) + len(self._b1) >= c:
            if len(self._t1) < c:
                self._b1.popitem(last=False)
                victims += self._replace(in_b2=False)
            else:
                victims.append(self._t1.popitem(last=False)[0])
        else:
            tracked = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
            if tracked >= 2 * c and self._b2:
                self._b2.popitem(last=False)
            victims += self._replace(in_b2=False)
        self._t1[key] = None
        return victims

    def _replace(self, in_b2: bool) -> list[BlockKey]:
        """Make room for one key if the tier is full: demote ``t1``'s or ``t2``'s
        coldest key to its ghost list, as ``p`` says."""
        if self.capacity is None or len(self) < self.capacity:
            return []
        t1 = len(self._t1)
        if t1 and (t1 > self._p or (in_b2 and t1 == self._p)):
            victim = self._t1.popitem(last=False)[0]
            self._b1[victim] = None
        else:
            victim = self._t2.popitem(last=False)[0]
            self._b2[victim] = None
        return [victim]

    def remove(self, key: BlockKey) -> None:
        for part in (self._t1, self._t2, self._b1, self._b2):
            part.pop(key, None)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LruPolicy, ArcPolicy)
}
"""Eviction policy name (as written in a tier's config) -> class."""
