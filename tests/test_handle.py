"""Handles report every key, never raise for a failed transfer, never hang silently."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from kvmux.errors import TransferTimeout
from kvmux.handle import MISSING, OK, Handle, Outcome, Status, TransferResult

from support import keys


def test_exception_in_work_becomes_failed_outcome_per_key() -> None:
    ks = keys(3)

    def work() -> list[Outcome]:
        raise OSError("disk on fire")

    handle = Handle.from_call(ks, _inline, work, block_nbytes=1)
    result = handle.result()
    assert [o.status for o in result.outcomes] == [Status.FAILED] * 3
    assert all("disk on fire" in (o.reason or "") for o in result.outcomes)


def test_wrong_number_of_outcomes_is_reported_as_failure() -> None:
    ks = keys(3)
    handle = Handle.from_call(ks, _inline, lambda: [OK], block_nbytes=1)
    assert not handle.result().ok
    assert handle.result().by_status(Status.FAILED) == ks


def test_result_timeout_raises_and_poll_does_not_block() -> None:
    from concurrent.futures import ThreadPoolExecutor

    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        handle = Handle.from_call(
            keys(1), pool.submit, lambda: (gate.wait(5), [OK])[1], block_nbytes=1
        )
        assert handle.poll() is False
        assert handle.wait(0.05) is False
        with pytest.raises(TransferTimeout):
            handle.result(0.05)
        gate.set()
        assert handle.wait(5) and handle.result().ok


def test_result_lists_keys_by_status() -> None:
    ks = keys(3)
    result = Handle.completed(ks, [OK, MISSING, OK], nbytes=10).result()
    assert result.by_status(Status.MISSING) == [ks[1]]
    assert result.not_ok == [(ks[1], MISSING)]


def test_a_result_is_ok_when_every_outcome_is_whatever_object_says_so() -> None:
    ks = keys(3)
    assert Handle.completed(ks, [OK] * 3).result().ok
    copies = [Outcome(Status.OK) for _ in ks]  # equal to OK, not the shared instance
    assert Handle.completed(ks, copies).result().ok
    assert Handle.completed(ks, [OK, Outcome(Status.OK, "from a second tier"), OK]).result().ok
    assert not Handle.completed(ks, [OK, OK, MISSING]).result().ok
    assert not Handle.completed(ks, [*copies[:2], Outcome(Status.FAILED, "x")]).result().ok
    assert Handle.completed([], []).result().ok  # nothing asked, nothing failed


def _inline(fn):
    fut: Future[object] = Future()
    fut.set_result(fn())
    return fut


def test_transfer_cancelled_by_close_reports_failed_keys() -> None:
    ks = keys(2)
    fut: Future[object] = Future()
    handle = Handle(tuple(ks), fut)
    seen = []
    handle.add_done_callback(seen.append)
    fut.cancel()
    assert handle.wait(0) is True
    result = handle.result()
    assert result.by_status(Status.FAILED) == ks
    assert "cancelled" in (result.outcomes[0].reason or "")
    assert seen == [result]


def test_cancel_drops_a_queued_transfer_but_not_a_running_one() -> None:
    from kvmux.lanes import Lanes

    lanes = Lanes("test-cancel")
    release, ran = threading.Event(), []

    def work(i: int) -> list[Outcome]:
        ran.append(i)
        release.wait(5)
        return [OK]

    try:
        first = Handle.from_call(keys(1), lambda fn: lanes.submit("p", fn, 1), lambda: work(0), 1)
        queued = Handle.from_call(keys(1), lambda fn: lanes.submit("p", fn, 1), lambda: work(1), 1)
        while not ran:
            release.wait(0.001)
        assert queued.cancel() and not first.cancel()
        release.set()
        assert first.result(timeout=5).ok
        outcome = queued.result(timeout=5).outcomes[0]
        assert outcome.status is Status.FAILED and "cancelled" in (outcome.reason or "")
        assert ran == [0]
    finally:
        release.set()
        lanes.shutdown()


def test_a_finished_handle_answers_at_once_and_cannot_be_cancelled() -> None:
    """A transfer run in the caller's thread is born finished, with no future."""
    ks = keys(2)
    handle = Handle.completed(ks, [OK, MISSING], nbytes=4)
    assert handle.poll() is True and handle.wait(0) is True
    assert handle.cancel() is False
    seen = []
    handle.add_done_callback(seen.append)
    assert seen == [handle.result()]

    def broken(_: object) -> None:
        raise RuntimeError("callback bug")

    handle.add_done_callback(broken)  # logged, as a future does, not raised
    assert handle.result().by_status(Status.MISSING) == [ks[1]]


def test_a_lent_save_knows_its_outcome_before_it_ends() -> None:
    ks = keys(2)
    returned: Future[None] = Future()
    handle = Handle.lent(TransferResult(tuple(ks), (OK, MISSING)), returned)
    assert handle.saved(0).outcomes == (OK, MISSING)
    assert not handle.poll() and not handle.wait(0.01)
    assert not handle.cancel(), "a lent block cannot be taken back by cancel()"
    returned.set_result(None)
    assert handle.wait(1) and handle.result(0).outcomes == (OK, MISSING)


def test_a_lending_save_on_a_lane_ends_once_its_blocks_are_back() -> None:
    ks = keys(1)
    returned: Future[None] = Future()
    save = Handle.from_call(ks, _inline, lambda: [OK], block_nbytes=1)
    handle = Handle.lending(save, lambda: returned)
    assert handle.saved(1).ok
    assert not handle.poll()
    returned.set_result(None)
    assert handle.wait(1) and handle.result(0).ok
