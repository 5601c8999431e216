"""Keys the backend does not have: reported per key, blocks untouched, others unharmed."""

from __future__ import annotations

import time

from kvmux.handle import Status
from kvmux.testing.harness import Harness
from kvmux.testing.suite.base import SuiteBase

MISSING_ONLY = frozenset({Status.MISSING})
OK_OR_MISSING = frozenset({Status.OK, Status.MISSING})


class MissingKeyTests(SuiteBase):
    def test_load_of_unknown_keys_reports_each_missing(self, harness: Harness) -> None:
        pair = harness.pair()
        pair.save_all(harness.keys(2), [0, 1])
        dst = [4, 5, 6]
        result = pair.load_and_verify(
            harness.keys(3), dst, pair.dst.blocks(dst), allow=MISSING_ONLY
        )
        assert [o.status for o in result.outcomes] == [Status.MISSING] * 3

    def test_partial_load_reports_each_key(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(5)
        saved = pair.save_all([keys[0], keys[2], keys[3]], [0, 2, 3])
        dst = [8, 9, 10, 11, 12]
        expected = pair.dst.blocks(dst)
        expected[[0, 2, 3]] = saved
        result = pair.load_and_verify(keys, dst, expected, allow=OK_OR_MISSING)
        assert [o.status for o in result.outcomes] == [
            Status.OK,
            Status.MISSING,
            Status.OK,
            Status.OK,
            Status.MISSING,
        ], "a missing key must not stop or spoil the keys after it"

    def test_missing_keys_are_reported_within_the_timeout(self, harness: Harness) -> None:
        pair = harness.pair()
        start = time.monotonic()
        result = pair.load(harness.keys(4), [0, 1, 2, 3])
        elapsed = time.monotonic() - start
        assert [o.status for o in result.outcomes] == [Status.MISSING] * 4
        assert elapsed <= pair.loader.config.timeout_s, (
            f"reporting 4 missing keys took {elapsed:.1f} s, past timeout_s"
        )
