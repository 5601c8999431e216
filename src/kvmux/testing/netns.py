"""Separate hosts on one machine, for tests and the bench: network namespaces.

A :class:`Topology` creates one network namespace per named host plus a
*switch* namespace holding a bridge; each host gets a veth pair, its end
(``eth0``) inside the host with an address ``10.<net>.0.<n>/24``, the other end
enslaved to the bridge. Every host has its own loopback up. Nothing is added
to the machine's own namespace, and traffic can only reach the namespaces
this topology created: there is no route out.

A process runs in a host through :meth:`Host.command`, a prefix
(``ip netns exec NS ...``) in front of any command; ``ip`` execs it, so the
PID that ``Popen`` returns is the process itself and tests stop it by PID as
usual. :meth:`Host.entered` puts the calling *thread* in a host's network for
a ``with`` block instead: the test process itself then reaches the hosts'
10.x addresses (a client of servers running there).

By default each command also gets a private ``/dev/shm`` (a fresh tmpfs in
the mount namespace ``ip netns exec`` gives every command, gone with it):
separate hosts share no shared memory, so a same-host transport
(``shm``) sees another host. Two commands in one host do not share one either;
``private_shm=False`` keeps the machine's ``/dev/shm`` for every host.

:meth:`Topology.close` (also the ``with`` exit) kills what still runs in its
namespaces by PID, checks with ``ip netns pids`` that nothing is left, and
deletes the namespaces, which removes their veths; every step is bounded in
time. A run killed before its teardown leaves namespaces named after its PID;
the next topology removes those (:func:`sweep_orphans`).

Link faults: :meth:`Host.link_down` / :meth:`Host.link_up` (cut the host's
wire), :meth:`Host.netem` (delay and rate on its egress; both directions
when applied to both ends) and :meth:`Host.limit_rate` (rate only, ``tc
tbf``, for kernels without netem).

Needs root and ``ip``/``tc`` (iproute2); :func:`unavailable` and
:func:`netem_unavailable` say why not, for an honest skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

_STEP_TIMEOUT_S = 10.0
"""Longest one ``ip``/``tc`` command may take before the topology calls it broken."""
_DEVICE = "eth0"
"""The host end of its veth pair, inside the host."""
_BRIDGE = "br0"
_CLONE_NEWNET = 0x40000000
PRIVATE_SHM = 'mount -t tmpfs -o size=2g kvmux-shm /dev/shm && exec "$@"'
"""Shell prelude of a host command with its own ``/dev/shm``."""


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed or timed out; the message has its output."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=_STEP_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)!r} took over {_STEP_TIMEOUT_S} s") from None
    if check and done.returncode != 0:
        raise NetnsError(
            f"{' '.join(argv)!r} failed ({done.returncode}): {done.stderr.strip() or done.stdout}"
        )
    return done


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be used here (None when they can): not root, no ``ip``,
    or the kernel/container refuses ``ip netns add`` (tried once, then removed)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2) is not installed"
    probe = f"kvmux-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _ip("netns", "del", probe)
    except NetnsError as exc:
        return f"cannot remove a network namespace: {exc}"
    return None


@functools.cache
def netem_unavailable() -> str | None:
    """Why ``tc netem`` cannot be used (None when it can): many VM kernels are built
    without ``sch_netem``. Tried once in a namespace of its own, then removed.

    Without netem there is no honest delay: ``tbf`` only caps the rate, and the
    other way to hold packets back (earliest-departure times set by a BPF
    program) needs ``sch_fq`` too, which such kernels usually lack as well."""
    reason = unavailable()
    if reason is not None:
        return reason
    probe = f"kvmux-netem-{os.getpid()}"
    netem = ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "100us"]
    _ip("netns", "add", probe)
    try:
        tried = _run(["ip", "netns", "exec", probe, *netem], check=False)
    finally:
        _ip("netns", "del", probe)
    if tried.returncode != 0:
        return (
            f"this kernel ({os.uname().release}) has no sch_netem (CONFIG_NET_SCH_NETEM), "
            f"so no delayed link: tc netem says {tried.stderr.strip()!r}"
        )
    return None


@dataclass(frozen=True)
class Host:
    """One host of a topology: its namespace, its address and its wire."""

    name: str
    netns: str
    address: str
    """Where the other hosts reach this one (10.x)."""
    switch_port: str
    """The other end of the host's veth, on the switch's bridge."""
    switch_netns: str
    private_shm: bool = True

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host (its network, and its own ``/dev/shm``)."""
        prefix = ["ip", "netns", "exec", self.netns]
        if self.private_shm:
            return [*prefix, "sh", "-c", PRIVATE_SHM, "kvmux-host", *argv]
        return [*prefix, *argv]

    def run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run a short command in the host, bounded in time; raise if it fails."""
        return _run(self.command(argv))

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The calling thread inside this host's network for the ``with`` block
        (``setns``; other threads stay where they are). Sockets it opens there reach
        the hosts' 10.x addresses, and keep working after the block; processes it
        starts meanwhile start in this host's network too."""
        with (
            open("/proc/thread-self/ns/net") as own,
            open(f"/run/netns/{self.netns}") as host,
        ):
            _setns(host.fileno(), self.name)
            try:
                yield
            finally:
                _setns(own.fileno(), "the test's own network")

    def link_down(self) -> None:
        """Cut the host's wire (its switch port): packets in flight are lost, and
        sockets see silence, not a reset, as when a cable is pulled."""
        _ip("-n", self.switch_netns, "link", "set", self.switch_port, "down")

    def link_up(self) -> None:
        _ip("-n", self.switch_netns, "link", "set", self.switch_port, "up")

    def netem(self, *, delay_us: int, rate_mbit: int | None = None) -> None:
        """Delay (and cap) what the host sends: ``tc netem`` on its ``eth0``; replaces
        any earlier setting. Apply it to both hosts of a path for a round trip of
        ``2 * delay_us``."""
        args = ["tc", "qdisc", "replace", "dev", _DEVICE, "root", "netem"]
        args += ["delay", f"{delay_us}us"]
        if rate_mbit is not None:
            args += ["rate", f"{rate_mbit}mbit"]
        _run(["ip", "netns", "exec", self.netns, *args])

    def limit_rate(self, rate_mbit: int, burst_kib: int = 1024) -> None:
        """Cap what the host sends at ``rate_mbit`` (``tc tbf``, no added delay): a
        slow link where the kernel has no netem. ``burst_kib`` must exceed the
        largest (offloaded) packet a veth passes, 64 KiB."""
        args = ["tc", "qdisc", "replace", "dev", _DEVICE, "root", "tbf", "rate"]
        args += [f"{rate_mbit}mbit", "burst", f"{burst_kib}kb", "latency", "1s"]
        _run(["ip", "netns", "exec", self.netns, *args])

    def clear_shaping(self) -> None:
        """Remove :meth:`netem` / :meth:`limit_rate`: the link is plain again."""
        _run(["ip", "netns", "exec", self.netns, "tc", "qdisc", "del", "dev", _DEVICE, "root"])

    def wait_listening(self, port: int, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
        """Block until something in the host accepts on ``self.address:port`` (probed
        from inside the host, which this process cannot reach), or ``proc`` exits."""
        probe = (
            "import socket,sys,time\n"
            f"until = time.monotonic() + {timeout_s}\n"
            "while time.monotonic() < until:\n"
            "    try:\n"
            f"        socket.create_connection(({self.address!r}, {port}), 0.2).close()\n"
            "        sys.exit(0)\n"
            "    except OSError:\n"
            "        time.sleep(0.05)\n"
            "sys.exit(1)\n"
        )
        waiter = subprocess.Popen(self.command(["python3", "-c", probe]))
        try:
            until = time.monotonic() + timeout_s + _STEP_TIMEOUT_S
            while waiter.poll() is None and proc.poll() is None and time.monotonic() < until:
                time.sleep(0.05)
        finally:
            if waiter.poll() is None:
                waiter.kill()
            waiter.wait(timeout=_STEP_TIMEOUT_S)
        if waiter.returncode != 0:
            state = f"exited ({proc.returncode})" if proc.poll() is not None else "runs"
            raise NetnsError(
                f"{proc.args!r} in host {self.name} did not listen on {self.address}:{port} "
                f"within {timeout_s} s (it {state})"
            )

    @contextlib.contextmanager
    def serve(
        self, argv: Sequence[str], port: int, *, start_s: float = 60.0
    ) -> Iterator[subprocess.Popen[bytes]]:
        """Run a server ``argv`` in the host for the ``with`` block, once it listens on
        ``port``; SIGTERM, then SIGKILL, by PID at the end."""
        proc = subprocess.Popen(
            self.command(argv), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            self.wait_listening(port, start_s, proc)
            yield proc
        finally:
            _end(proc)

    def pids(self) -> list[int]:
        """Processes running in this host now (``ip netns pids``)."""
        return _pids(self.netns)


def _setns(fd: int, where: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NetnsError(f"cannot enter {where}: {os.strerror(errno)}")


def _end(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)


def _pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(word) for word in done.stdout.split()]


@dataclass
class Topology:
    """Hosts on one switch; see the module docstring. Use as a context manager."""

    names: Sequence[str]
    private_shm: bool = True
    net: int = field(default_factory=lambda: 64 + secrets.randbelow(128))
    """Second octet of the 10.x/24 the hosts share: random, so topologies of two
    test runs at once do not look alike (they could not reach each other anyway)."""
    hosts: dict[str, Host] = field(init=False, default_factory=dict)
    _created: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not self.names or len(set(self.names)) != len(self.names) or len(self.names) > 200:
            raise ValueError(f"host names must be 1..200 distinct names, got {list(self.names)}")
        reason = unavailable()
        if reason is not None:
            raise NetnsError(reason)
        sweep_orphans()
        tag = f"kvmux-{os.getpid()}-{secrets.token_hex(3)}"
        switch = f"{tag}-sw"
        try:
            self._add_netns(switch)
            _ip("-n", switch, "link", "add", _BRIDGE, "type", "bridge")
            _ip("-n", switch, "link", "set", _BRIDGE, "up")
            for n, name in enumerate(self.names, start=1):
                netns = f"{tag}-{n}"
                port = f"p{n}"
                self._add_netns(netns)
                _ip("-n", netns, "link", "add", _DEVICE, "type", "veth", "peer", "name", port)
                _ip("-n", netns, "link", "set", port, "netns", switch)
                address = f"10.{self.net}.0.{n}"
                _ip("-n", netns, "addr", "add", f"{address}/24", "dev", _DEVICE)
                _ip("-n", netns, "link", "set", _DEVICE, "up")
                _ip("-n", switch, "link", "set", port, "master", _BRIDGE)
                _ip("-n", switch, "link", "set", port, "up")
                self.hosts[name] = Host(name, netns, address, port, switch, self.private_shm)
        except BaseException:
            self.close()
            raise

    def _add_netns(self, netns: str) -> None:
        _ip("netns", "add", netns)
        self._created.append(netns)
        _ip("-n", netns, "link", "set", "lo", "up")

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        """Stop everything still running in the namespaces (by PID: SIGTERM, then
        SIGKILL), verify none is left, delete the namespaces (and so their veths).
        Idempotent; raises NetnsError if something could not be removed."""
        problems: list[str] = []
        for netns in reversed(self._created):
            left = _stop_all(netns)
            if left:
                problems.append(f"processes {left} still run in {netns}")
            done = _ip("netns", "del", netns, check=False)
            if done.returncode != 0:
                problems.append(f"cannot delete {netns}: {done.stderr.strip()}")
        self._created.clear()
        if problems:
            raise NetnsError("; ".join(problems))

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_all(netns: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM each process in ``netns``, SIGKILL what is left after ``grace_s``;
    the PIDs still there after that (none, normally)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        pids = _pids(netns)
        if not pids:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        until = time.monotonic() + wait_s
        while _pids(netns) and time.monotonic() < until:
            time.sleep(0.05)
    return _pids(netns)


_OURS = re.compile(r"^kvmux-(\d+)-[0-9a-f]{6}-(?:sw|\d+)$")


def sweep_orphans() -> list[str]:
    """Remove the namespaces of topologies whose creating process is gone (a test
    run killed before its teardown), with what still runs in them; the names
    removed. Namespaces of living processes are left alone."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    removed = []
    for line in listed:
        name = line.split(" ")[0]
        match = _OURS.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        _stop_all(name)
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def topology(*names: str, private_shm: bool = True) -> Iterator[Topology]:
    """``with topology("p", "d") as net: net["p"].command([...])``."""
    with Topology(names, private_shm=private_shm) as net:
        yield net
