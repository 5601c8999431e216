"""Processes the demo starts and must always stop: vLLM API servers and the kvmux proxy.

A vLLM API server is a process *tree* (the API server plus its ``EngineCore``
child, sometimes workers too). Killing only the PID we started would leave the
engine running and holding its memory, so every server gets a session (and so
a process group) of its own and is stopped by group: SIGTERM, a grace period,
then SIGKILL. Its own session also keeps a terminal's Ctrl-C away from it, so
the demo, not the terminal, decides the order things stop in.

Servers log to a file, never to a pipe: nobody reads a pipe while the demo
waits, and a full pipe would block vLLM. The file also outlives the demo, so
a failed run can be read afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from kvmux.errors import KvmuxError
from kvmux.testing.vllm_engine import ENGINE_ENV

if TYPE_CHECKING:
    from kvmux.proxy import ProxyConfig

HOST = "127.0.0.1"

#: On top of :data:`ENGINE_ENV`: nothing may try the network (there is none here).
SERVER_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


class ServerError(KvmuxError, RuntimeError):
    """A server exited or did not become healthy; the message carries its log tail."""


_PER_SERVER_ENV = frozenset({"PROMETHEUS_MULTIPROC_DIR"})
"""Variables a server must not inherit. vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` to a
temporary directory of its own in any process that imports its metrics (a test
process that ran an engine in-process); servers started from there would write
their metrics into that one directory and each one's ``/metrics`` would add up
the counters of every server before it."""

_HANDED_OUT: set[int] = set()
"""Ports ``free_port`` has returned in this process: servers started side by side
each take a port number before any of them binds it, and the kernel may offer a
port just released again."""


def free_port(host: str = HOST) -> int:
    """A port nobody listens on right now, and not one this process handed out
    before (vLLM takes a port number, not a socket)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port: int = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def listening_pids(port: int, network_of: int | None = None) -> set[int]:
    """The processes with a TCP socket listening on ``port`` (Linux ``/proc``;
    processes this user may not inspect are left out), in this process's network
    or, given ``network_of`` (a PID), in that process's (another network namespace)."""
    inodes: set[str] = set()
    net = "/proc/net" if network_of is None else f"/proc/{network_of}/net"
    for table in (f"{net}/tcp", f"{net}/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{inode}]")
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                pids.add(int(entry.name))
    return pids


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free port, loopback by default.

    ``start`` returns at once, so several servers start side by side (their
    start-up is mostly single-threaded Python imports); ``wait_ready`` then
    blocks until ``GET /health`` answers. As a context manager it starts,
    waits, and always stops. ``cpus`` pins the whole server (``taskset``) and
    its OpenMP threads to those cores. ``host`` is the address it listens on and
    its ``url`` names; ``prefix`` runs it through a command that execs it, e.g. in
    another host of a :class:`kvmux.testing.netns.Topology` (``host.command([])``,
    with that host's address as ``host``; probe it from a thread in that network).
    """

    def __init__(
        self,
        name: str,
        model: str | os.PathLike[str],
        args: Sequence[str] = (),
        *,
        log_dir: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        cpus: Sequence[int] = (),
        host: str = HOST,
        prefix: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.model = str(model)
        self.args = list(args)
        self.port = port if port is not None else free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        self.cpus = tuple(cpus)
        self.prefix = tuple(prefix)
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in _PER_SERVER_ENV},
            **ENGINE_ENV,
            **SERVER_ENV,
            **pinned_env(self.cpus),
            **(env or {}),
        }
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def command(self) -> list[str]:
        return [
            *self.prefix,
            *taskset_prefix(self.cpus),
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.args,
        ]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> VllmServer:
        if self._proc is not None:
            raise ServerError(f"{self.name} was already started (pid {self._proc.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {' '.join(self.command)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stopped as one (see module doc)
            )
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until ``/health`` answers 200 from this server's own process group;
        raise :class:`ServerError` if the process exits first or ``timeout_s`` passes."""
        if self._proc is None:
            raise ServerError(f"{self.name} was never started")
        deadline = time.monotonic() + timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServerError(self._failure(f"exited with status {code} while starting"))
            if self.healthy() and self._owns_port():
                return
            if time.monotonic() > deadline:
                raise ServerError(self._failure(f"was not healthy after {timeout_s:.0f} s"))
            time.sleep(0.5)

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status once the server's process ends, or None if it still runs
        after ``timeout_s`` (for servers expected to refuse their config)."""
        if self._proc is None:
            raise ServerError(f"{self.name} was never started")
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self._proc.wait(timeout_s)
        return None

    def _owns_port(self) -> bool:
        """Whether the ``/health`` that answered is this server's: another process
        listening on the same port (a port two runs both picked) would otherwise pass
        for it, and the caller would talk to a stranger."""
        assert self._proc is not None
        group = self._proc.pid  # the server leads its own process group (start_new_session)
        for pid in listening_pids(self.port, network_of=group):
            with contextlib.suppress(OSError):
                if pid == group or os.getpgid(pid) == group:
                    return True
        return False

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _failure(self, what: str) -> str:
        return (
            f"vLLM server {self.name!r} ({self.url}, pid {self.pid}) {what}; "
            f"log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to whatever is left after
        ``grace_s``. Idempotent; safe on a server that never started or already died."""
        if self._proc is None:
            return
        group = self._proc.pid  # start_new_session: the group id is the leader's PID
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(0.2)
            if self._proc.poll() is not None and not _group_alive(group):
                return
        _signal_group(group, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(10)

    def __enter__(self) -> VllmServer:
        if self._proc is None:
            self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VllmServer({self.name!r}, {self.url}, pid={self.pid})"


def taskset_prefix(cpus: Sequence[int]) -> list[str]:
    """``taskset -c 0,1`` in front of a command: it and every process it starts stay
    on those cores (nothing when ``cpus`` is empty)."""
    if not cpus:
        return []
    taskset = shutil.which("taskset")
    if taskset is None:
        raise ServerError(
            f"pinning a server to cores {list(cpus)} needs taskset (util-linux), "
            "which is not on PATH"
        )
    return [taskset, "-c", ",".join(str(c) for c in cpus)]


def pinned_env(cpus: Sequence[int]) -> dict[str, str]:
    """vLLM-CPU's OpenMP threads on exactly the pinned cores, one thread each.

    ``OMP_NUM_THREADS`` sizes torch's pool to the pinned cores (unset, it may
    start one thread per core of the machine, which then fight over the pinned
    ones); ``VLLM_CPU_OMP_THREADS_BIND`` names the same cores for when vLLM binds
    threads itself (its multiprocess executor), instead of ``auto`` picking
    cores that may lie outside the ``taskset`` mask.
    """
    if not cpus:
        return {}
    listed = ",".join(str(c) for c in cpus)
    return {"VLLM_CPU_OMP_THREADS_BIND": listed, "OMP_NUM_THREADS": str(len(cpus))}


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(group, sig)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class ProxyThread:
    """The kvmux proxy (:func:`kvmux.proxy.running`) on an event loop in a daemon thread.

    In-process rather than ``kvmux proxy`` in a subprocess: nothing to find on
    ``PATH``, its port is known the moment it binds, and its errors surface
    here as exceptions. The demo's client is synchronous, so the proxy needs a
    loop of its own.
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.url = ""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="kvmux-proxy", daemon=True)

    def start(self, timeout_s: float = 30.0) -> str:
        """Serve; returns the proxy's base URL once it listens."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise ServerError(f"the kvmux proxy did not start within {timeout_s:.0f} s")
        if self._error is not None:
            raise ServerError(f"the kvmux proxy failed to start: {self._error}") from self._error
        return self.url

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        from kvmux.proxy import running

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with running(self.config) as url:
            self.url = url
            self._ready.set()
            await self._stop.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
