"""Work lanes: per-peer queues whose threads come and go with the work."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvmux.errors import ClosedError
from kvmux.handle import Status
from kvmux.lanes import Lanes
from kvmux.layout import KVLayout
from kvmux.registry import create_connector

from support import keys, wait_until


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    made = Lanes("test-lanes", linger_s=0.2)
    yield made
    made.shutdown()


def test_a_stuck_lane_never_holds_up_another(lanes: Lanes) -> None:
    release = threading.Event()
    stuck = [lanes.submit("hung", release.wait, width=2) for _ in range(4)]
    try:
        assert lanes.submit("healthy", lambda: 42, width=2).result(timeout=2) == 42
        assert lanes.submit(None, lambda: "local", width=2).result(timeout=2) == "local"
        assert not any(f.done() for f in stuck)
    finally:
        release.set()
    assert all(f.result(timeout=2) for f in stuck)


def test_a_lane_runs_at_most_width_jobs_at_once_in_order(lanes: Lanes) -> None:
    running, peak, order = 0, 0, []
    lock = threading.Lock()

    def job(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
            order.append(i)
        time.sleep(0.02)
        with lock:
            running -= 1
        return i

    futures = [lanes.submit("peer", lambda i=i: job(i), width=3) for i in range(12)]
    assert [f.result(timeout=5) for f in futures] == list(range(12))
    assert peak == 3
    assert order[:3] == sorted(order[:3]) and order == sorted(order)  # started in FIFO order


def test_threads_end_after_the_lane_runs_dry(lanes: Lanes) -> None:
    for f in [lanes.submit(("10.0.0.1", p), lambda: None, width=4) for p in range(5)]:
        f.result(timeout=2)
    assert lanes.threads > 0
    wait_until(lambda: lanes.threads == 0, 5.0)
    assert lanes.submit("again", lambda: 7, width=1).result(timeout=2) == 7


def test_an_exception_reaches_the_future_and_the_lane_keeps_serving(lanes: Lanes) -> None:
    def boom() -> None:
        raise ValueError("bad job")

    with pytest.raises(ValueError, match="bad job"):
        lanes.submit("peer", boom, width=1).result(timeout=2)
    assert lanes.submit("peer", lambda: 1, width=1).result(timeout=2) == 1


def test_shutdown_cancels_queued_jobs_and_refuses_new_ones() -> None:
    lanes = Lanes("test-lanes")
    release = threading.Event()
    running = lanes.submit("peer", release.wait, width=1)
    queued = lanes.submit("peer", lambda: None, width=1)
    wait_until(lambda: running.running(), 2.0)
    closer = threading.Thread(target=lanes.shutdown)
    closer.start()
    wait_until(queued.cancelled, 2.0)
    release.set()
    closer.join(timeout=5)
    assert running.result(timeout=1) is True
    with pytest.raises(ClosedError):
        lanes.submit("peer", lambda: None, width=1)


def test_a_load_queued_past_its_deadline_fails_at_once_not_late(
    layout: KVLayout, caches: dict[str, torch.Tensor]
) -> None:
    """Against a peer that never answers (a listener nobody serves), loads beyond the
    lane's width wait for the first ones; they end when their own deadline does."""
    with socket.create_server(("127.0.0.1", 0)) as mute:
        port = mute.getsockname()[1]
        conn = create_connector({"backend": "tcp", "timeout_s": 1.0, "capacity_bytes": 2**20})
        try:
            conn.register(layout, caches)
            source = {"host": "127.0.0.1", "port": port}
            started = time.monotonic()
            handles = [conn.load(keys(1), [i], source) for i in range(3 * conn.backend.lane_width)]
            results = [h.result(timeout=5) for h in handles]
            took = time.monotonic() - started
        finally:
            conn.close()
    assert took < 1.0 + 1.5, f"{len(handles)} loads took {took:.2f} s with timeout_s=1"
    assert {o.status for r in results for o in r.outcomes} == {Status.FAILED}
    queued = [r.outcomes[0].reason or "" for r in results[conn.backend.lane_width :]]
    assert all("passed while queued" in reason for reason in queued), queued[:2]


def test_a_local_load_through_a_multi_waits_for_no_hung_peer(
    layout: KVLayout, caches: dict[str, torch.Tensor]
) -> None:
    """A tiered cpu + tcp composition: while many loads wait on a peer that never
    answers, a load served by the local tier (source None) comes back at once."""
    tcp = {"backend": "tcp", "timeout_s": 1.5, "capacity_bytes": 2**20}
    config = {"backend": "multi", "policy": "fallback", "timeout_s": 1.5}
    conn = create_connector({**config, "children": [{"backend": "cpu"}, tcp]})
    try:
        conn.register(layout, caches)
        local = keys(2, "local")
        assert conn.save(local, [0, 1]).result(timeout=5).ok
        with socket.create_server(("127.0.0.1", 0)) as mute:
            hung = {"children": [None, {"host": "127.0.0.1", "port": mute.getsockname()[1]}]}
            waiting = [conn.load(keys(1, f"far{i}"), [2 + i], hung) for i in range(12)]
            started = time.monotonic()
            result = conn.load(local, [20, 21]).result(timeout=5)
            took = time.monotonic() - started
            assert result.ok and took < 0.5, f"a local load took {took:.2f} s"
            assert not all(w.poll() for w in waiting)
            for w in waiting:
                w.result(timeout=5)
    finally:
        conn.close()


def test_a_waiting_caller_runs_the_head_job_itself_within_the_width(lanes: Lanes) -> None:
    """``run_here``: the job at the head of its lane runs in the caller's thread; a job
    whose lane is full, or one no longer queued, is left to the lane's threads."""
    release = threading.Event()
    busy = lanes.submit("peer", lambda: release.wait(5), width=1)
    wait_until(busy.running, 5)
    queued = lanes.submit("peer", threading.get_ident, width=1)
    try:
        assert lanes.run_here("peer", queued) is False  # the lane's one place is taken
        assert not queued.done()
    finally:
        release.set()
    assert busy.result(timeout=2) and queued.result(timeout=2) != threading.get_ident()
    assert lanes.run_here("peer", queued) is False  # done: not queued any more

    here = threading.get_ident()
    places = []
    for _ in range(20):  # a lane thread may win the race to a job; the caller mostly does
        job = lanes.submit("other", threading.get_ident, width=2)
        ran_here = lanes.run_here("other", job)
        assert (job.result(timeout=2) == here) is ran_here
        places.append(ran_here)
    assert any(places)
