"""Timeouts and per-key failure reporting, with faults injected around the real backend.

The fault wrappers (:mod:`kvmux.testing.faults`) sit between the test and
the backend under test, so these tests check that the *combination* keeps
the contract: every key ends ok, missing or failed; blocks that arrive are
exact; nothing hangs past the deadline; and the backend is unharmed after.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvmux.connector import Connector
from kvmux.errors import KvmuxError
from kvmux.handle import Status
from kvmux.testing.faults import Delay, Die, DropKeys, FailMidBatch
from kvmux.testing.harness import Harness, finish
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

ANY_STATUS = frozenset(Status)


class FaultToleranceTests(SuiteBase):
    def test_dropped_keys_end_missing_while_the_rest_load(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(8)
        expected = pair.save_all(keys, range(8))
        dropped = [1, 4, 5]
        lossy = harness.track(
            Connector(DropKeys(pair.loader.backend, keys=[keys[i] for i in dropped]))
        )
        result = pair.through(lossy).load_and_verify(
            keys, range(8, 16), expected, allow=frozenset({Status.OK, Status.MISSING})
        )
        assert result.by_status(Status.MISSING) == [keys[i] for i in dropped]
        # The backend itself never lost them.
        again = [i + 8 for i in dropped]
        pair.load_and_verify([keys[i] for i in dropped], again, expected[dropped])

    def test_slow_transfers_finish_late_but_within_the_deadline(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        slow = harness.track(Connector(Delay(pair.loader.backend, 0.3)))
        start = time.monotonic()
        handle = slow.load(keys, [8, 9, 10, 11], pair.source)
        assert not handle.poll(), "a delayed load cannot be done at once"
        result = finish(handle, pair.bound_s, "delayed load")
        assert time.monotonic() - start >= 0.3
        assert result.ok, result
        assert pair.dst.blocks([8, 9, 10, 11]).equal(expected)

    def test_a_batch_broken_midway_keeps_its_first_blocks(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(8)
        expected = pair.save_all(keys, range(8))
        flaky = harness.track(Connector(FailMidBatch(pair.loader.backend, after=3, ops=("load",))))
        result = pair.through(flaky).load_and_verify(keys, range(8, 16), expected, ANY_STATUS)
        statuses = [o.status for o in result.outcomes]
        assert statuses == [Status.OK] * 3 + [Status.FAILED] * 5
        assert all(o.reason for o in result.outcomes[3:]), "a failed key must say why"
        # What never reached the backend can still be loaded from it.
        pair.load_and_verify(keys[3:], range(11, 16), expected[3:])

    def test_a_hung_backend_fails_every_key_at_its_deadline(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        die = Die(pair.loader.backend, mode="hang", deadline_s=0.3)
        hung = harness.track(Connector(die))
        start = time.monotonic()
        result = pair.through(hung).load_and_verify(keys, range(8, 12), expected, ANY_STATUS)
        assert time.monotonic() - start >= 0.3
        assert [o.status for o in result.outcomes] == [Status.FAILED] * 4
        assert not hung.health().healthy
        die.revive()
        pair.through(hung).load_and_verify(keys, range(8, 12), expected)

    @requires("p2p")
    def test_loading_from_a_closed_peer_fails_per_key_without_hanging(
        self, harness: Harness
    ) -> None:
        pair = harness.pair()
        keys = harness.keys(4)
        expected = pair.save_all(keys, range(4))
        pair.saver.close()
        with ThreadPoolExecutor(1) as pool:  # a hung lookup must fail the test, not stall it
            future = pool.submit(pair.lookup, keys)
            try:
                found = future.result(timeout=pair.bound_s)
            except KvmuxError:
                found = 0  # raising a kvmux error is an honest answer too
            except TimeoutError:
                pytest.fail(f"lookup at a closed peer hung for {pair.bound_s:.0f} s")
        assert 0 <= found <= len(keys)
        pair.load_and_verify(keys, range(8, 12), expected, ANY_STATUS)
