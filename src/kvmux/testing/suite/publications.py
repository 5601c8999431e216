"""Publications: a bounded P2P producer keeps published blocks until the consumer is done.

A P/D prefill publishes a request's blocks and a decode instance pulls them
later. Meanwhile newer saves must not evict them (``publish``); the consumer
ends the hold when it is done (``unpublish``) and, while it is slow, extends
it by heartbeat (``renew``); nobody renewing ends it after ``lease_s``.
See :mod:`kvmux.publications`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvmux.errors import ConfigError
from kvmux.keys import BlockKey
from kvmux.publications import new_lease_id
from kvmux.testing.harness import Harness, Pair
from kvmux.testing.kv import DEFAULT_LAYOUT
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

CAPACITY_BLOCKS = 8
PUBLISHED = 3
SHORT_LEASE_S = 1.0


def _bounded_pair(harness: Harness) -> Pair:
    try:
        return harness.pair(
            DEFAULT_LAYOUT,
            num_blocks=CAPACITY_BLOCKS + PUBLISHED,
            capacity_bytes=CAPACITY_BLOCKS * DEFAULT_LAYOUT.block_nbytes,
        )
    except (TypeError, ConfigError) as exc:
        if "capacity_bytes" not in str(exc):
            raise
        pytest.skip(f"requires config field 'capacity_bytes' (the factory refused it: {exc})")


def _flood(harness: Harness, pair: Pair) -> None:
    """Save twice the pool's capacity of new blocks: whatever is not held is evicted."""
    for _ in range(2):
        result = pair.saver.save(harness.keys(CAPACITY_BLOCKS), range(CAPACITY_BLOCKS)).result(
            timeout=pair.bound_s
        )
        assert result.keys, "save of the flood returned no result"


def _eventually(condition: Callable[[], bool], within_s: float, what: str) -> None:
    until = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < until, f"{what} within {within_s:.1f} s"
        time.sleep(0.05)


def _held(pair: Pair, keys: list[BlockKey]) -> bool:
    return pair.lookup(keys) == len(keys)


class PublicationTests(SuiteBase):
    @requires("p2p", "capacity_bound")
    def test_published_blocks_outlive_eviction_until_the_consumer_releases_them(
        self, harness: Harness
    ) -> None:
        pair = _bounded_pair(harness)
        keys = harness.keys(PUBLISHED)
        blocks = list(range(CAPACITY_BLOCKS, CAPACITY_BLOCKS + PUBLISHED))
        expected = pair.save_all(keys, blocks)
        lease = new_lease_id()
        pair.saver.publish(keys, lease, lease_s=60.0)
        _flood(harness, pair)
        assert _held(pair, keys), "newer saves evicted blocks published for a consumer"
        pair.load_and_verify(keys, blocks, expected)
        pair.loader.unpublish([lease], pair.source)

        def evicted_after_release() -> bool:
            _flood(harness, pair)
            return pair.lookup(keys) < PUBLISHED

        _eventually(evicted_after_release, pair.bound_s, "a released publication was still held")

    @requires("p2p", "capacity_bound")
    def test_a_renewed_publication_stays_and_an_abandoned_one_ends_at_its_lease(
        self, harness: Harness
    ) -> None:
        pair = _bounded_pair(harness)
        kept, dropped = harness.keys(1), harness.keys(1)
        pair.save_all(kept + dropped, [CAPACITY_BLOCKS, CAPACITY_BLOCKS + 1])
        kept_lease, dropped_lease = new_lease_id(), new_lease_id()
        pair.saver.publish(kept, kept_lease, lease_s=SHORT_LEASE_S)
        pair.saver.publish(dropped, dropped_lease, lease_s=SHORT_LEASE_S)
        until = time.monotonic() + 3 * SHORT_LEASE_S
        while time.monotonic() < until:  # a consumer alive but slow: it heartbeats
            pair.loader.renew([kept_lease], pair.source)
            time.sleep(SHORT_LEASE_S / 4)
        _flood(harness, pair)
        assert _held(pair, kept), "a publication renewed by heartbeat was dropped"
        assert not _held(pair, dropped), (
            f"a publication nobody renewed still held its blocks {3 * SHORT_LEASE_S:.0f} s "
            f"after its {SHORT_LEASE_S} s lease"
        )
        pair.loader.unpublish([kept_lease], pair.source)
