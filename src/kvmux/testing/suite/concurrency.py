"""Several engine threads using one connector at once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvmux.testing.harness import Harness, Pair
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

THREADS = 4
PER_THREAD = 8


def _in_threads(pair: Pair, work: Callable[[int], None]) -> None:
    """Run ``work(i)`` for each thread index at once; re-raise the first failure."""
    barrier = threading.Barrier(THREADS, timeout=pair.bound_s)

    def start(i: int) -> None:
        barrier.wait()
        work(i)

    with ThreadPoolExecutor(THREADS) as pool:
        futures = [pool.submit(start, i) for i in range(THREADS)]
        for future in futures:
            future.result(timeout=4 * pair.bound_s)


class ConcurrencyTests(SuiteBase):
    def test_concurrent_saves_and_loads_from_several_threads(self, harness: Harness) -> None:
        pair = harness.pair(num_blocks=2 * THREADS * PER_THREAD)
        keys = [harness.keys(PER_THREAD) for _ in range(THREADS)]

        def work(i: int) -> None:
            src = range(i * PER_THREAD, (i + 1) * PER_THREAD)
            dst = [b + THREADS * PER_THREAD for b in src]
            expected = pair.save_all(keys[i], src)
            assert pair.lookup(keys[i]) == PER_THREAD
            pair.load_and_verify(keys[i], dst, expected)

        _in_threads(pair, work)

    @requires("not consumes_on_load")
    def test_concurrent_loads_of_the_same_keys(self, harness: Harness) -> None:
        pair = harness.pair(num_blocks=(THREADS + 1) * PER_THREAD)
        keys = harness.keys(PER_THREAD)
        expected = pair.save_all(keys, range(PER_THREAD))

        def work(i: int) -> None:
            dst = range((i + 1) * PER_THREAD, (i + 2) * PER_THREAD)
            pair.load_and_verify(keys, dst, expected)

        _in_threads(pair, work)
