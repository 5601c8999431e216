"""The batch paths of the slot table against a one-key-at-a-time model of it.

``kvmux.slots`` handles a batch of thousands of keys without Python code per
key; these tests pin down that it still makes exactly the choices the simple
per-key algorithm makes: which slot each key gets, which blocks are evicted and
in what order, and that a pinned slot is never handed out.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict

import numpy as np
import pytest

from kvmux.keys import BlockKey
from kvmux.slots import UNSTORED, PinnedSlots, SlotPool


def keys(n: int, tag: str = "") -> list[BlockKey]:
    return [BlockKey(f"{tag}{i}".encode(), "t") for i in range(n)]


class Model:
    """The per-key algorithm: an LRU dict, a free list, pin counts."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.where: OrderedDict[BlockKey, int] = OrderedDict()
        self.free: list[int] = []
        self.unused = 0
        self.pins: Counter[int] = Counter()
        self.evictions = 0

    def find(self, key: BlockKey) -> int:
        slot = self.where.get(key)
        if slot is None:
            return -1
        self.where.move_to_end(key)
        return slot

    def allocate(self, key: BlockKey, protected: set[int]) -> int | None:
        if self.free:
            slot = self.free.pop()
        elif self.unused < self.slots:
            slot, self.unused = self.unused, self.unused + 1
        else:
            victim = next((k for k, s in self.where.items() if s not in protected), None)
            if victim is None:
                return None
            slot = self.where.pop(victim)
            self.evictions += 1
        self.where[key] = slot
        return slot

    def save(self, batch: list[BlockKey]) -> list[bool]:
        """A save, key by key: keys stored already are touched first (so no new key
        of the batch evicts them); each new key is allocated with the pinned slots
        and the batch's own slots protected, afresh whenever the pool is full of
        them; at the end the batch's keys are most recently used in batch order."""
        ok = []
        protected = {s for s, n in self.pins.items() if n > 0}
        kept = {key for key in batch if self.find(key) >= 0}
        for key in batch:
            if key in kept:
                ok.append(True)
                continue
            slot = self.allocate(key, protected)
            if slot is None:
                protected = {s for s, n in self.pins.items() if n > 0}
                slot = self.allocate(key, protected)
            if slot is not None:
                protected.add(slot)
            ok.append(slot is not None)
        for key in batch:
            if key in self.where:
                self.where.move_to_end(key)
        return ok

    def remove(self, key: BlockKey) -> None:
        self.free.append(self.where.pop(key))


def save(table: PinnedSlots, batch: list[BlockKey]) -> list[bool]:
    """What ``PoolStore.save`` does with the table (without the copy)."""
    new = [k for k, s in zip(batch, table.keep_many(batch).tolist(), strict=True) if s < 0]
    done = 0
    while done < len(new):
        rows = table.allocate_many(new[done:], table.protected())
        if not rows:
            break
        done += len(rows)
    if 0 < len(new) < len(batch):
        table.touch(batch)
    failed = set(new[done:])
    return [k not in failed for k in batch]


def state(table: PinnedSlots) -> list[tuple[BlockKey, int]]:
    return list(table._lru._where.items())


@pytest.mark.parametrize("by_digest", [False, True], ids=["no-digest-index", "digest-index"])
@pytest.mark.parametrize("seed", range(20))
def test_batches_match_the_per_key_algorithm(seed: int, by_digest: bool) -> None:
    rng = random.Random(seed)
    size = rng.randint(1, 12)
    table, model = PinnedSlots(size, by_digest=by_digest), Model(size)
    universe = keys(30, f"s{seed}-")
    leases: list[tuple[int, list[int]]] = []
    for _ in range(60):
        op = rng.random()
        if op < 0.5:
            batch = rng.sample(universe, rng.randint(1, 2 * size))
            assert save(table, batch) == model.save(batch)
        elif op < 0.7:
            batch = rng.sample(universe, rng.randint(1, 10))
            if rng.random() < 0.3:
                batch.insert(rng.randrange(len(batch) + 1), rng.choice(batch))  # found twice
            rows = table.find_many(batch)
            found = rows[rows >= 0].tolist()
            assert rows.tolist() == [model.find(k) for k in batch]
            if found:
                leases.append((table.lease(found, expires=1e18), found))
                model.pins.update(found)
        elif op < 0.85 and leases:
            lease, found = leases.pop(rng.randrange(len(leases)))
            table.end_lease(lease)
            model.pins.subtract(found)
        else:  # release, one key or a batch (while pinned: covered below, not by the model)
            free = [k for k in universe if k not in model.where or model.pins[model.where[k]] <= 0]
            batch = rng.sample(free, min(len(free), rng.randint(1, 4)))
            if batch and rng.random() < 0.3:
                batch.append(batch[0])  # a key listed twice is released once
            if len(batch) == 1:
                table.release(batch[0])
            else:
                table.release_many(batch)
            for key in dict.fromkeys(batch):
                if key in model.where:
                    model.remove(key)
        assert state(table) == list(model.where.items())
        assert table._lru._free == model.free
        assert table.evictions == model.evictions
        pinned = {s for s, n in model.pins.items() if n > 0}
        assert table.pinned == len(pinned)
        assert len({s for _, s in state(table)}) == len(state(table)) <= size  # capacity
        answer = table.stored_keys([("t", [k.digest for k in universe])])
        assert [k in table._lru for k in answer] == [k in model.where for k in universe]
        if by_digest:  # the stored keys themselves, and no key built for the others
            assert answer == [k if k in model.where else UNSTORED for k in universe]
        else:
            assert answer == universe


def test_a_batch_never_evicts_pinned_slots_and_evicts_oldest_first() -> None:
    table = PinnedSlots(4)
    a, b, c, d, e, f = keys(6)
    save(table, [a, b, c, d])
    lease = table.lease(table.find_many([a]).tolist(), expires=1e18)
    assert save(table, [e, f]) == [True, True]
    assert [k for k, _ in state(table)] == [d, a, e, f]  # find touched a; b, c went
    table.end_lease(lease)
    assert table.pinned == 0


def test_a_batch_larger_than_the_pool_keeps_its_newest_blocks() -> None:
    table = PinnedSlots(3)
    batch = keys(8)
    assert save(table, batch) == [True] * 8
    assert [k for k, _ in state(table)] == batch[-3:]


def test_when_every_slot_is_pinned_new_keys_fail_and_stored_ones_succeed() -> None:
    table = PinnedSlots(2)
    a, b, c = keys(3)
    save(table, [a, b])
    table.lease(table.find_many([a, b]).tolist(), expires=1e18)
    assert save(table, [a, c]) == [True, False]
    assert c not in table


def test_lease_expiry_unpins_and_frees_released_keys() -> None:
    table = PinnedSlots(2)
    a, b = keys(2)
    save(table, [a, b])
    table.lease(table.find_many([a]).tolist(), expires=10.0)
    table.release(a)
    assert a not in table and table.find_many([a]).tolist() == [-1]
    assert table.allocate_many(keys(1, "x"), table.protected()) == [1]  # a's slot is read
    table.reap(now=9.0)
    assert table.pinned == 1
    table.reap(now=11.0)
    assert table.pinned == 0 and table._lru._free == [0]  # a went with its last pin


def test_a_batch_release_frees_the_unpinned_keys_and_hides_the_pinned_ones() -> None:
    table = PinnedSlots(4)
    a, b, c, d = keys(4)
    save(table, [a, b, c, d])
    lease = table.lease(table.find_many([b, d]).tolist(), expires=1e18)
    table.release_many([a, b, keys(1, "absent")[0], d, a])
    assert [k in table for k in (a, b, c, d)] == [False, False, True, False]
    assert table._lru._free == [0]  # only a's slot: b's and d's are still read
    assert table.find_many([b, d]).tolist() == [-1, -1]
    table.end_lease(lease)
    assert sorted(table._lru._free) == [0, 1, 3] and len(table) == 1


def test_keep_takes_back_a_key_released_while_pinned() -> None:
    table = PinnedSlots(2)
    (a,) = keys(1)
    save(table, [a])
    lease = table.lease(table.find_many([a]).tolist(), expires=1e18)
    table.release(a)
    assert a not in table
    assert table.keep_many([a]).tolist() == [0]
    table.end_lease(lease)
    assert a in table


def _twin_tables() -> tuple[PinnedSlots, PinnedSlots, list[BlockKey]]:
    """Two tables in the same state: stored keys, a pinned one released, free slots."""
    universe = keys(6, "twin")
    tables = (PinnedSlots(4), PinnedSlots(4))
    for table in tables:
        save(table, universe[:4])
        table.lease(table.find_many(universe[1:2]).tolist(), expires=1e18)
        table.release(universe[1])  # released while pinned: gone for lookups, slot kept
    return *tables, universe


def test_short_batch_answers_match_the_numpy_ones() -> None:
    """``find_few`` and ``new_keys`` (a one-block batch's plain-Python path) answer as
    ``find_many`` and ``keep_many`` do, and leave the table as they leave it."""
    few, many, universe = _twin_tables()
    batch = [universe[5], universe[1], universe[0], universe[3]]
    assert few.find_few(batch) == many.find_many(batch).tolist()
    assert state(few) == state(many)
    assert few.new_keys(batch) == np.flatnonzero(many.keep_many(batch) < 0).tolist() == [0]
    assert universe[1] in few and universe[1] in many  # taken back by both
    assert state(few) == state(many)
    long_batch = keys(20, "long")
    assert few.new_keys(long_batch) == list(range(20))


def test_pins_count_duplicates_and_unpin_never_goes_negative() -> None:
    table = PinnedSlots(64)
    save(table, keys(64))
    table.pin([3, 3, 5])
    table.unpin([3])
    assert table.pinned == 2
    table.unpin([3, 5, 5, 7])  # more unpins than pins: floored at zero
    assert table.pinned == 0
    table.pin(np.arange(64))  # the whole-pool (bincount) path
    table.unpin(np.arange(64))
    assert table.pinned == 0 and table.protected() == set()


def test_prefix_stops_at_the_first_missing_or_released_key() -> None:
    table = PinnedSlots(8)
    batch = keys(5)
    save(table, batch[:4])
    assert table.prefix(batch) == 4
    table.lease(table.find_many(batch[1:2]).tolist(), expires=1e18)
    table.release(batch[1])
    assert table.prefix(batch) == 1
    assert table.prefix([]) == 0


def test_slot_pool_allocate_many_uses_free_then_unused_then_lru() -> None:
    pool = SlotPool(4)
    a, b, c, d, e, f = keys(6)
    assert pool.allocate_many([a, b, c], set()) == [0, 1, 2]
    pool.remove(b)
    assert pool.allocate_many([d, e], set()) == [1, 3]
    assert pool.allocate_many([f], {0}) == [2]  # a (slot 0) is protected; c goes
    assert pool.evictions == 1 and c not in pool


def test_digests_find_the_stored_keys_themselves_per_namespace() -> None:
    table = PinnedSlots(8, by_digest=True)
    a, b = BlockKey(b"same", "model-a"), BlockKey(b"same", "model-b")
    table.allocate_many([a], set())
    found = table.stored_keys([("model-a", [b"same", b"other"]), ("model-b", [b"same"])])
    assert found == [a, UNSTORED, UNSTORED]
    assert found[0] is a, "the stored key itself: no key is built per digest"
    table.allocate_many([b], set())
    assert table.stored_keys([("model-b", [b"same"])])[0] is b
    table.release(a)
    assert table.stored_keys([("model-a", [b"same"])]) == [UNSTORED]
    assert table.find(UNSTORED) is None and table.prefix([UNSTORED]) == 0
    assert table.find_many([UNSTORED, b]).tolist() == [-1, table.find(b)]


def test_a_digest_released_while_pinned_is_found_but_answered_absent() -> None:
    table = PinnedSlots(4, by_digest=True)
    key = BlockKey(b"d", "t")
    (slot,) = table.allocate_many([key], set())
    table.pin([slot])
    table.release(key)
    stored = table.stored_keys([("t", [b"d"])])
    assert stored == [key] and table.find_many(stored).tolist() == [-1]
    table.unpin([slot])
    assert table.stored_keys([("t", [b"d"])]) == [UNSTORED]
