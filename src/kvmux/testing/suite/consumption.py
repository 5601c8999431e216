"""Whether a load leaves the block in place or takes it: each as the backend declares."""

from __future__ import annotations

from kvmux.handle import Status
from kvmux.testing.harness import Harness
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase


class ConsumptionTests(SuiteBase):
    @requires("not consumes_on_load")
    def test_a_block_can_be_loaded_twice(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(3)
        expected = pair.save_all(keys, [0, 1, 2])
        pair.load_and_verify(keys, [5, 6, 7], expected)
        assert pair.lookup(keys) == 3
        pair.load_and_verify(keys, [9, 10, 11], expected)

    @requires("consumes_on_load")
    def test_a_load_takes_the_block_away(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(3)
        expected = pair.save_all(keys, [0, 1, 2])
        pair.load_and_verify(keys, [5, 6, 7], expected)
        assert pair.lookup(keys) == 0
        again = pair.load_and_verify(keys, [9, 10, 11], expected, allow=frozenset({Status.MISSING}))
        assert len(again.by_status(Status.MISSING)) == 3
