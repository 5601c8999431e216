"""A composite checks each request once: a multi's children (and ``checksum``'s inner
backend) are called through ``Connector._transfer_prechecked``, which skips their
per-key argument checks, yet each still counts what it moved in its own stats.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvmux.backends.cpu import CpuPoolConfig, CpuPoolConnector
from kvmux.connector import Connector
from kvmux.errors import ClosedError, InvalidRequestError, NotRegisteredError
from kvmux.handle import MISSING, OK, Handle, Outcome, Status, failed
from kvmux.integrity import ChecksumConnector
from kvmux.keys import BlockKey, chain_keys
from kvmux.multi.child import plainly_ok
from kvmux.multi.connector import MultiConnector
from kvmux.testing.faults import FailMidBatch
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

N = 8
SRC, DST = list(range(N)), list(range(16, 16 + N))


class Counted(CpuPoolConnector):
    """A ``cpu`` pool that counts the per-key argument checks it runs."""

    def __init__(self) -> None:
        super().__init__(CpuPoolConfig(capacity_bytes=2**20, timeout_s=2.0))
        self.checks = 0

    def _check_transfer(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        self.checks += 1
        super()._check_transfer(keys, block_ids)


class OwnSave(Counted):
    """A backend that (against the advice) overrides the public ``save``."""

    def __init__(self) -> None:
        super().__init__()
        self.own_saves = 0

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> Handle:
        self.own_saves += 1
        return super().save(keys, block_ids)


def keys(n: int = N, tag: str = "prechecked") -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, tag)


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, 32, "cpu", seed=13)


@pytest.fixture
def opened() -> Iterator[list[Connector]]:
    conns: list[Connector] = []
    yield conns
    for conn in reversed(conns):
        conn.close()


def multi_of(
    children: list[Connector], memory: KVMemory, opened: list[Connector]
) -> MultiConnector:
    multi = MultiConnector.of("fallback", children)
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    return multi


def test_children_count_what_they_moved_without_checking_it_again(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a, b = Counted(), Counted()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    assert (a.checks, b.checks) == (0, 0), "the multi checked the request already"
    assert a.stats()["save_blocks_ok"] == b.stats()["save_blocks_ok"] == N
    assert a.stats()["load_blocks_ok"] == N
    assert "load_calls" not in b.stats(), "the first child delivered every block"
    stats = multi.stats()
    assert stats["child.0.backend.save_bytes"] == N * memory.layout.block_nbytes
    assert stats["child.0.backend.load_calls"] == 1
    assert stats["load_blocks_ok"] == N


def test_a_child_counts_its_misses_and_the_next_its_part(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a, b = Counted(), Counted()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert a.save(ks[::2], SRC[::2]).result(timeout=5).ok  # direct: checked, counted
    assert b.save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    assert (a.stats()["load_blocks_ok"], a.stats()["load_blocks_missing"]) == (N // 2, N // 2)
    assert (b.stats()["load_blocks_ok"], b.stats()["load_calls"]) == (N // 2, 1)
    assert (a.checks, b.checks) == (1, 1), "only the direct saves were checked"
    stats = multi.stats()
    assert (stats["child.0.hits"], stats["child.0.misses"], stats["child.1.hits"]) == (4, 4, 4)
    assert stats["child.1.fallbacks"] == 0, "a block a child lacks is no failure"


def test_keys_a_child_failed_count_as_fallbacks_of_the_next(
    memory: KVMemory, opened: list[Connector]
) -> None:
    first, second = Counted(), Counted()
    multi = multi_of([FailMidBatch(first, after=3, ops=("load",)), second], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    stats = multi.stats()
    assert (stats["child.0.hits"], stats["child.0.failures"]) == (3, N - 3)
    assert stats["child.1.fallbacks"] == stats["child.1.hits"] == N - 3
    assert second.stats()["load_blocks_ok"] == N - 3


def test_a_closed_child_fails_its_keys_as_an_error_of_that_child(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a, b = Counted(), Counted()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    a.close()  # adopted: its owner may close it under the multi
    assert multi.load(ks, DST).result(timeout=5).ok
    stats = multi.stats()
    assert (stats["child.0.errors"], stats["child.1.hits"]) == (1, N)


def test_a_child_overriding_the_public_method_still_gets_it_called(
    memory: KVMemory, opened: list[Connector]
) -> None:
    own = OwnSave()
    multi = multi_of([own], memory, opened)
    assert multi.save(keys(), SRC).result(timeout=5).ok
    assert (own.own_saves, own.checks) == (1, 1)
    assert multi.load(keys(), DST).result(timeout=5).ok
    assert own.checks == 1, "load is not overridden: prechecked"


def test_the_multi_itself_still_refuses_bad_requests(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a = Counted()
    multi = multi_of([a], memory, opened)
    ks = keys()
    with pytest.raises(InvalidRequestError):
        multi.save([ks[0], ks[0]], [0, 1])
    with pytest.raises(InvalidRequestError):
        multi.load(ks[:2], [0, memory.layout.num_blocks])
    with pytest.raises(InvalidRequestError):
        multi.save(ks[:2], [3, 3])
    with pytest.raises(InvalidRequestError):
        multi.save(["not a key"], [0])  # type: ignore[list-item]
    assert "save_calls" not in a.stats()


def test_the_prechecked_entry_keeps_the_cheap_checks(memory: KVMemory) -> None:
    conn = Counted()
    ks = keys(2)
    with pytest.raises(NotRegisteredError):
        conn._transfer_prechecked("save", ks, [0, 1])
    conn.register(memory.layout, memory.caches)
    with pytest.raises(ValueError, match="op must be"):
        conn._transfer_prechecked("lookup", ks, [0, 1])
    with pytest.raises(InvalidRequestError):
        conn._transfer_prechecked("save", ks, [0])
    assert conn._transfer_prechecked("save", ks, [0, 1]).result(timeout=5).ok
    assert conn._transfer_prechecked("load", ks, [4, 5]).result(timeout=5).ok
    assert conn.checks == 0
    assert conn.stats()["save_blocks_ok"] == conn.stats()["load_blocks_ok"] == 2
    conn.close()
    with pytest.raises(ClosedError):
        conn._transfer_prechecked("load", ks, [4, 5])


def test_checksum_checks_once_and_its_inner_backend_counts(memory: KVMemory) -> None:
    inner = Counted()
    conn = ChecksumConnector.wrap(inner)
    conn.register(memory.layout, memory.caches)
    try:
        ks = keys()
        assert conn.save(ks, SRC).result(timeout=5).ok
        assert conn.load(ks, DST).result(timeout=5).ok
        assert memory.blocks(DST).equal(memory.blocks(SRC))
        assert inner.checks == 0
        assert inner.stats()["save_blocks_ok"] == inner.stats()["load_blocks_ok"] == N
        assert conn.stats()["checksum_verified"] == N
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("outcomes", "n", "expected"),
    [
        ((), 0, True),
        ((OK,) * 3, 3, True),
        ([OK, OK], 2, True),
        ((OK,) * 3, 4, False),
        ((OK, MISSING, OK), 3, False),
        ((OK, failed("x")), 2, False),
        ((Outcome(Status.OK, "stored elsewhere"),), 1, False),  # ok, but not plainly
    ],
)
def test_plainly_ok(outcomes: Sequence[Outcome], n: int, expected: bool) -> None:
    assert plainly_ok(outcomes, n) is expected
