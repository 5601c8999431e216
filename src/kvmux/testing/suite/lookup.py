"""``lookup``: how many *leading* keys can be loaded, with no side effects."""

from __future__ import annotations

from kvmux.testing.harness import Harness
from kvmux.testing.suite.base import SuiteBase


class LookupTests(SuiteBase):
    def test_lookup_counts_every_saved_key(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(5)
        pair.save_all(keys, range(5))
        assert pair.lookup(keys) == 5

    def test_lookup_of_an_empty_list_is_zero(self, harness: Harness) -> None:
        pair = harness.pair()
        pair.save_all(harness.keys(2), [0, 1])
        assert pair.lookup([]) == 0

    def test_lookup_of_unknown_keys_is_zero(self, harness: Harness) -> None:
        pair = harness.pair()
        pair.save_all(harness.keys(2), [0, 1])
        assert pair.lookup(harness.keys(4)) == 0

    def test_lookup_stops_at_the_first_gap(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(8)
        pair.save_all(keys[0:3] + keys[5:8], [0, 1, 2, 5, 6, 7])
        assert pair.lookup(keys) == 3, "keys after a missing one must not be counted"

    def test_lookup_is_zero_when_the_first_key_is_missing(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(5)
        pair.save_all(keys[1:], [1, 2, 3, 4])
        assert pair.lookup(keys) == 0
        assert pair.lookup(keys[1:]) == 4

    def test_lookup_counts_only_the_keys_asked_for(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        pair.save_all(keys, range(4))
        for n in range(1, 5):
            assert pair.lookup(keys[:n]) == n
        assert pair.lookup(keys + harness.keys(3)) == 4
        assert pair.lookup(keys[2:]) == 2

    def test_lookup_has_no_side_effects(self, harness: Harness) -> None:
        pair = harness.pair()
        keys, unknown = harness.keys(4), harness.keys(2)
        expected = pair.save_all(keys, range(4))
        for _ in range(5):
            assert pair.lookup(keys) == 4
            assert pair.lookup(unknown) == 0
        # Repeated lookups neither consumed, evicted nor invented anything.
        pair.load_and_verify(keys, [8, 9, 10, 11], expected)
        assert pair.lookup(unknown) == 0

    def test_lookup_needs_no_registered_memory(self, harness: Harness) -> None:
        """A scheduler asks before (or without ever) registering KV memory."""
        pair = harness.pair()
        keys = harness.keys(3)
        pair.save_all(keys, range(3))
        scheduler = harness.open()
        if harness.capabilities.p2p:
            assert scheduler.lookup(keys, pair.source) == 3
        else:
            # A second local instance may or may not share the first one's store.
            assert scheduler.lookup(keys) in (0, 3)
            assert scheduler.lookup(harness.keys(2)) == 0
