"""Children of a test run that end with it, and that it can freeze for a while.

A test runner that is killed, or crashes, never runs its fixtures' clean-up: a
server or engine it started would keep a port and a share of a 2-core CI box.
A test that freezes a child (SIGSTOP) must thaw it whatever happens, or the
child would outlive the test, stopped, holding its port.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

STOP_WAIT_S = 5.0
"""Longest :func:`stopped` waits for every thread of the child to be frozen."""


def die_with_parent() -> None:  # pragma: no cover - runs in the child process
    """Have the kernel SIGKILL this process when the one that started it dies
    (Linux; elsewhere a no-op). Call it first thing in the child, or pass it as
    ``preexec_fn`` to :class:`subprocess.Popen`."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the ``with`` block: alive, its sockets open, answering
    nothing (a frozen or swamped peer, as the network sees it); SIGCONT on the
    way out, whatever happened inside. The block starts only once every thread
    of ``pid`` is frozen: ``kill`` returns when the signal is queued, and a
    thread already running on another core could still answer a request the
    test means to go unanswered (a shm locate, after which the copy needs no
    producer)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_frozen(pid)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _wait_frozen(pid: int) -> None:
    """Return once every thread of ``pid`` is stopped (``T``/``t`` in its
    ``/proc`` stat) or gone; where there is no ``/proc``, at once."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return
    until = time.monotonic() + STOP_WAIT_S
    while not all(_frozen(task) for task in tasks.iterdir()):
        if time.monotonic() >= until:
            raise TimeoutError(f"process {pid} not frozen {STOP_WAIT_S} s after SIGSTOP")
        time.sleep(0.001)


def _frozen(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:  # the thread ended
        return True
    state = stat[stat.rindex(")") + 2]  # the field after the name, which may hold spaces
    return state in "tTZX"
