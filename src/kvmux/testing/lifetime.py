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
from collections.abc import Iterator


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
    way out, whatever happened inside."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
