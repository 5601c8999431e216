"""``bounded_call``: a blocking call waited for no longer than its deadline."""

from __future__ import annotations

import threading
import time

import pytest

from kvmux.bounded import Outstanding, bounded_call
from kvmux.errors import TransferTimeout


def test_a_call_that_returns_gives_its_result() -> None:
    assert bounded_call(lambda: 41 + 1, 5.0, "adding") == 42


def test_a_call_that_raises_raises_its_own_exception() -> None:
    def broken() -> int:
        raise ValueError("no store here")

    with pytest.raises(ValueError, match="no store here"):
        bounded_call(broken, 5.0, "reading")


def test_a_call_that_blocks_past_the_deadline_is_a_timeout_at_the_deadline() -> None:
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"reading a block took over 0\.3 s"):
            bounded_call(lambda: release.wait(30), 0.3, "reading a block")
        assert 0.3 <= time.monotonic() - started < 1.5
    finally:
        release.set()  # the abandoned call ends with the test


def test_a_call_that_times_out_by_itself_keeps_its_own_message() -> None:
    def gives_up() -> None:
        raise TransferTimeout("the master did not answer")

    with pytest.raises(TransferTimeout, match="the master did not answer"):
        bounded_call(gives_up, 5.0, "reading")


def test_outstanding_counts_an_abandoned_call_until_it_ends() -> None:
    calls = Outstanding()
    release = threading.Event()
    tracked = calls.track(lambda: release.wait(10))
    assert calls.running == 1, "counted from track(), before the call even starts"
    with pytest.raises(TransferTimeout):
        bounded_call(tracked, 0.2, "a call that blocks")
    assert calls.running == 1 and not calls.wait_idle(0.1), "abandoned, yet still running"
    release.set()
    assert calls.wait_idle(5.0) and calls.running == 0


def test_outstanding_counts_a_call_that_raises_as_ended() -> None:
    calls = Outstanding()

    def broken() -> None:
        raise ValueError("gone")

    with pytest.raises(ValueError):
        bounded_call(calls.track(broken), 5.0, "a call that fails")
    assert calls.wait_idle(0.0)
