"""Which pool slot holds which key, and which slots a transfer is still reading.

A pool is a fixed number of slots. :class:`SlotPool` maps keys to slots in
least-recently-used order. :class:`PinnedSlots` adds pins: a peer may read a
slot *after* the lookup that found it (a tcp send streams from the slot, an
shm consumer copies out of it), so a save must never overwrite such a slot
mid-read. A tcp send pins for the length of the send; an shm consumer, which
reads from another process, holds a *lease* that ends at unpin or after
``lease_s``, so a consumer that dies never keeps slots pinned forever. A key
released while pinned disappears at once for lookups but keeps its slot until
the last pin goes. The ``cpu`` pool uses the same table and simply never pins.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable

from kvmux.keys import BlockKey


class SlotPool:
    """Key -> slot index with LRU order over a fixed number of slots.

    Not thread-safe: its owner holds a lock around each batch.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._where: OrderedDict[BlockKey, int] = OrderedDict()
        self._free: list[int] = []  # released slots
        self._unused = 0  # slots >= this were never handed out: O(1) set-up at any size
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._where

    def get(self, key: BlockKey) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._where.get(key)
        if slot is not None:
            self._where.move_to_end(key)
        return slot

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        """A slot for a new ``key``, evicting the least recently used block not in
        ``protected`` if none is free; None if every slot is protected."""
        if self._free:
            slot = self._free.pop()
        elif self._unused < self.slots:
            slot = self._unused
            self._unused += 1
        else:
            victim = next((k for k, s in self._where.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self._where.pop(victim)
            self.evictions += 1
        self._where[key] = slot
        return slot

    def remove(self, key: BlockKey) -> None:
        slot = self._where.pop(key, None)
        if slot is not None:
            self._free.append(slot)


class PinnedSlots:
    """LRU slots (a :class:`SlotPool`) plus pins and leases.

    Not thread-safe: its owner holds a lock around each batch.
    """

    def __init__(self, slots: int) -> None:
        self._lru = SlotPool(slots)
        self._pins: Counter[int] = Counter()
        self._released: dict[int, BlockKey] = {}
        self._released_keys: set[BlockKey] = set()
        self._leases: dict[int, tuple[list[int], float]] = {}
        self._lease_ids = itertools.count(1)

    @property
    def slots(self) -> int:
        return self._lru.slots

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    @property
    def pinned(self) -> int:
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._lru) - len(self._released)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru and key not in self._released_keys

    def find(self, key: BlockKey) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._lru.get(key)
        return None if slot is None or slot in self._released else slot

    def prefix(self, keys: Iterable[BlockKey]) -> int:
        """How many leading ``keys`` are stored (does not touch the LRU order)."""
        found = 0
        for key in keys:
            if key not in self._lru or key in self._released_keys:
                break
            found += 1
        return found

    def keep(self, key: BlockKey) -> bool:
        """True if ``key`` is stored already (a save of it then has nothing to do);
        a key released while pinned is taken back."""
        slot = self._lru.get(key)
        if slot is None:
            return False
        if self._released.pop(slot, None) is not None:
            self._released_keys.discard(key)
        return True

    def protected(self) -> set[int]:
        """A fresh set of the pinned slots, for a batch to add the slots it writes to
        and pass to every ``allocate`` of that batch."""
        return set(self._pins)

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        """A slot for a new ``key``; evicts the least recently used slot not in
        ``protected`` (which must include the pinned ones: see ``protected()``)
        if none is free; None if every slot is protected."""
        return self._lru.allocate(key, protected)

    def release(self, key: BlockKey) -> None:
        if key not in self._lru:
            return
        slot = self._lru.get(key)
        assert slot is not None
        if slot in self._pins:
            self._released[slot] = key
            self._released_keys.add(key)
        else:
            self._lru.remove(key)

    def pin(self, slots: list[int]) -> None:
        self._pins.update(slots)

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            self._pins[slot] -= 1
            if self._pins[slot] <= 0:
                del self._pins[slot]
                key = self._released.pop(slot, None)
                if key is not None:
                    self._released_keys.discard(key)
                    self._lru.remove(key)

    def lease(self, slots: list[int], expires: float) -> int:
        """Pin ``slots`` until ``end_lease`` or the monotonic time ``expires``."""
        lease = next(self._lease_ids)
        self.pin(slots)
        self._leases[lease] = (slots, expires)
        return lease

    def end_lease(self, lease: int) -> None:
        entry = self._leases.pop(lease, None)
        if entry is not None:
            self.unpin(entry[0])

    def reap(self, now: float) -> None:
        """End every lease that expired by ``now``."""
        for lease in [i for i, (_, expires) in self._leases.items() if expires <= now]:
            self.end_lease(lease)
