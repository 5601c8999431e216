"""Servers a test starts end with the test run, even one that is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvmux.testing.lifetime import stopped

HOLDER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from support import free_port, listening_process
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    with listening_process(argv, port, "http.server", 30) as proc:
        print(proc.pid, flush=True)
        sys.stdin.read()
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().split()[2] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_dies_with_the_test_run_that_started_it() -> None:
    code = HOLDER.format(tests=str(Path(__file__).parent))
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        server = int(holder.stdout.readline())
        assert _alive(server)
        os.kill(holder.pid, signal.SIGKILL)  # no clean-up runs in the killed run
        holder.wait()
        deadline = time.monotonic() + 10
        while _alive(server):
            assert time.monotonic() < deadline, "the server outlived the run that started it"
            time.sleep(0.05)
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_stopped_block_starts_only_once_every_thread_of_the_child_is_frozen() -> None:
    """Busy threads on another core keep running for a moment after SIGSTOP is
    queued; inside the block none may (a frozen peer must answer nothing)."""
    spin = "import threading, time\n" + (
        "for _ in range(3): threading.Thread(target=lambda: [0 for _ in iter(int, 1)],"
        " daemon=True).start()\ntime.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        with stopped(child.pid):
            states = [
                (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                for task in Path(f"/proc/{child.pid}/task").iterdir()
            ]
        assert len(states) >= 4 and set(states) <= {"T", "t"}, states
    finally:
        child.kill()
        child.wait(10)
