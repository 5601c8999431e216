"""Fault matrix: whatever the first child does wrong, the blocks come from the next one.

The fault wrappers of :mod:`kvmux.testing.faults` sit around a real ``cpu``
pool; the MultiBackend under test is the real one. In every case the load
ends with every key ok and byte-identical, fast (no child is waited on
past its own ``timeout_s``), and nothing raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvmux.backend import Backend
from kvmux.connector import Connector
from kvmux.handle import Status
from kvmux.integrity import ChecksumBackend
from kvmux.multi.backend import MultiBackend
from kvmux.testing.faults import CorruptBytes, Delay, Die, DropKeys, FailMidBatch
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory
from multi_support import DST, SRC, N, keys, pool

CHILD_TIMEOUT_S = 0.3


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, 32, "cpu", seed=11)


Fault = Callable[[Backend], Backend]

FAULTS: dict[str, tuple[Fault, str]] = {
    "dies-raising": (lambda c: Die(c, mode="raise"), "errors"),
    "dies-failing": (lambda c: Die(c, mode="fail"), "failures"),
    "hangs-past-its-timeout": (lambda c: Delay(c, 5.0), "timeouts"),
    "hangs-dead-transport": (lambda c: Die(c, mode="hang", deadline_s=5.0), "timeouts"),
    "drops-blocks": (lambda c: DropKeys(c, rate=0.5, seed=3), "misses"),
    "fills-up-mid-load": (lambda c: FailMidBatch(c, after=3, ops=("load",)), "failures"),
    "corrupts-behind-checksum": (
        lambda c: ChecksumBackend.wrap(CorruptBytes(c, rate=1.0, nbytes=4)),
        "failures",
    ),
}
"""First child's fault -> the per-child counter that must show it."""


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_blocks_come_from_the_next_child_whatever_the_first_does(
    fault: str, memory: KVMemory, opened: list[Connector]
) -> None:
    wrap, counter = FAULTS[fault]
    multi = Connector(
        MultiBackend.of("fallback", [wrap(pool(CHILD_TIMEOUT_S)), pool()], timeout_s=5.0)
    )
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=10).ok  # the second child took them all
    start = time.monotonic()
    result = multi.load(ks, DST).result(timeout=10)
    elapsed = time.monotonic() - start
    assert result.ok, result.not_ok[:2]
    assert memory.blocks(DST).equal(memory.blocks(SRC))
    assert elapsed < 2.0, f"waited {elapsed:.1f} s for a child whose timeout_s is 0.3"
    stats = multi.stats()
    assert stats[f"child.0.{counter}"] > 0
    assert stats["child.0.hits"] + stats["child.1.hits"] == N


def test_a_corrupt_block_without_checksum_is_wrong_data(
    memory: KVMemory, opened: list[Connector]
) -> None:
    """The counterpart of the checksum case above: why the checksum is there."""
    multi = Connector(MultiBackend.of("fallback", [CorruptBytes(pool(), rate=1.0), pool()]))
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    ks = keys()
    multi.save(ks, SRC).result(timeout=10)
    assert multi.load(ks, DST).result(timeout=10).ok
    assert not memory.blocks(DST).equal(memory.blocks(SRC))


def test_every_child_failing_ends_every_key_failed_without_raising_or_hanging(
    memory: KVMemory, opened: list[Connector]
) -> None:
    children = [
        Die(pool(), mode="raise"),
        Die(pool(), mode="fail"),
        Die(pool(CHILD_TIMEOUT_S), mode="hang", deadline_s=5.0),
    ]
    multi = Connector(MultiBackend.of("fallback", children, timeout_s=5.0, breaker={"failures": 2}))
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    ks = keys()
    start = time.monotonic()
    saved = multi.save(ks, SRC).result(timeout=10)
    loaded = multi.load(ks, DST).result(timeout=10)
    assert time.monotonic() - start < 3.0
    for result in (saved, loaded):
        assert [o.status for o in result.outcomes] == [Status.FAILED] * N
        reason = result.outcomes[0].reason or ""
        for i in range(3):
            assert f"child {i} (cpu)" in reason, reason
    # Two failed calls each: every breaker is open, so not even the hung lookup is waited on.
    assert [multi.stats()[f"child.{i}.breaker_state"] for i in range(3)] == [2.0] * 3
    assert multi.lookup(ks[:1]) == 0


def test_a_raising_child_never_takes_lookups_down(
    memory: KVMemory, opened: list[Connector]
) -> None:
    first, second = Die(pool(), mode="raise", after_calls=1), pool()
    multi = Connector(MultiBackend.of("fallback", [first, second]))
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    ks = keys()
    assert multi.save(ks, SRC).result(timeout=10).ok  # uses the first child's one call
    assert multi.lookup(ks) == N
    assert multi.stats()["child.0.errors"] >= 1


def test_first_hit_does_not_fall_back_like_vllm(memory: KVMemory, opened: list[Connector]) -> None:
    """vLLM's MultiConnector loads from the first child with a hit; what fails there
    is recomputed, not fetched elsewhere."""
    multi = Connector(
        MultiBackend.of("first-hit", [FailMidBatch(pool(), after=3, ops=("load",)), pool()])
    )
    opened.append(multi)
    multi.register(memory.layout, memory.caches)
    ks = keys()
    multi.save(ks, SRC).result(timeout=10)
    result = multi.load(ks, DST).result(timeout=10)
    assert [o.status for o in result.outcomes] == [Status.OK] * 3 + [Status.FAILED] * (N - 3)
    assert multi.stats()["child.1.hits"] == 0
