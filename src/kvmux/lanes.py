"""Work lanes: background transfers queue per peer, so a hung peer holds up only its own.

A connector's transfers used to share one pool of two threads. Two loads from
a peer that had stopped answering held both threads for their whole timeout,
and every other transfer, from healthy peers or local tiers, queued behind
them: five loads from a stopped prefill (``timeout_s`` 10) ended after 12, 12,
23, 23 and 32 s. Here each *lane* (a peer's endpoint; ``None`` for local work)
is a FIFO queue of its own with at most ``width`` threads, so a stuck lane
fills only itself. Within a lane, a job that waited past its deadline fails
the moment it starts (:meth:`kvmux.connector.Connector._run`), so N loads from
a hung peer all end within one ``timeout_s`` whatever N is.

Why lanes rather than a thread per transfer: a lane bounds the connections
one peer gets from us (the width matches the links a client keeps per peer),
and a peer that is merely slow gets its loads in order instead of a stampede.
Why not a thread pool per peer: a pool's threads live for ever, and peers come
and go (a restarted prefill has a new port); a lane's threads exist while it
has work and a short ``linger_s`` after, then the lane is gone.

A caller about to block on a job may run it itself (:meth:`Lanes.run_here`)
if it is still the lane's next job and the lane has room: the job counts
against the lane's width while it runs, so the bound on a peer's connections
holds, and its deadline is checked when it starts, as on a lane thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvmux.errors import ClosedError

T = TypeVar("T")

_Job = tuple[Future[Any], Callable[[], Any]]


@dataclass
class _Lane:
    ready: threading.Condition
    width: int
    jobs: deque[_Job] = field(default_factory=deque)
    threads: int = 0
    busy: int = 0
    borrowed: int = 0
    """Jobs of this lane running in the threads that waited for them (``run_here``)."""


class Lanes:
    """FIFO lanes of background work, each served by up to ``width`` threads
    (given per submission) that start on demand and end ``linger_s`` after
    the lane ran dry. Thread-safe."""

    def __init__(self, name: str, linger_s: float = 2.0) -> None:
        self._name = name
        self._linger_s = linger_s
        self._lock = threading.Lock()
        self._lanes: dict[Hashable, _Lane] = {}
        self._workers: set[threading.Thread] = set()
        self._closed = False

    def submit(self, lane: Hashable, fn: Callable[[], T], width: int) -> Future[T]:
        """Queue ``fn`` on ``lane``; its future ends with what ``fn`` returns or raises.
        Raises ClosedError after :meth:`shutdown`."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError(f"{self._name}: no new work after shutdown")
            entry = self._lanes.get(lane)
            if entry is None:
                entry = self._lanes[lane] = _Lane(threading.Condition(self._lock), width)
            entry.width = width
            entry.jobs.append((future, fn))
            waiting = entry.threads - entry.busy
            if waiting < len(entry.jobs) and entry.threads < width:
                entry.threads += 1
                worker = threading.Thread(
                    target=self._serve, args=(lane, entry), name=self._name, daemon=True
                )
                self._workers.add(worker)
                worker.start()
            else:
                entry.ready.notify()
        return future

    def run_here(self, lane: Hashable, future: Future[Any]) -> bool:
        """Run ``future``'s job in the calling thread, if it is the next job queued on
        ``lane`` and the lane runs fewer than its width of jobs; True if it ran here.

        For a caller about to block on ``future`` anyway: its thread does the work
        instead of waiting for a lane thread to wake, run it and wake the caller
        (two thread hops, most of a one-block remote load's fixed cost). The
        lane's order and width hold: only the job at the head is taken, and it
        counts as one of the lane's running jobs."""
        with self._lock:
            entry = self._lanes.get(lane)
            if (
                entry is None
                or not entry.jobs
                or entry.jobs[0][0] is not future
                or entry.busy + entry.borrowed >= entry.width
            ):
                return False
            _, fn = entry.jobs.popleft()
            entry.borrowed += 1
        try:
            _run(future, fn)
        finally:
            with self._lock:
                entry.borrowed -= 1
        return True

    @property
    def threads(self) -> int:
        """Threads alive now, over every lane."""
        with self._lock:
            return sum(entry.threads for entry in self._lanes.values())

    def shutdown(self, *, wait: bool = True) -> None:
        """Cancel what has not started, let running jobs end, and (``wait``) join
        their threads. Idempotent."""
        with self._lock:
            self._closed = True
            for entry in self._lanes.values():
                for future, _ in entry.jobs:
                    future.cancel()
                entry.jobs.clear()
                entry.ready.notify_all()
            workers = list(self._workers)
        if wait:
            for worker in workers:
                if worker is not threading.current_thread():
                    worker.join()

    def _serve(self, lane: Hashable, entry: _Lane) -> None:
        try:
            while True:
                job = self._next(lane, entry)
                if job is None:
                    return
                try:
                    _run(*job)
                finally:
                    with self._lock:
                        entry.busy -= 1
        finally:
            with self._lock:
                self._workers.discard(threading.current_thread())

    def _next(self, lane: Hashable, entry: _Lane) -> _Job | None:
        """The lane's next job, waiting up to ``linger_s`` for one; None when this
        thread should end (it has been counted out of the lane)."""
        with self._lock:
            until = time.monotonic() + self._linger_s
            while not entry.jobs and not self._closed:
                left = until - time.monotonic()
                if left <= 0:
                    break
                entry.ready.wait(left)
            if not entry.jobs:
                entry.threads -= 1
                if entry.threads == 0 and self._lanes.get(lane) is entry:
                    del self._lanes[lane]
                return None
            entry.busy += 1
            return entry.jobs.popleft()


def _run(future: Future[Any], fn: Callable[[], Any]) -> None:
    """Run ``fn`` into ``future``, unless the future was cancelled first."""
    if future.set_running_or_notify_cancel():
        try:
            result = fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)
