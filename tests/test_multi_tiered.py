"""``tiered``: capacity per tier, demotion, promotion, write-back and write-through, LRU vs ARC.

Tiers are ``cpu`` pools big enough never to evict on their own, so every
eviction seen here is the multi's; each pool is also used directly to see
which tier holds what.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.keys import BlockKey, chain_keys
from kvmux.multi.backend import MultiBackend
from kvmux.multi.eviction import ArcPolicy, LruPolicy
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

TOP = 8
"""Blocks the top tier holds."""


def pool() -> Backend:
    return CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20, timeout_s=2.0))


def keys(n: int, tag: str = "tiered") -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, tag)


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, 64, "cpu", seed=3)


Tiered = Callable[..., tuple[Connector, list[Backend]]]


@pytest.fixture
def tiered(memory: KVMemory) -> Iterator[Tiered]:
    """``tiered(**options)``: a registered two-tier multi (top holds TOP blocks) and its pools."""
    made: list[Connector] = []

    def build(**options: Any) -> tuple[Connector, list[Backend]]:
        pools = [pool(), pool()]
        options.setdefault("tiers", [{"capacity_blocks": TOP}])
        multi = Connector(MultiBackend.of("tiered", pools, **options))
        multi.register(memory.layout, memory.caches)
        made.append(multi)
        return multi, pools

    yield build
    for multi in made:
        multi.close()


def held(tier: Backend, ks: list[BlockKey]) -> list[int]:
    """Which of ``ks`` (by index) ``tier`` holds."""
    return [i for i, key in enumerate(ks) if Connector(tier).lookup([key]) == 1]


@pytest.mark.parametrize("write", ["back", "through"])
def test_twice_the_top_capacity_never_overfills_the_top_and_loses_nothing(
    write: str, tiered: Tiered, memory: KVMemory
) -> None:
    multi, (top, _) = tiered(write=write)
    ks = keys(2 * TOP)
    for start in range(0, len(ks), 3):
        part = list(range(start, min(start + 3, len(ks))))
        assert multi.save([ks[i] for i in part], part).result(timeout=5).ok
        assert Connector(top).stats()["blocks_stored"] <= TOP
        assert multi.stats()["tier.0.blocks"] <= TOP
    assert held(top, ks) == list(range(TOP, 2 * TOP)), "the top keeps the newest blocks"
    assert multi.lookup(ks) == len(ks)
    dst = list(range(32, 32 + len(ks)))
    assert multi.load(ks, dst).result(timeout=5).ok
    assert memory.blocks(dst).equal(memory.blocks(range(len(ks))))


def test_write_back_demotes_only_what_the_top_evicts(tiered: Tiered) -> None:
    multi, (_, bottom) = tiered(write="back")
    ks = keys(TOP + 3)
    assert multi.save(ks[:TOP], range(TOP)).result(timeout=5).ok
    assert held(bottom, ks) == [], "write-back: nothing below the top until an eviction"
    assert multi.save(ks[TOP:], range(TOP, TOP + 3)).result(timeout=5).ok
    assert held(bottom, ks) == [0, 1, 2]
    assert multi.stats()["child.1.demotions"] == 3


def test_write_through_saves_every_block_in_every_tier(tiered: Tiered) -> None:
    multi, (top, bottom) = tiered(write="through")
    ks = keys(TOP + 3)
    assert multi.save(ks, range(TOP + 3)).result(timeout=5).ok
    assert held(bottom, ks) == list(range(TOP + 3))
    assert held(top, ks) == list(range(3, TOP + 3))
    assert multi.stats()["child.1.demotions"] == 0


@pytest.mark.parametrize("write", ["back", "through"])
def test_a_lower_tier_hit_is_promoted_to_the_top(
    write: str, tiered: Tiered, memory: KVMemory
) -> None:
    multi, (top, _) = tiered(write=write)
    ks = keys(TOP + 4)
    assert multi.save(ks, range(TOP + 4)).result(timeout=5).ok
    assert held(top, ks[:4]) == []
    dst = list(range(32, 36))
    assert multi.load(ks[:4], dst).result(timeout=5).ok
    assert memory.blocks(dst).equal(memory.blocks(range(4)))
    assert held(top, ks[:4]) == [0, 1, 2, 3]
    stats = multi.stats()
    assert (stats["child.1.hits"], stats["child.0.promotions"]) == (4, 4)
    assert multi.lookup(ks) == len(ks), "promotion pushed others down, it did not lose them"


def test_promotion_can_be_turned_off(tiered: Tiered) -> None:
    multi, (top, _) = tiered(promote=False)
    ks = keys(TOP + 2)
    multi.save(ks, range(TOP + 2)).result(timeout=5)
    assert multi.load(ks[:2], [40, 41]).result(timeout=5).ok
    assert held(top, ks[:2]) == []


@pytest.mark.parametrize(("eviction", "hot_stays_on_top"), [("lru", False), ("arc", True)])
def test_a_scan_flushes_the_hot_set_from_lru_but_not_from_arc(
    eviction: str, hot_stays_on_top: bool, tiered: Tiered
) -> None:
    multi, (top, _) = tiered(tiers=[{"capacity_blocks": TOP, "eviction": eviction}])
    hot, scan = keys(4, "hot"), keys(3 * TOP, "scan")
    multi.save(hot, range(4)).result(timeout=5)
    for _ in range(2):  # reused prefixes: loaded again and again
        assert multi.load(hot, range(40, 44)).result(timeout=5).ok
    for start in range(0, len(scan), 4):  # one-off prompts, each seen once
        multi.save(scan[start : start + 4], range(4, 8)).result(timeout=5)
    assert (held(top, hot) == [0, 1, 2, 3]) is hot_stays_on_top
    assert multi.lookup(hot) == 4, "evicted from the top is not gone"


def test_a_tier_capacity_in_bytes_is_counted_in_whole_blocks(tiered: Tiered) -> None:
    nbytes = DEFAULT_LAYOUT.block_nbytes
    multi, (top, _) = tiered(tiers=[{"capacity_bytes": 3 * nbytes + nbytes // 2}])
    multi.save(keys(6), range(6)).result(timeout=5)
    assert multi.stats()["tier.0.capacity_blocks"] == 3
    assert Connector(top).stats()["blocks_stored"] == 3


def test_released_blocks_leave_every_tier(tiered: Tiered) -> None:
    multi, pools = tiered(write="through")
    ks = keys(4)
    multi.save(ks, range(4)).result(timeout=5)
    multi.release(ks[:2])
    assert [held(p, ks) for p in pools] == [[2, 3], [2, 3]]
    assert multi.stats()["tier.0.blocks"] == 2


# ----------------------------------------------------------- eviction policies


def test_lru_evicts_the_least_recently_used() -> None:
    lru = LruPolicy(3)
    a, b, c, d = keys(4, "lru")
    for key in (a, b, c):
        assert lru.insert(key) == []
    lru.touch(a)
    assert lru.insert(d) == [b]
    assert {k for k in (a, b, c, d) if k in lru} == {a, c, d}


def test_arc_keeps_keys_seen_twice_through_a_scan() -> None:
    arc = ArcPolicy(4)
    hot = keys(2, "arc-hot")
    for key in hot:
        arc.insert(key)
        arc.touch(key)
    evicted = [victim for key in keys(20, "arc-scan") for victim in arc.insert(key)]
    assert all(key in arc for key in hot)
    assert len(arc) == 4
    assert not set(evicted) & set(hot)


def test_arc_gives_recency_more_room_after_a_recency_ghost_hit() -> None:
    arc = ArcPolicy(2)
    a, b, c = keys(3, "ghost")
    arc.insert(a)
    arc.touch(a)  # a: frequent
    arc.insert(b)
    assert arc.insert(c) == [b]  # b: evicted from the recent list, remembered as a ghost
    assert arc.insert(b) == [a]  # b was evicted too early: the frequent list gives way
    assert b in arc
    assert c in arc


def test_unbounded_policies_never_evict() -> None:
    for policy in (LruPolicy(None), ArcPolicy(None)):
        assert [v for key in keys(50, "unbounded") for v in policy.insert(key)] == []
        assert len(policy) == 50
