"""Lending: a backend that borrows the engine's blocks gives each one back, and says when.

A save to such a backend (``Capabilities.borrows_blocks``: ``save_mode:
borrow``) copies nothing: peers read the engine's blocks themselves, so the
engine must leave them alone until the save's handle ends. The handle's
outcome is known at once (``Handle.saved``); the handle itself ends when the
blocks come back, and it must come back on every path: the keys released,
the publication over, the block saved again under a new key, the backend
closed. A handle that never ends is a block the engine can never reuse.
"""

from __future__ import annotations

from kvmux.handle import Handle
from kvmux.keys import BlockKey
from kvmux.publications import new_lease_id
from kvmux.testing.harness import Harness, Pair, summary
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

SHORT_LEASE_S = 0.5


def _lend(pair: Pair, keys: list[BlockKey], blocks: list[int]) -> Handle:
    """Save ``keys`` from ``blocks``, requiring every key ok; the still-open handle."""
    handle = pair.saver.save(keys, blocks)
    result = handle.saved(pair.bound_s)
    assert result.ok, summary(result)
    return handle


class LendingTests(SuiteBase):
    """Each test carries the mark itself: one on the class would be inherited by
    ``ConnectorSuite`` and skip all of it."""

    @requires("borrows_blocks")
    def test_a_lent_save_ends_once_its_keys_are_released(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(3)
        handle = _lend(pair, keys, [0, 1, 2])
        assert not handle.wait(0.2), "a lent save ended while its keys still name the blocks"
        pair.saver.release(keys[:2])
        assert not handle.wait(0.2), "a lent save ended with one of its blocks still lent"
        pair.saver.release(keys[2:])
        assert handle.wait(pair.bound_s), "releasing every key did not give the blocks back"
        assert handle.result(0).ok
        assert pair.lookup(keys) == 0

    @requires("borrows_blocks")
    def test_a_lent_block_is_read_where_the_engine_keeps_it(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        pair.save_all(keys, [4, 5])
        pair.src.fill_random([4, 5])  # what the engine must not do while they are lent
        expected = pair.src.blocks([4, 5])
        pair.load_and_verify(keys, [0, 1], expected)

    @requires("borrows_blocks")
    def test_saving_a_block_under_a_new_key_gives_the_old_key_up(self, harness: Harness) -> None:
        pair = harness.pair()
        old, new = harness.keys(1), harness.keys(1)
        first = _lend(pair, old, [3])
        pair.src.fill_random([3])  # the engine reused the block for other tokens...
        expected = pair.save_all(new, [3])  # ...and saved it again
        assert first.wait(pair.bound_s), "the block's first save never ended"
        assert pair.lookup(old) == 0, "a key still names a block overwritten since"
        pair.load_and_verify(new, [9], expected)

    @requires("borrows_blocks")
    def test_a_publication_gives_its_blocks_back_when_it_ends(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        handle = _lend(pair, keys, [6, 7])
        lease = new_lease_id()
        pair.saver.publish(keys, lease, 60.0)
        pair.saver.unpublish([lease])
        assert handle.wait(pair.bound_s), "ending the publication did not give the blocks back"

    @requires("borrows_blocks")
    def test_an_expired_publication_gives_its_blocks_back(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        handle = _lend(pair, keys, [8, 9])
        pair.saver.publish(keys, new_lease_id(), SHORT_LEASE_S)
        assert not handle.wait(SHORT_LEASE_S / 2), "blocks came back before the lease ended"
        # Nobody touches the backend meanwhile: expiry must not wait for a caller.
        assert handle.wait(SHORT_LEASE_S + pair.bound_s), "the lease expired, the blocks stayed"

    @requires("borrows_blocks")
    def test_closing_gives_every_lent_block_back(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(2)
        handle = _lend(pair, keys, [10, 11])
        pair.saver.close()
        assert handle.wait(pair.bound_s), "a closed backend still holds the engine's blocks"
        assert not handle.cancel()
