"""Large batches: an engine moves a long prompt's blocks in one call."""

from __future__ import annotations

from kvmux.testing.harness import Harness
from kvmux.testing.kv import TINY_LAYOUT
from kvmux.testing.suite.base import SuiteBase

LARGE = 1024


class BatchTests(SuiteBase):
    def test_a_batch_of_1024_small_blocks_round_trips(self, harness: Harness) -> None:
        pair = harness.pair(TINY_LAYOUT, num_blocks=2 * LARGE)
        keys = harness.keys(LARGE)
        src = list(range(LARGE))
        dst = list(range(2 * LARGE - 1, LARGE - 1, -1))  # reversed: no contiguous runs
        expected = pair.save_all(keys, src)
        assert pair.lookup(keys) == LARGE
        pair.load_and_verify(keys, dst, expected)
