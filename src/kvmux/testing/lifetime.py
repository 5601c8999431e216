"""Children of a test run that end with it.

A test runner that is killed, or crashes, never runs its fixtures' clean-up: a
server or engine it started would keep a port and a share of a 2-core CI box.
"""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:  # pragma: no cover - runs in the child process
    """Have the kernel SIGKILL this process when the one that started it dies
    (Linux; elsewhere a no-op). Call it first thing in the child, or pass it as
    ``preexec_fn`` to :class:`subprocess.Popen`."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
