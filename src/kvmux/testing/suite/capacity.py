"""Capacity-bound backends: saving past capacity evicts, never fails, never lies.

Capacity comes from the ``capacity_bytes`` config field (the suite sets it
small through the factory). Stored size is read from ``stats()`` when the
backend reports ``bytes_stored`` or ``blocks_stored``.
"""

from __future__ import annotations

import pytest
import torch

from kvmux.connector import Connector
from kvmux.errors import ConfigError
from kvmux.handle import Status
from kvmux.keys import BlockKey
from kvmux.testing.harness import Harness, Pair
from kvmux.testing.kv import DEFAULT_LAYOUT
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

CAPACITY_BLOCKS = 8
SAVED_BLOCKS = 4 * CAPACITY_BLOCKS
OK_OR_MISSING = frozenset({Status.OK, Status.MISSING})


def _small_pair(harness: Harness) -> tuple[Pair, int]:
    capacity = CAPACITY_BLOCKS * DEFAULT_LAYOUT.block_nbytes
    try:
        pair = harness.pair(
            DEFAULT_LAYOUT, num_blocks=SAVED_BLOCKS + CAPACITY_BLOCKS, capacity_bytes=capacity
        )
    except (TypeError, ConfigError) as exc:
        if "capacity_bytes" not in str(exc):
            raise
        pytest.skip(f"requires config field 'capacity_bytes' (the factory refused it: {exc})")
    return pair, capacity


def _stored_bytes(conn: Connector, block_nbytes: int) -> float | None:
    stats = conn.stats()
    if "bytes_stored" in stats:
        return stats["bytes_stored"]
    if "blocks_stored" in stats:
        return stats["blocks_stored"] * block_nbytes
    return None


def _check_everything_loaded_is_right(
    pair: Pair, keys: list[BlockKey], expected: torch.Tensor
) -> None:
    """Load every key in capacity-sized batches: ok means exact bytes, missing means
    untouched, nothing fails; what lookup promised loads, and the newest key is kept."""
    promised = pair.lookup(keys)
    assert pair.lookup(keys[-1:]) == 1, "eviction must drop older blocks, not the newest one"
    dst = list(range(SAVED_BLOCKS, SAVED_BLOCKS + CAPACITY_BLOCKS))
    statuses: list[Status] = []
    for start in range(0, len(keys), CAPACITY_BLOCKS):
        batch = slice(start, start + CAPACITY_BLOCKS)
        result = pair.load_and_verify(keys[batch], dst, expected[batch], allow=OK_OR_MISSING)
        statuses += [o.status for o in result.outcomes]
    assert all(s is Status.OK for s in statuses[:promised]), (
        f"lookup promised the first {promised} keys, but some did not load"
    )
    assert statuses[-1] is Status.OK


class CapacityTests(SuiteBase):
    @requires("capacity_bound")
    def test_saving_past_capacity_never_fails_nor_loads_wrong_bytes(self, harness: Harness) -> None:
        pair, _ = _small_pair(harness)
        keys = harness.keys(SAVED_BLOCKS)
        parts = []
        for start in range(0, SAVED_BLOCKS, CAPACITY_BLOCKS // 2):
            batch = slice(start, start + CAPACITY_BLOCKS // 2)
            parts.append(pair.save_all(keys[batch], range(SAVED_BLOCKS)[batch]))
        _check_everything_loaded_is_right(pair, keys, torch.cat(parts))

    @requires("capacity_bound")
    def test_one_batch_larger_than_capacity_saves_without_failing(self, harness: Harness) -> None:
        pair, _ = _small_pair(harness)
        keys = harness.keys(SAVED_BLOCKS)
        expected = pair.save_all(keys, range(SAVED_BLOCKS))
        _check_everything_loaded_is_right(pair, keys, expected)

    @requires("capacity_bound")
    def test_stored_bytes_never_exceed_capacity(self, harness: Harness) -> None:
        pair, capacity = _small_pair(harness)
        block_nbytes = DEFAULT_LAYOUT.block_nbytes
        if _stored_bytes(pair.saver, block_nbytes) is None:
            pytest.skip("the backend reports neither 'bytes_stored' nor 'blocks_stored' in stats()")
        keys = harness.keys(SAVED_BLOCKS)
        for start in range(0, SAVED_BLOCKS, 3):
            batch = slice(start, start + 3)
            pair.save_all(keys[batch], range(SAVED_BLOCKS)[batch])
            stored = _stored_bytes(pair.saver, block_nbytes)
            assert stored is not None
            assert stored <= capacity, f"{stored} bytes stored, capacity is {capacity}"
        assert (_stored_bytes(pair.saver, block_nbytes) or 0) > 0, "nothing stored at all"
