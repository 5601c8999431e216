"""``fallback`` composes hits across children; ``first-hit`` behaves like vLLM's MultiConnector.

Blocks are put straight into one child or the other (each child is
registered with the engine's memory, so it can be used directly), then
read back through the multi.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvmux.backend import Address, Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.handle import Status
from kvmux.keys import BlockKey, chain_keys
from kvmux.multi.backend import MultiBackend
from kvmux.testing.faults import FailMidBatch, FaultWrapper
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

NUM_BLOCKS = 64


def pool() -> Backend:
    return CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20, timeout_s=2.0))


def keys(n: int) -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, "policies")


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, NUM_BLOCKS, "cpu", seed=5)


@pytest.fixture
def children() -> list[Backend]:
    return [pool(), pool()]


Make = Callable[..., Connector]


@pytest.fixture
def make(memory: KVMemory) -> Iterator[Make]:
    """``make(policy, children, **options)``: a registered multi, closed after the test."""
    made: list[Connector] = []

    def build(policy: str, children: list[Backend], **options: Any) -> Connector:
        multi = Connector(MultiBackend.of(policy, children, **options))
        multi.register(memory.layout, memory.caches)
        made.append(multi)
        return multi

    yield build
    for multi in made:
        multi.close()


@pytest.fixture
def fallback(make: Make, children: list[Backend]) -> Connector:
    return make("fallback", children)


@pytest.fixture
def first_hit(make: Make, children: list[Backend]) -> Connector:
    return make("first-hit", children)


def put(child: Backend, ks: list[BlockKey], blocks: list[int]) -> None:
    assert Connector(child).save(ks, blocks).result(timeout=5).ok


def test_a_prefix_spanning_two_children_is_one_hit_and_loads_whole(
    fallback: Connector, children: list[Backend], memory: KVMemory
) -> None:
    ks = keys(20)
    put(children[0], ks[:10], list(range(10)))
    put(children[1], ks[10:], list(range(10, 20)))
    assert fallback.lookup(ks) == 20
    dst = list(range(32, 52))
    assert fallback.load(ks, dst).result(timeout=5).ok
    assert memory.blocks(dst).equal(memory.blocks(range(20)))
    stats = fallback.stats()
    assert (stats["child.0.hits"], stats["child.1.hits"]) == (10, 10)


def test_a_composed_prefix_stops_at_the_first_block_no_child_has(
    fallback: Connector, children: list[Backend]
) -> None:
    ks = keys(12)
    put(children[0], ks[0:8:2] + ks[9:], [0, 2, 4, 6, 9, 10, 11])  # even keys, then past a gap
    put(children[1], ks[1:8:2], [1, 3, 5, 7])  # odd keys
    assert fallback.lookup(ks) == 8, "blocks 0-7 alternate between children; 8 is nowhere"
    assert fallback.lookup(ks[9:]) == 3


def test_blocks_no_child_has_are_missing_and_untouched(
    fallback: Connector, children: list[Backend], memory: KVMemory
) -> None:
    ks = keys(4)
    put(children[1], ks[:2], [0, 1])
    before = memory.blocks([34, 35])
    result = fallback.load(ks, [32, 33, 34, 35]).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.OK] * 2 + [Status.MISSING] * 2
    assert memory.blocks([34, 35]).equal(before)


def test_first_hit_counts_and_loads_only_the_first_child_with_a_hit(
    first_hit: Connector, children: list[Backend], memory: KVMemory
) -> None:
    ks = keys(8)
    put(children[0], ks[:4], list(range(4)))
    put(children[1], ks, list(range(8)))
    assert first_hit.lookup(ks) == 4, "the first child's hit, not the longer one behind it"
    result = first_hit.load(ks, list(range(32, 40))).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.OK] * 4 + [Status.MISSING] * 4
    assert first_hit.stats()["child.1.hits"] == 0


def test_first_hit_skips_children_without_a_hit(
    first_hit: Connector, children: list[Backend], memory: KVMemory
) -> None:
    ks = keys(6)
    put(children[1], ks, list(range(6)))
    assert first_hit.lookup(ks) == 6
    assert first_hit.load(ks, list(range(32, 38))).result(timeout=5).ok
    assert memory.blocks(range(32, 38)).equal(memory.blocks(range(6)))


@pytest.mark.parametrize("policy", ["first-hit", "fallback"])
def test_saves_reach_every_child(policy: str, make: Make, children: list[Backend]) -> None:
    multi = make(policy, children)
    ks = keys(5)
    assert multi.save(ks, range(5)).result(timeout=5).ok
    assert [Connector(child).lookup(ks) for child in children] == [5, 5]


def test_fallback_can_save_to_the_first_child_only_and_spill_its_failures(make: Make) -> None:
    first, second = FailMidBatch(pool(), after=2, ops=("save",)), pool()
    multi = make("fallback", [first, second], save_to="first")
    ks = keys(5)
    assert multi.save(ks, range(5)).result(timeout=5).ok
    assert Connector(first.inner).lookup(ks) == 2
    assert Connector(second).lookup(ks) == 0
    assert Connector(second).lookup(ks[2:]) == 3
    assert multi.lookup(ks) == 5


class Peer(FaultWrapper):
    """A child reachable by peers: it has an address and records the sources it is given."""

    def __init__(self, inner: Backend, name: str) -> None:
        super().__init__(inner)
        self.name = name
        self.sources: list[Address | None] = []

    def address(self) -> dict[str, Any]:
        return {"peer": self.name}

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        self.sources.append(source)
        return super().lookup(keys, source)


def test_a_multi_address_gives_each_child_its_own_part(make: Make) -> None:
    peer, local = Peer(pool(), "a"), pool()
    multi = make("fallback", [peer, local])
    address = multi.address()
    assert address == {"children": [{"peer": "a"}, None]}
    assert multi.lookup(keys(1), source=address) == 0
    assert peer.sources == [{"peer": "a"}]
