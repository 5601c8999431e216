"""Calls that contradict themselves are refused with the documented kvmux errors."""

from __future__ import annotations

from typing import Any

import pytest

from kvmux.errors import InvalidRequestError, LayoutError, NotRegisteredError
from kvmux.testing.harness import Harness, Pair
from kvmux.testing.kv import LAYOUTS
from kvmux.testing.suite.base import SuiteBase


def _both_refused(pair: Pair, error: type[Exception], keys: Any, block_ids: Any) -> None:
    with pytest.raises(error):
        pair.saver.save(keys, block_ids)
    with pytest.raises(error):
        pair.loader.load(keys, block_ids, pair.source)


class BadInputTests(SuiteBase):
    def test_keys_and_block_ids_of_different_lengths_are_refused(self, harness: Harness) -> None:
        pair = harness.pair()
        _both_refused(pair, InvalidRequestError, harness.keys(3), [0, 1])
        _both_refused(pair, InvalidRequestError, harness.keys(1), [0, 1])

    def test_block_ids_out_of_range_are_refused(self, harness: Harness) -> None:
        pair = harness.pair(num_blocks=16)
        _both_refused(pair, InvalidRequestError, harness.keys(2), [0, 16])
        _both_refused(pair, InvalidRequestError, harness.keys(1), [-1])

    def test_duplicate_keys_in_one_call_are_refused(self, harness: Harness) -> None:
        pair = harness.pair()
        key = harness.keys(1)[0]
        _both_refused(pair, InvalidRequestError, [key, key], [0, 1])

    def test_duplicate_block_ids_in_one_call_are_refused(self, harness: Harness) -> None:
        pair = harness.pair()
        _both_refused(pair, InvalidRequestError, harness.keys(2), [3, 3])

    def test_one_bad_block_id_in_a_big_batch_is_refused(self, harness: Harness) -> None:
        """A batch of many blocks is checked as a whole, not id by id: one id out of
        range, or listed twice, still refuses all of it."""
        pair = harness.pair(num_blocks=64)
        keys, ids = harness.keys(32), list(range(32))
        for last in (64, -1, 0):
            _both_refused(pair, InvalidRequestError, keys, [*ids[:-1], last])

    def test_keys_that_are_not_block_keys_are_refused(self, harness: Harness) -> None:
        pair = harness.pair()
        raw: Any = [b"\x01" * 32]
        with pytest.raises(InvalidRequestError):
            pair.lookup(raw)
        _both_refused(pair, InvalidRequestError, raw, [0])

    def test_transfers_before_register_are_refused(self, harness: Harness) -> None:
        conn = harness.open()
        with pytest.raises(NotRegisteredError):
            conn.save(harness.keys(1), [0])
        with pytest.raises(NotRegisteredError):
            conn.load(harness.keys(1), [0])

    def test_caches_that_do_not_match_the_layout_are_refused(self, harness: Harness) -> None:
        conn = harness.open()
        good = harness.memory(LAYOUTS[0])
        other_dtype = harness.memory(LAYOUTS[1])  # same shapes, bfloat16 instead of float16
        fewer_blocks = harness.memory(LAYOUTS[0], num_blocks=good.num_blocks - 1)
        renamed = {f"x.{name}": t for name, t in good.caches.items()}
        one_layer_short = dict(list(good.caches.items())[:-1])
        for caches in (other_dtype.caches, fewer_blocks.caches, renamed, one_layer_short):
            with pytest.raises(LayoutError):
                conn.register(good.layout, caches)
        # A refused register leaves the connector usable.
        conn.register(good.layout, good.caches)
        keys = harness.keys(2)
        assert conn.save(keys, [0, 1]).saved(conn.config.timeout_s + 5).ok
