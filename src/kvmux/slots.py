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

Batches are thousands of keys and every batch passes through here under the
owner's lock, so the batch methods (``lookup``, ``find_many``, ``keep_many``,
``allocate_many``, ``unpin``) do no Python work per key: ``map`` over the
C-level ``dict`` methods, ``itertools`` to filter, numpy for pin counts.
The one-key methods stay for callers that handle one key at a time.

The LRU order is a plain ``dict``'s insertion order, not an ``OrderedDict``:
a key is made most recently used by popping and inserting it again. A full
pool evicts a batch's worth of keys and inserts as many on every save: 4096
new keys (looked up, as many evicted, inserted) took ~1.35 ms with the
``OrderedDict``, which keeps a linked list beside its table, and ~0.9 ms with
a ``dict``; a lookup that touches 4096 keys costs both about the same.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from itertools import compress, groupby, islice, repeat, tee
from operator import and_, ge, itemgetter, not_

import numpy as np
import numpy.typing as npt

from kvmux.addressing import SMALL_BATCH
from kvmux.keys import BlockKey

SlotArray = npt.NDArray[np.int64]
"""Slots of a batch, one per key, -1 where the key is not stored."""
DigestRuns = Iterable[tuple[str, list[bytes]]]
"""Runs of (namespace, digests) of a request: ``_KeysRequest.digest_runs``."""
UNSTORED = tuple.__new__(BlockKey, (b"", ""))
"""The key ``stored_keys`` gives (with the digest index) for a digest no slot
holds: its empty digest is one no real key has (``BlockKey`` refuses it), so
every lookup misses it."""


def _drain(it: Iterator[object]) -> None:
    """Run an iterator of side effects (a ``map`` of a C method) at C speed."""
    deque(it, maxlen=0)


def _touch(where: dict[BlockKey, int], keys: Iterable[BlockKey]) -> None:
    """Make the stored ``keys`` the most recently used of ``where``, in order: each is
    popped and inserted again, the pairs made as ``update`` takes them (so a key
    listed twice moves twice, as it would one at a time)."""
    keys, again = tee(keys)
    where.update(zip(keys, map(where.pop, again), strict=True))


def _leading(flags: Iterable[bool], n: int) -> int:
    """How many of the ``n`` leading ``flags`` are true (stops at the first false)."""
    return next(compress(itertools.count(), map(not_, flags)), n)


def _add_counts(counts: npt.NDArray[np.int32], idx: SlotArray, delta: int) -> None:
    """``counts[idx] += delta``, a slot listed twice counting twice. ``np.add.at``
    costs ~70 ns an element; a ``bincount`` over the whole pool is cheaper unless
    ``idx`` is far shorter than the pool; a few slots cost less than either's set-up."""
    if len(idx) < SMALL_BATCH:  # a one-block lease: element by element is cheapest
        for slot in idx.tolist():
            counts[slot] += delta
    elif len(idx) * 16 < len(counts):
        np.add.at(counts, idx, delta)
    else:
        counts += (np.bincount(idx, minlength=len(counts)) * delta).astype(counts.dtype)


class SlotPool:
    """Key -> slot index with LRU order over a fixed number of slots.

    Not thread-safe: its owner holds a lock around each batch.
    """

    def __init__(self, slots: int, *, by_digest: bool = False) -> None:
        self.slots = slots
        self._where: dict[BlockKey, int] = {}
        """Key -> slot, least recently used first (see the module's docstring)."""
        self._by_digest: dict[str, dict[bytes, BlockKey]] | None = {} if by_digest else None
        """The keys of ``_where`` by namespace and digest, if kept (see ``stored_keys``):
        a pool that serves peers' requests keeps it; keeping it costs a save of
        4096 keys ~0.5 ms."""
        self._free: list[int] = []  # released slots
        self._unused = 0  # slots >= this were never handed out: O(1) set-up at any size
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._where

    def get(self, key: BlockKey) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._where.pop(key, None)
        if slot is not None:
            self._where[key] = slot
        return slot

    def lookup(self, keys: Sequence[BlockKey]) -> SlotArray:
        """Every key's slot (-1: absent), marking the present ones most recently
        used in ``keys`` order, as ``get`` of each key in turn would.

        One pass pops each key and inserts it again at the end, at C speed; ``tee``
        keeps the popped slots for the answer. The pairs are made as ``update``
        takes them, so a key listed twice is found both times. An absent key is
        inserted as -1 on the way, and taken out again after."""
        where = self._where
        popped, found = tee(map(where.pop, keys, repeat(-1)))
        where.update(zip(keys, popped, strict=True))
        slots = np.fromiter(found, np.int64, len(keys))
        if slots.size and slots.min() < 0:
            missing = compress(keys, (slots < 0).tolist())
            _drain(map(where.pop, missing, repeat(None)))  # None: a key listed twice
        return slots

    def new_slots(self, keys: Sequence[BlockKey]) -> SlotArray:
        """``lookup`` for a save, whose keys are mostly new: one ``get`` per key, and
        only the present ones are touched."""
        where = self._where
        slots = np.fromiter(map(where.get, keys, repeat(-1)), np.int64, len(keys))
        if slots.size and slots.max() >= 0:
            _touch(where, compress(keys, map(ge, slots.tolist(), repeat(0))))
        return slots

    def stored_keys(self, runs: DigestRuns) -> list[BlockKey]:
        """The stored key of each digest of ``runs``, in order, ``UNSTORED`` where
        none is. A producer looks a request up by these: building a key per
        digest would give the garbage collector thousands of tuples a request.
        Without the index, the keys are built, stored or not (lookups miss the
        ones that are not)."""
        found: list[BlockKey] = []
        for ns, digests in runs:
            if self._by_digest is None:
                found.extend(BlockKey.unchecked_batch(digests, ns))
                continue
            index = self._by_digest.get(ns)
            if index is None:
                found.extend(repeat(UNSTORED, len(digests)))
            else:
                found.extend(map(index.get, digests, repeat(UNSTORED)))
        return found

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark the stored ``keys`` most recently used, in ``keys`` order."""
        _touch(self._where, compress(keys, self.stored(keys)))

    def stored(self, keys: Iterable[BlockKey]) -> Iterator[bool]:
        """Whether each key is stored, lazily (does not touch the LRU order)."""
        return map(self._where.__contains__, keys)

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        """A slot for a new ``key``, evicting the least recently used block not in
        ``protected`` if none is free; None if every slot is protected."""
        placed = self.allocate_many([key], protected)
        return placed[0] if placed else None  # the caller adds it to protected

    def allocate_many(self, keys: Sequence[BlockKey], protected: set[int]) -> list[int]:
        """Slots for the leading new ``keys`` (absent, distinct), as many as fit:
        free slots first, then never-used ones, then the least recently used
        blocks not in ``protected``. Fewer slots than keys means every other
        slot is protected.

        The same slots and victims as one ``allocate`` per key with each slot
        handed out added to ``protected``: victims are all chosen before any new
        key goes in, so a call never evicts its own keys. ``protected`` is left
        as it was (adding thousands of slots would cost more than the rest)."""
        want = len(keys)
        take = min(want, len(self._free))
        slots = self._free[len(self._free) - take :][::-1]  # pop() order
        del self._free[len(self._free) - take :]
        fresh = min(want - len(slots), self.slots - self._unused)
        slots.extend(range(self._unused, self._unused + fresh))
        self._unused += fresh
        if len(slots) < want:
            victims = self._victims(want - len(slots), protected)
            slots.extend(map(self._where.pop, victims))
            self._unindex(victims)
            self.evictions += len(victims)
        placed = keys[: len(slots)]  # the leading keys that fit
        self._where.update(zip(placed, slots, strict=True))
        self._index(placed)
        return slots

    def _victims(self, n: int, protected: set[int]) -> list[BlockKey]:
        """Up to ``n`` least recently used keys whose slots are not ``protected``.
        Scans from the old end only as far as needed, without Python code per entry."""
        if not protected:
            return list(islice(self._where, n))
        free = map(not_, map(protected.__contains__, self._where.values()))
        return list(islice(compress(self._where, free), n))

    def remove(self, key: BlockKey) -> None:
        """Forget ``key`` (if stored) and free its slot."""
        if key in self._where:
            self.remove_many([key])

    def remove_many(self, keys: Sequence[BlockKey]) -> None:
        """``remove`` of stored, distinct ``keys``, without Python code per key."""
        slots = list(map(self._where.pop, keys))
        self._unindex(keys)
        self._free.extend(slots)

    def _index(self, keys: Sequence[BlockKey]) -> None:
        if self._by_digest is None:
            return
        for ns, run in groupby(keys, key=itemgetter(1)):  # one run a batch, in practice
            same = list(run)
            digests = map(itemgetter(0), same)
            self._by_digest.setdefault(ns, {}).update(zip(digests, same, strict=True))

    def _unindex(self, keys: Iterable[BlockKey]) -> None:
        if self._by_digest is None:
            return
        for ns, run in groupby(keys, key=itemgetter(1)):
            index = self._by_digest[ns]
            _drain(map(index.pop, map(itemgetter(0), run)))
            if not index:
                del self._by_digest[ns]


class PinnedSlots:
    """LRU slots (a :class:`SlotPool`) plus pins and leases.

    Pins are a count per slot in a numpy array, so pinning and unpinning a
    lease of thousands of slots is a few array operations.

    Not thread-safe: its owner holds a lock around each batch.
    """

    def __init__(self, slots: int, *, by_digest: bool = False) -> None:
        self._lru = SlotPool(slots, by_digest=by_digest)
        self._pins = np.zeros(slots, dtype=np.int32)  # calloc: O(1) until touched
        self._pin_total = 0  # sum of _pins: lets the never-pinned case skip the array
        self._released: dict[int, BlockKey] = {}
        self._released_keys: set[BlockKey] = set()
        self._leases: dict[int, tuple[SlotArray, float]] = {}
        self._lease_ids = itertools.count(1)

    @property
    def slots(self) -> int:
        return self._lru.slots

    @property
    def evictions(self) -> int:
        return self._lru.evictions

    @property
    def pinned(self) -> int:
        """How many slots hold at least one pin."""
        return int(np.count_nonzero(self._pins)) if self._pin_total else 0

    def __len__(self) -> int:
        return len(self._lru) - len(self._released)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru and key not in self._released_keys

    def stored_keys(self, runs: DigestRuns) -> list[BlockKey]:
        """See :meth:`SlotPool.stored_keys`. A key released while pinned is among
        them; every lookup below answers it as absent."""
        return self._lru.stored_keys(runs)

    def find(self, key: BlockKey) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._lru.get(key)
        return None if slot is None or slot in self._released else slot

    def find_many(self, keys: Sequence[BlockKey]) -> SlotArray:
        """``find`` of every key, in order: slots, -1 where absent."""
        slots = self._lru.lookup(keys)
        if self._released:
            slots[np.isin(slots, list(self._released))] = -1
        return slots

    def prefix(self, keys: Iterable[BlockKey]) -> int:
        """How many leading ``keys`` are stored (does not touch the LRU order)."""
        keys = list(keys)
        stored = self._lru.stored(keys)
        if self._released_keys:
            live = map(not_, map(self._released_keys.__contains__, keys))
            stored = map(and_, stored, live)
        return _leading(stored, len(keys))

    def keep(self, key: BlockKey) -> bool:
        """True if ``key`` is stored already (a save of it then has nothing to do);
        a key released while pinned is taken back."""
        return bool(self.keep_many([key])[0] >= 0)

    def find_few(self, keys: Sequence[BlockKey]) -> list[int]:
        """``find_many`` of a short batch (a one-block load), as a list: a dict call
        per key costs less than numpy's set-up for a few keys."""
        get, released = self._lru.get, self._released
        return [-1 if (slot := get(key)) is None or slot in released else slot for key in keys]

    def new_keys(self, keys: Sequence[BlockKey]) -> list[int]:
        """``keep_many``, answered as the positions of the keys not stored yet (the ones
        a save must place); a short batch walked in Python."""
        if len(keys) >= SMALL_BATCH:
            new: list[int] = np.flatnonzero(self.keep_many(keys) < 0).tolist()
            return new
        get, released = self._lru.get, self._released
        new = []
        for i, key in enumerate(keys):
            slot = get(key)
            if slot is None:
                new.append(i)
            elif released and slot in released:
                self._released_keys.discard(released.pop(slot))
        return new

    def keep_many(self, keys: Sequence[BlockKey]) -> SlotArray:
        """``keep`` of every key: the slots of those stored already (now most
        recently used, and taken back if released while pinned), -1 for new ones."""
        slots = self._lru.new_slots(keys)
        if self._released:
            back = slots[np.isin(slots, list(self._released))].tolist()
            self._released_keys.difference_update(map(self._released.pop, back))
        return slots

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark the stored ``keys`` most recently used, in ``keys`` order: after a
        save that kept some keys and placed others, the batch's LRU order is its
        own order again, as if each key had been saved in turn."""
        self._lru.touch(keys)

    def protected(self) -> set[int]:
        """A fresh set of the pinned slots, for a batch to pass to every
        ``allocate`` of that batch (adding each slot it writes to) or to one
        ``allocate_many``."""
        if not self._pin_total:
            return set()
        return set(np.flatnonzero(self._pins).tolist())

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        """A slot for a new ``key``; evicts the least recently used slot not in
        ``protected`` (which must include the pinned ones: see ``protected()``)
        if none is free; None if every slot is protected."""
        return self._lru.allocate(key, protected)

    def allocate_many(self, keys: Sequence[BlockKey], protected: set[int]) -> list[int]:
        """Slots for as many leading new ``keys`` as fit (see
        :meth:`SlotPool.allocate_many`); ``protected`` as for ``allocate``."""
        return self._lru.allocate_many(keys, protected)

    def release(self, key: BlockKey) -> None:
        self.release_many([key])

    def release_many(self, keys: Iterable[BlockKey]) -> None:
        """Drop ``keys`` (the stored ones; a key listed twice counts once): a key whose
        slot is pinned disappears for lookups at once and keeps its slot until the
        last pin goes, the others free their slots now. A release of thousands of
        keys (a finished request's blocks) does no Python work per key."""
        where = self._lru._where
        unique = list(dict.fromkeys(keys))
        stored = list(compress(unique, map(where.__contains__, unique)))
        if not stored:
            return
        if not self._pin_total:
            self._lru.remove_many(stored)
            return
        slots = np.fromiter(map(where.__getitem__, stored), np.int64, len(stored))
        pinned = (self._pins[slots] > 0).tolist()
        if any(pinned):
            held = list(compress(stored, pinned))
            self._released.update(zip(slots[np.flatnonzero(pinned)].tolist(), held, strict=True))
            self._released_keys.update(held)
        self._lru.remove_many(list(compress(stored, map(not_, pinned))))

    def pin(self, slots: Sequence[int] | SlotArray) -> None:
        idx = np.asarray(slots, dtype=np.int64)
        _add_counts(self._pins, idx, 1)
        self._pin_total += len(idx)

    def unpin(self, slots: Sequence[int] | SlotArray) -> None:
        """Drop one pin per listed slot; a slot left unpinned that holds a released
        key frees it now."""
        idx = np.asarray(slots, dtype=np.int64)
        if not idx.size:
            return
        _add_counts(self._pins, idx, -1)
        counts = self._pins[idx]
        if (counts < 0).any():  # more unpins than pins (a caller's bug): floor at zero
            self._pins[idx] = np.maximum(counts, 0)
            self._pin_total = int(self._pins.sum())
        else:
            self._pin_total -= len(idx)
        if self._released:
            self._free_released(idx[counts <= 0])

    def _free_released(self, unpinned: SlotArray) -> None:
        """Remove the keys released while pinned whose slots are now unpinned."""
        released = self._released
        slots = filter(released.__contains__, dict.fromkeys(unpinned.tolist()))
        keys = list(map(released.pop, list(slots)))
        self._released_keys.difference_update(keys)
        self._lru.remove_many(keys)

    def lease(self, slots: Sequence[int] | SlotArray, expires: float) -> int:
        """Pin ``slots`` until ``end_lease`` or the monotonic time ``expires``."""
        lease = next(self._lease_ids)
        held = np.array(slots, dtype=np.int64)  # a copy: the caller may reuse its list
        self.pin(held)
        self._leases[lease] = (held, expires)
        return lease

    def hold(self, slots: Sequence[int] | SlotArray) -> int:
        """Pin ``slots`` for a publication, until ``end_lease`` (it never expires by
        itself: :mod:`kvmux.publications` ends it)."""
        return self.lease(slots, math.inf)

    def end_lease(self, lease: int) -> None:
        entry = self._leases.pop(lease, None)
        if entry is not None:
            self.unpin(entry[0])

    def reap(self, now: float) -> None:
        """End every lease that expired by ``now``."""
        for lease in [i for i, (_, expires) in self._leases.items() if expires <= now]:
            self.end_lease(lease)


class _LentPool(SlotPool):
    """A :class:`SlotPool` whose slots are the engine's own blocks: a key is placed at
    the block it was saved from, never allocated, and every slot a removal empties
    is noted in ``freed`` (the block goes back to the engine)."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots, by_digest=True)
        self.key_at: dict[int, BlockKey] = {}
        self.freed: list[int] = []

    def place(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> None:
        self._where.update(zip(keys, slots, strict=True))
        self.key_at.update(zip(slots, keys, strict=True))
        self._index(keys)

    def remove_many(self, keys: Sequence[BlockKey]) -> None:
        """``remove`` of stored, distinct ``keys``, without Python code per key: their
        blocks go to ``freed``, not to the free list (they are the engine's)."""
        slots = list(map(self._where.pop, keys))
        self._unindex(keys)
        _drain(map(self.key_at.pop, slots))
        self.freed.extend(slots)

    def allocate_many(self, keys: Sequence[BlockKey], protected: set[int]) -> list[int]:
        raise TypeError("lent slots are the engine's blocks: keys are placed, not allocated")


class LentSlots(PinnedSlots):
    """:class:`PinnedSlots` over an engine's KV blocks themselves (slot ``i`` is block
    ``i``): what a producer that borrows the engine's blocks serves from.

    A block holds at most one key. Pins and the release of a pinned key work as
    for a pool; a block is *returned* once it holds no key and no pin, and every
    such block is listed in :attr:`freed` until its owner takes them
    (:meth:`take_freed`). Not thread-safe, as its base."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(0)
        self._lru = self._lent = _LentPool(num_blocks)
        self._pins = np.zeros(num_blocks, dtype=np.int32)
        self._published = np.zeros(num_blocks, dtype=np.int32)
        """Publications holding each block (of its pins, those that are holds)."""
        self._holds: set[int] = set()

    def held(self, blocks: Sequence[int]) -> list[int]:
        """Those of ``blocks`` still lent, in order: ``holds`` of a batch."""
        named = self._lent.key_at.__contains__
        if not self._pin_total:
            return list(filter(named, blocks))
        pinned = (self._pins[np.asarray(blocks, dtype=np.int64)] > 0).tolist()
        return [b for b, p in zip(blocks, pinned, strict=True) if p or named(b)]

    def lent(self) -> int:
        """How many blocks are lent now (named by a key, or pinned)."""
        lent = self._pins > 0
        lent[list(self._lent.key_at)] = True
        return int(np.count_nonzero(lent))

    def place(self, keys: Sequence[BlockKey], blocks: Sequence[int]) -> list[int]:
        """Lend ``blocks`` under the new ``keys`` (absent, distinct, as ``new_keys``
        gives them); the positions that could not be placed. A block already lent
        under another key has been overwritten by its engine: that key goes (at
        once for lookups), and the new one takes the block unless a peer is still
        reading it."""
        key_at = self._lent.key_at
        olds = list(map(key_at.get, blocks))
        if not any(olds):  # fresh blocks: the common case
            self._lent.place(keys, blocks)
            return []
        named = [(block, old) for block, old in zip(blocks, olds, strict=True) if old is not None]
        if not (self._pin_total and self._pins[[block for block, _ in named]].any()):
            self._lent.remove_many([old for _, old in named])  # none read: drop them at once
            self._lent.place(keys, blocks)
            return []
        placed: list[int] = []
        refused: list[int] = []
        for i, block in enumerate(blocks):
            old = olds[i]
            if old is not None:
                self.release(old)
                if block in key_at:  # pinned: the old key stays until the read ends
                    refused.append(i)
                    continue
            placed.append(i)
        self._lent.place([keys[i] for i in placed], [blocks[i] for i in placed])
        return refused

    def hold(self, slots: Sequence[int] | SlotArray) -> int:
        """As a pool's, and the blocks are the publication's: once no publication
        holds a block any more its key is released, so the block goes back to the
        engine when no peer reads it."""
        lease = super().hold(slots)
        self._holds.add(lease)
        _add_counts(self._published, self._leases[lease][0], 1)
        return lease

    def end_lease(self, lease: int) -> None:
        entry = self._leases.get(lease)
        if entry is None or lease not in self._holds:
            super().end_lease(lease)
            return
        self._holds.discard(lease)
        rows = entry[0]
        _add_counts(self._published, rows, -1)
        super().end_lease(lease)
        key_at = self._lent.key_at
        unheld = rows[self._published[rows] <= 0].tolist()
        self.release_many(filter(None, map(key_at.get, unheld)))

    def take_freed(self) -> list[int]:
        """The blocks returned since the last call."""
        freed, self._lent.freed = self._lent.freed, []
        return freed
