"""A composite checks each request once: a multi's children (and ``checksum``'s inner
backend) are backends, run through runners of their own, so their arguments are
checked only by the composite's front, yet each still counts what it moved in its
own stats.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.errors import ClosedError, InvalidRequestError, NotRegisteredError
from kvmux.handle import MISSING, OK, Outcome, Status, failed
from kvmux.integrity import ChecksumBackend
from kvmux.keys import BlockKey
from kvmux.multi.backend import MultiBackend
from kvmux.multi.child import plainly_ok
from kvmux.runner import Runner
from kvmux.testing.faults import FailMidBatch
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory
from multi_support import DST, SRC, N, keys, pool


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, 32, "cpu", seed=13)


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Backend]]:
    """The backend of every front that ran its per-key argument checks, in order."""
    seen: list[Backend] = []
    real = Connector._check_transfer

    def counting(self: Connector, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        seen.append(self.backend)
        real(self, keys, block_ids)

    monkeypatch.setattr(Connector, "_check_transfer", counting)
    yield seen


class OwnSave(CpuPoolBackend):
    """A backend whose ``save`` does more than the pool's (counts its calls)."""

    def __init__(self) -> None:
        super().__init__(CpuPoolConfig(capacity_bytes=2**20, timeout_s=2.0))
        self.own_saves = 0

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        self.own_saves += 1
        return super().save(keys, block_ids)


def multi_of(children: list[Backend], memory: KVMemory, opened: list[Connector]) -> Connector:
    multi = Connector(MultiBackend.of("fallback", children))
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    return multi


def test_children_count_what_they_moved_without_checking_it_again(
    memory: KVMemory, opened: list[Connector], checked: list[Backend]
) -> None:
    a, b = pool(), pool()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    assert checked == [multi.backend] * 2, "the multi checked each request once, alone"
    assert Connector(a).stats()["save_blocks_ok"] == Connector(b).stats()["save_blocks_ok"] == N
    assert Connector(a).stats()["load_blocks_ok"] == N
    assert "load_calls" not in Connector(b).stats(), "the first child delivered every block"
    stats = multi.stats()
    assert stats["child.0.backend.save_bytes"] == N * memory.layout.block_nbytes
    assert stats["child.0.backend.load_calls"] == 1
    assert stats["load_blocks_ok"] == N


def test_a_child_counts_its_misses_and_the_next_its_part(
    memory: KVMemory, opened: list[Connector], checked: list[Backend]
) -> None:
    a, b = pool(), pool()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert Connector(a).save(ks[::2], SRC[::2]).result(timeout=5).ok  # direct: checked, counted
    assert Connector(b).save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    a_stats, b_stats = Connector(a).stats(), Connector(b).stats()
    assert (a_stats["load_blocks_ok"], a_stats["load_blocks_missing"]) == (N // 2, N // 2)
    assert (b_stats["load_blocks_ok"], b_stats["load_calls"]) == (N // 2, 1)
    assert checked == [a, b, multi.backend], "only the direct saves and the multi's load"
    stats = multi.stats()
    assert (stats["child.0.hits"], stats["child.0.misses"], stats["child.1.hits"]) == (4, 4, 4)
    assert stats["child.1.fallbacks"] == 0, "a block a child lacks is no failure"


def test_keys_a_child_failed_count_as_fallbacks_of_the_next(
    memory: KVMemory, opened: list[Connector]
) -> None:
    first, second = pool(), pool()
    multi = multi_of([FailMidBatch(first, after=3, ops=("load",)), second], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    assert multi.load(ks, DST).result(timeout=5).ok
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    stats = multi.stats()
    assert (stats["child.0.hits"], stats["child.0.failures"]) == (3, N - 3)
    assert stats["child.1.fallbacks"] == stats["child.1.hits"] == N - 3
    assert Connector(second).stats()["load_blocks_ok"] == N - 3


def test_a_closed_child_fails_its_keys_as_an_error_of_that_child(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a, b = pool(), pool()
    multi = multi_of([a, b], memory, opened)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=5).ok
    Connector(a).close()  # adopted: its owner may close it under the multi
    assert multi.load(ks, DST).result(timeout=5).ok
    stats = multi.stats()
    assert (stats["child.0.errors"], stats["child.1.hits"]) == (1, N)


def test_a_childs_own_save_is_what_runs_unchecked(
    memory: KVMemory, opened: list[Connector], checked: list[Backend]
) -> None:
    own = OwnSave()
    multi = multi_of([own], memory, opened)
    assert multi.save(keys(), SRC).result(timeout=5).ok
    assert own.own_saves == 1 and own not in checked
    assert multi.load(keys(), DST).result(timeout=5).ok
    assert checked == [multi.backend] * 2


def test_the_multi_itself_still_refuses_bad_requests(
    memory: KVMemory, opened: list[Connector]
) -> None:
    a = pool()
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
    assert "save_calls" not in Connector(a).stats()


def test_a_runner_keeps_the_cheap_checks(memory: KVMemory, checked: list[Backend]) -> None:
    backend = pool()
    runner = Runner(backend)
    ks = keys(2)
    with pytest.raises(NotRegisteredError):
        runner.save(ks, [0, 1])
    runner.register(memory.layout, memory.caches)
    with pytest.raises(InvalidRequestError):
        runner.save(ks, [0])
    assert runner.save(ks, [0, 1]).result(timeout=5).ok
    assert runner.load(ks, [4, 5], None).result(timeout=5).ok
    assert checked == []
    assert runner.stats()["save_blocks_ok"] == runner.stats()["load_blocks_ok"] == 2
    runner.close()
    with pytest.raises(ClosedError):
        runner.load(ks, [4, 5], None)


def test_checksum_checks_once_and_its_inner_backend_counts(
    memory: KVMemory, checked: list[Backend]
) -> None:
    inner = pool()
    conn = Connector(ChecksumBackend.wrap(inner))
    conn.register(memory.layout, memory.caches)
    try:
        ks = keys()
        assert conn.save(ks, SRC).result(timeout=5).ok
        assert conn.load(ks, DST).result(timeout=5).ok
        assert memory.blocks(DST).equal(memory.blocks(SRC))
        assert checked == [conn.backend] * 2
        inner_stats = Runner(inner).stats()
        assert inner_stats["save_blocks_ok"] == inner_stats["load_blocks_ok"] == N
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
