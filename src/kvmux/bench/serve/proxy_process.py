"""The ``kvmux proxy`` in a process of its own, for measurements.

The demo runs the proxy on a thread of the client's process
(:class:`~kvmux.demo.servers.ProxyThread`). Under a benchmark that shares one
interpreter lock between the load generator and the token relay: a client that
works harder per chunk (vLLM's serving benchmark against kvmux's, in the
cross-check) would slow the relay and read its own cost as the servers'
inter-token latency. Here the proxy is ``python -m kvmux.cli.main proxy`` in a
process group of its own, stopped as one, unpinned like the client (both
topologies have the same proxy on the same cores).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvmux.demo.servers import ServerError, free_port
from kvmux.proxy import ProxyConfig


class ProxyProcess:
    """``config``'s proxy (its ``port`` ignored: a free one is picked) as a subprocess."""

    def __init__(self, config: ProxyConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def command(self) -> list[str]:
        c = self.config
        flags = [sys.executable, "-m", "kvmux.cli.main", "proxy", "--port", str(self.port)]
        flags += ["--timeout-s", f"{c.timeout_s:g}"]
        if c.colocated:
            flags.append("--colocated")
        for url in c.prefill:
            flags += ["--prefill", str(url)]
        for url in c.decode:
            flags += ["--decode", str(url)]
        return flags

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the proxy has used so far; 0 once it has ended."""
        if self._proc is None:
            return 0.0
        try:
            stat = Path(f"/proc/{self._proc.pid}/stat").read_text()
        except OSError:
            return 0.0
        # Fields after the parenthesised name; utime and stime are the 14th and 15th.
        fields = stat.rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def start(self, timeout_s: float = 30.0) -> str:
        """Start it; returns its base URL once ``/health`` answers."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerError(
                    f"the kvmux proxy exited with status {self._proc.returncode} while "
                    f"starting (log: {self.log_path})"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                urllib.request.urlopen(self.url + "/health", timeout=2.0),
            ):
                return self.url
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"the kvmux proxy did not answer within {timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after ``grace_s``; idempotent."""
        if self._proc is None or self._proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait(10)
