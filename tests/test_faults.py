"""Fault-injection wrappers: each misbehaves exactly as documented, deterministically."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest

from kvmux.connector import Connector
from kvmux.errors import InvalidRequestError, TransferError, TransferTimeout
from kvmux.handle import Status
from kvmux.keys import BlockKey, chain_keys
from kvmux.registry import create_connector
from kvmux.testing.faults import (
    CorruptBytes,
    Delay,
    Die,
    DropKeys,
    FailMidBatch,
    FaultWrapper,
    KeyChoice,
)
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

NUM_BLOCKS = 32


def _keys(n: int, tag: str = "faults") -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, tag)


@pytest.fixture
def memory() -> KVMemory:
    return KVMemory(DEFAULT_LAYOUT, NUM_BLOCKS, "cpu", seed=1)


@pytest.fixture
def pool(memory: KVMemory) -> Iterator[Connector]:
    conn = create_connector({"backend": "cpu", "capacity_bytes": 2**20, "timeout_s": 2.0})
    conn.register(memory.layout, memory.caches)
    yield conn
    conn.close()


def _saved(pool: Connector, n: int) -> list[BlockKey]:
    keys = _keys(n)
    assert pool.save(keys, range(n)).result(timeout=5).ok
    return keys


def test_a_plain_wrapper_passes_everything_through(pool: Connector, memory: KVMemory) -> None:
    keys = _saved(pool, 4)
    wrapper = Connector(FaultWrapper(pool.backend))
    assert wrapper.capabilities == pool.capabilities
    assert wrapper.lookup(keys) == 4
    assert wrapper.load(keys, [10, 11, 12, 13]).result(timeout=5).ok
    assert memory.blocks([10, 11, 12, 13]).equal(memory.blocks([0, 1, 2, 3]))
    assert wrapper.stats()["load_blocks_ok"] == 4
    wrapper.close()
    assert not pool.health().healthy, "closing the wrapper closes the wrapped connector"


def test_key_choice_depends_only_on_seed_and_key() -> None:
    keys = _keys(400)
    a, b, other = KeyChoice(0.3, seed=5), KeyChoice(0.3, seed=5), KeyChoice(0.3, seed=6)
    chosen = [k in a for k in keys]
    assert chosen == [k in b for k in reversed(keys)][::-1]
    assert chosen != [k in other for k in keys]
    assert 0.2 < sum(chosen) / len(keys) < 0.4
    assert all(k in KeyChoice(0.0, frozenset(keys[:3])) for k in keys[:3])
    with pytest.raises(ValueError):
        KeyChoice(1.5)


def test_dropped_keys_load_as_missing_and_never_reach_the_backend(
    pool: Connector, memory: KVMemory
) -> None:
    keys = _saved(pool, 6)
    lossy = Connector(DropKeys(pool.backend, keys=[keys[1], keys[4]]))
    before = memory.blocks([11, 14])
    result = lossy.load(keys, range(10, 16)).result(timeout=5)
    assert result.by_status(Status.MISSING) == [keys[1], keys[4]]
    assert len(result.by_status(Status.OK)) == 4
    assert memory.blocks([11, 14]).equal(before)
    assert pool.stats()["load_blocks_ok"] == 4
    assert lossy.stats()["injected_dropped"] == 2
    assert lossy.lookup(keys) == 6, "by default a drop shows only at load time"


def test_drop_on_lookup_hides_keys_from_lookups_too(pool: Connector) -> None:
    keys = _saved(pool, 6)
    assert Connector(DropKeys(pool.backend, keys=[keys[2]], on_lookup=True)).lookup(keys) == 2
    assert Connector(DropKeys(pool.backend, keys=[keys[0]], on_lookup=True)).lookup(keys) == 0


def test_delayed_transfer_completes_late_without_blocking_the_caller(pool: Connector) -> None:
    keys = _saved(pool, 2)
    slow = Connector(Delay(pool.backend, 0.3))
    start = time.monotonic()
    handle = slow.load(keys, [20, 21])
    assert time.monotonic() - start < 0.1, "load() must return before the delay is over"
    assert not handle.poll()
    assert handle.result(timeout=5).ok
    assert time.monotonic() - start >= 0.3


def test_jitter_is_fixed_by_seed_and_batch() -> None:
    pool = create_connector({"backend": "cpu", "capacity_bytes": 2**20})
    keys = _keys(2)
    a = Delay(pool.backend, 0.1, jitter_s=0.2, seed=1)
    assert a.pause(keys) == Delay(pool.backend, 0.1, jitter_s=0.2, seed=1).pause(keys)
    assert 0.1 <= a.pause(keys) <= 0.3
    assert a.pause(keys) != Delay(pool.backend, 0.1, jitter_s=0.2, seed=2).pause(keys)
    pool.close()


def test_closing_during_a_delay_ends_the_transfer_promptly(pool: Connector) -> None:
    keys = _saved(pool, 2)
    slow = Connector(Delay(pool.backend, 30.0))
    handle = slow.load(keys, [20, 21])
    start = time.monotonic()
    slow.close()
    assert time.monotonic() - start < 5
    result = handle.result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.FAILED] * 2


def test_corruption_flips_bytes_but_reports_ok(pool: Connector, memory: KVMemory) -> None:
    keys = _saved(pool, 3)
    bad = Connector(CorruptBytes(pool.backend, keys=[keys[1]], nbytes=3, seed=9))
    result = bad.load(keys, [10, 11, 12]).result(timeout=5)
    assert result.ok, "a corrupting transport does not notice what it did"
    assert memory.blocks([10, 12]).equal(memory.blocks([0, 2]))
    diff = (memory.blocks([11]) != memory.blocks([1])).nonzero()[:, 1].tolist()
    assert diff == bad.backend.positions(keys[1])
    assert len(diff) == 3
    assert bad.backend.positions(keys[1]) == CorruptBytes(pool.backend, nbytes=3, seed=9).positions(
        keys[1]
    )


def test_corruption_is_caught_by_an_integrity_check(pool: Connector, memory: KVMemory) -> None:
    """What the wrapper is for: a checksum kept at save time exposes the damage."""
    keys = _saved(pool, 4)
    checksums = [hashlib.sha256(memory.blocks([i]).numpy().tobytes()).digest() for i in range(4)]
    bad = Connector(CorruptBytes(pool.backend, rate=0.5, seed=3))
    bad.load(keys, range(10, 14)).result(timeout=5)
    caught = [
        hashlib.sha256(memory.blocks([10 + i]).numpy().tobytes()).digest() != checksums[i]
        for i in range(4)
    ]
    assert caught == [k in bad.backend.choice for k in keys]


def test_a_batch_fails_after_its_first_n_keys(pool: Connector, memory: KVMemory) -> None:
    keys = _saved(pool, 5)
    flaky = Connector(FailMidBatch(pool.backend, after=2))
    result = flaky.load(keys, range(10, 15)).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.OK] * 2 + [Status.FAILED] * 3
    assert "after 2 of 5" in (result.outcomes[-1].reason or "")
    assert memory.blocks([10, 11]).equal(memory.blocks([0, 1]))
    fresh = _keys(3, "fresh")
    saved = flaky.save(fresh, [20, 21, 22]).result(timeout=5)
    assert [o.ok for o in saved.outcomes] == [True, True, False]
    assert pool.lookup(fresh) == 2, "the failed part of the save never reached the backend"


def test_mid_batch_failure_can_spare_saves(pool: Connector) -> None:
    keys = _keys(3)
    spared = Connector(FailMidBatch(pool.backend, after=0, ops=("load",)))
    assert spared.save(keys, [0, 1, 2]).result(5).ok
    with pytest.raises(ValueError):
        FailMidBatch(pool.backend, after=1, ops=("lookup",))


def test_a_backend_that_dies_by_raising(pool: Connector) -> None:
    keys = _saved(pool, 2)
    dying = Connector(Die(pool.backend, mode="raise", after_calls=2))
    assert dying.lookup(keys) == 2
    assert dying.health().healthy
    assert dying.load(keys, [10, 11]).result(timeout=5).ok
    assert not dying.health().healthy, "its last good call is spent: the next one fails"
    with pytest.raises(TransferError):
        dying.lookup(keys)
    # A transfer's exception never escapes the front: it fails every key, saying why.
    raised = dying.save(keys, [0, 1]).result(timeout=5)
    assert [o.status for o in raised.outcomes] == [Status.FAILED] * 2
    assert all("TransferError" in (o.reason or "") for o in raised.outcomes)
    dying.backend.revive()
    assert dying.lookup(keys) == 2


def test_a_backend_that_dies_by_failing(pool: Connector) -> None:
    keys = _saved(pool, 2)
    dead = Connector(Die(pool.backend, mode="fail"))
    assert dead.lookup(keys) == 0
    result = dead.load(keys, [10, 11]).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.FAILED] * 2
    assert "died" in (result.outcomes[0].reason or "")


def test_a_hung_backend_fails_at_its_deadline_never_later(pool: Connector) -> None:
    keys = _saved(pool, 2)
    hung = Connector(Die(pool.backend, mode="hang", deadline_s=0.3))
    start = time.monotonic()
    handle = hung.load(keys, [10, 11])
    assert not handle.poll()
    result = handle.result(timeout=5)
    elapsed = time.monotonic() - start
    assert 0.3 <= elapsed < 3
    assert [o.status for o in result.outcomes] == [Status.FAILED] * 2
    with pytest.raises(TransferTimeout):
        hung.lookup(keys)


def test_a_hung_backend_defaults_to_the_config_timeout(pool: Connector) -> None:
    assert Die(pool.backend, mode="hang").deadline_s == pool.config.timeout_s
    with pytest.raises(ValueError):
        Die(pool.backend, mode="explode")  # type: ignore[arg-type]


def test_closing_a_hung_backend_returns_promptly(pool: Connector) -> None:
    keys = _saved(pool, 2)
    hung = Connector(Die(pool.backend, mode="hang", deadline_s=30))
    handle = hung.load(keys, [10, 11])
    start = time.monotonic()
    hung.close()
    assert time.monotonic() - start < 5
    assert not handle.result(timeout=5).ok


def test_wrappers_stack(pool: Connector, memory: KVMemory) -> None:
    keys = _saved(pool, 4)
    stacked = Connector(Delay(DropKeys(pool.backend, keys=[keys[3]]), 0.05))
    result = stacked.load(keys, range(10, 14)).result(timeout=5)
    assert [o.status for o in result.outcomes] == [Status.OK] * 3 + [Status.MISSING]
    assert memory.blocks([10, 11, 12]).equal(memory.blocks([0, 1, 2]))


def test_a_wrapper_can_register_for_the_backend(memory: KVMemory) -> None:
    inner = create_connector({"backend": "cpu", "capacity_bytes": 2**20})
    wrapper = Connector(DropKeys(inner.backend))
    wrapper.register(memory.layout, memory.caches)
    assert inner.layout == memory.layout
    keys = _keys(2)
    assert wrapper.save(keys, [0, 1]).result(timeout=5).ok
    assert inner.lookup(keys) == 2
    wrapper.close()


def test_wrappers_check_arguments_like_any_connector(pool: Connector) -> None:
    with pytest.raises(InvalidRequestError, match="2 keys but 1 block ids"):
        Connector(DropKeys(pool.backend)).load(_keys(2), [0])
