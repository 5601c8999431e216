"""Saved blocks come back byte for byte, into exactly the blocks asked for."""

from __future__ import annotations

import pytest

from kvmux.testing.harness import Harness
from kvmux.testing.kv import LAYOUTS, LayoutCase, assert_blocks_equal
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase


class RoundTripTests(SuiteBase):
    @pytest.mark.parametrize("case", LAYOUTS, ids=lambda case: case.id)
    def test_round_trip_is_byte_exact(self, harness: Harness, case: LayoutCase) -> None:
        pair = harness.pair(case)
        keys = harness.keys(6)
        # Out of order and partly consecutive, so backends that batch runs of
        # blocks are checked at run boundaries too.
        src, dst = [3, 1, 4, 5, 9, 2], [15, 14, 10, 11, 12, 7]
        expected = pair.save_all(keys, src)
        assert pair.lookup(keys) == len(keys)
        pair.load_and_verify(keys, dst, expected)

    def test_load_writes_only_the_blocks_asked_for(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, [0, 1, 2, 3])
        dst = [8, 9, 11, 12]
        others = [b for b in range(pair.dst.num_blocks) if b not in dst]
        before = pair.dst.blocks(others)
        pair.load_and_verify(keys, dst, expected)
        assert_blocks_equal(
            pair.dst.blocks(others),
            before,
            [f"block {b}" for b in others],
            "blocks outside the load must be left untouched",
        )

    @requires("not borrows_blocks")  # lent blocks are the engine's to keep (LendingTests)
    def test_source_blocks_may_be_overwritten_once_save_completes(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        src = [0, 1, 2, 3]
        expected = pair.save_all(keys, src)
        pair.src.fill_random(src)  # the engine reuses the blocks for other tokens
        pair.load_and_verify(keys, [10, 11, 12, 13], expected)

    def test_saving_a_key_again_keeps_it_loadable(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(3)
        expected = pair.save_all(keys, [0, 1, 2])
        pair.save_all(keys, [0, 1, 2])  # same keys, same content: a repeated prefill
        assert pair.lookup(keys) == len(keys)
        pair.load_and_verify(keys, [5, 6, 7], expected)

    def test_keys_can_be_saved_again_after_release(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(3)
        pair.save_all(keys, [0, 1, 2])
        pair.saver.release(keys)
        expected = pair.save_all(keys, [0, 1, 2])
        pair.load_and_verify(keys, [5, 6, 7], expected)

    def test_release_of_unknown_keys_is_harmless(self, harness: Harness) -> None:
        pair = harness.pair()
        known = harness.keys(2)
        expected = pair.save_all(known, [0, 1])
        pair.saver.release(harness.keys(3))
        pair.saver.release([])
        pair.load_and_verify(known, [4, 5], expected)

    def test_empty_batches_complete_with_no_outcomes(self, harness: Harness) -> None:
        pair = harness.pair()
        for result in (pair.save([], []), pair.load([], [])):
            assert result.outcomes == ()
            assert result.ok

    def test_handle_completes_through_poll_and_wait(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        handle = pair.saver.save(keys, [0, 1])
        assert isinstance(handle.poll(), bool)
        if pair.saver.capabilities.borrows_blocks:  # it ends once the blocks are back
            assert handle.saved(pair.bound_s).ok
            pair.saver.release(keys)
        assert handle.wait(pair.bound_s), "save did not finish within the connector's timeout"
        assert handle.poll()
        result = handle.result(timeout=0)
        assert result.ok, result
        assert handle.keys == tuple(keys)
