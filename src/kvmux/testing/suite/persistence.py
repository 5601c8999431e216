"""Persistent backends: blocks outlive the instance that saved them."""

from __future__ import annotations

from kvmux.testing.harness import Harness
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase


class PersistenceTests(SuiteBase):
    @requires("persistent")
    def test_blocks_survive_close_and_reopen(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(5)
        expected = pair.save_all(keys, [0, 2, 4, 6, 8])
        pair.loader.close()
        pair.saver.close()
        reopened = harness.pair(saver=harness.open())
        assert reopened.lookup(keys) == len(keys)
        reopened.load_and_verify(keys, [9, 10, 11, 12, 13], expected)

    @requires("persistent")
    def test_a_reopened_store_keeps_old_and_accepts_new_blocks(self, harness: Harness) -> None:
        pair = harness.pair()
        old = harness.keys(2)
        expected_old = pair.save_all(old, [0, 1])
        pair.loader.close()
        pair.saver.close()
        reopened = harness.pair(saver=harness.open())
        new = harness.keys(2)
        expected_new = reopened.save_all(new, [2, 3])
        reopened.load_and_verify(new, [10, 11], expected_new)
        reopened.load_and_verify(old, [12, 13], expected_old)
