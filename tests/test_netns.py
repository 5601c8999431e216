"""P2P backends between separate hosts: network namespaces this test creates itself.

Each test builds a :class:`kvmux.testing.netns.Topology` (a producer host
``p`` and a consumer host ``d`` on one switch, 10.x addresses, private
``/dev/shm`` each), runs a :mod:`kvmux.testing.peer` in ``p`` bound to
``0.0.0.0`` (so it must *advertise* its 10.x address) and a
:mod:`kvmux.testing.pull` in ``d``, and removes everything when it ends.
Needs root and iproute2: skipped, saying why, otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvmux.testing import netns
from kvmux.testing.peer import read_line, spawn_peer
from vllm_e2e_support import installed

from support import P2P_GRACE_S

pytestmark = [
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
    pytest.mark.timeout(180),
]

SEED = 11
TIMEOUT_S = 6.0


@pytest.fixture
def net() -> Iterator[netns.Topology]:
    with netns.topology("p", "d") as topology:
        yield topology
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h.netns in left for h in topology.hosts.values()), left


def _needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not installed(module), reason=f"{module} is not installed")


def _served(backend: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": backend,
        "host": "0.0.0.0",
        "timeout_s": TIMEOUT_S,
        "capacity_bytes": 96 * 2**20,
        **extra,
    }


UCX_TCP = {"UCX_TLS": "tcp,self"}
"""NIXL between hosts: UCX over TCP (its same-host transports would find the
other namespace on this kernel and bypass the network)."""
BACKEND_ENV: dict[str, dict[str, str]] = {"nixl": UCX_TCP}


def _in(host: netns.Host, env: dict[str, str] | None = None) -> list[str]:
    """The prefix that runs a command in ``host`` with ``env`` set."""
    settings = [f"{name}={value}" for name, value in (env or {}).items()]
    return host.command(["env", *settings] if settings else [])


def _pull(
    host: netns.Host,
    config: dict[str, Any],
    source: dict[str, Any] | None,
    blocks: int,
    layout: str = "small",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "kvmux.testing.pull", "--config", json.dumps(config)]
    argv += ["--source", json.dumps(source), "--blocks", str(blocks), "--seed", str(SEED)]
    argv += ["--layout", layout]
    done = subprocess.run(
        [*_in(host, env), *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _result(done.stdout)


def _result(stdout: str) -> dict[str, Any]:
    """The pull's JSON line: its last line that is an object (UCX may print warnings
    on stdout after it, as its agent is destroyed)."""
    out: dict[str, Any] = json.loads([ln for ln in stdout.splitlines() if ln.startswith("{")][-1])
    return out


def test_a_topology_connects_its_hosts_and_leaves_nothing_behind() -> None:
    with netns.topology("a", "b", "c") as net:
        hosts = list(net.hosts.values())
        assert len({h.address for h in hosts}) == 3
        assert all(h.address.startswith("10.") for h in hosts)
        sleeper = subprocess.Popen(hosts[0].command(["sleep", "600"]))
        # ``ip netns exec`` enters the host after Popen returns: on a busy machine
        # (CI saw it) the first listing can come before the setns.
        until = time.monotonic() + 10
        while sleeper.pid not in hosts[0].pids() and time.monotonic() < until:
            time.sleep(0.02)
        assert sleeper.pid in hosts[0].pids()
        shm = hosts[1].run(["sh", "-c", "ls /dev/shm | wc -l"]).stdout.strip()
        assert shm == "0", "a host's /dev/shm is its own"
    sleeper.wait(timeout=10)  # close() stopped it by PID
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(h.netns in left for h in hosts)


def test_a_thread_entered_in_a_host_reaches_the_hosts_then_returns_to_its_own_network() -> None:
    own = os.stat("/proc/thread-self/ns/net").st_ino
    with netns.topology("a", "b") as net:
        a, b = net["a"], net["b"]
        code = "import http.server as h, sys; "
        code += "h.HTTPServer((sys.argv[1], 8123), h.BaseHTTPRequestHandler).serve_forever()"
        with b.serve([sys.executable, "-c", code, b.address], 8123, start_s=20):
            with a.entered():
                inside = os.stat("/proc/thread-self/ns/net").st_ino
                socket.create_connection((b.address, 8123), timeout=5).close()
            assert inside == os.stat(f"/run/netns/{a.netns}").st_ino != own
            assert os.stat("/proc/thread-self/ns/net").st_ino == own


def test_namespaces_left_by_a_dead_run_are_swept_and_living_ones_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = f"kvmux-{dead.pid}-abcdef-sw"
    subprocess.run(["ip", "netns", "add", orphan], check=True, timeout=10)
    try:
        with netns.topology("a") as net:
            listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
            assert orphan not in listed.stdout
            assert net["a"].netns in listed.stdout, "this run's own namespace is kept"
    finally:
        subprocess.run(["ip", "netns", "del", orphan], capture_output=True, timeout=10)


def test_a_wildcard_bound_server_advertises_its_reachable_address() -> None:
    from kvmux.net.advertise import advertised_host

    assert advertised_host("10.1.2.3", None) == "10.1.2.3"
    assert advertised_host("0.0.0.0", "10.9.9.9") == "10.9.9.9"
    with netns.topology("p") as net:
        host = net["p"]
        code = "from kvmux.net.advertise import first_host_address as f; print(f())"
        assert host.run([sys.executable, "-c", code]).stdout.strip() == host.address


@pytest.mark.parametrize(
    ("backend", "layout"),
    [
        ("tcp", "small"),
        ("tcp", "large"),
        pytest.param("nixl", "small", marks=_needs("nixl")),
        pytest.param("mooncake", "small", marks=_needs("mooncake")),
    ],
)
def test_p2p_blocks_cross_hosts_byte_exact(net: netns.Topology, backend: str, layout: str) -> None:
    """The producer binds 0.0.0.0 and advertises its 10.x address; the consumer in
    the other host pulls every block, exact."""
    config, env = _served(backend), BACKEND_ENV.get(backend)
    with spawn_peer(config, 64, SEED, layout, prefix=_in(net["p"], env)) as peer:
        assert peer.address["host"] == net["p"].address
        got = _pull(net["d"], config, peer.address, 64, layout, env)
    assert got["statuses"] == {"ok": 64}, got["reasons"]
    assert got["ok_exact"]


@_needs("mooncake")
def test_mooncake_store_values_cross_hosts_through_a_master_on_a_third() -> None:
    """Master on host ``store``; the writer on ``p`` lends the segment its values
    live in (advertising its 10.x address); the reader on ``d`` gets them exact."""
    port = 50051
    with netns.topology("p", "d", "store") as net:
        master = net["store"].address
        argv = [
            str(Path(sys.executable).parent / "mooncake_master"),
            f"--rpc_address={master}",
            f"--rpc_port={port}",
        ]
        argv += [f"--metrics_host={master}", "--metrics_port=9003"]
        config = {
            "backend": "buffers:mooncake-store",
            "master_address": f"{master}:{port}",
            "global_segment_bytes": 16 * 2**20,
            "local_buffer_bytes": 16 * 2**20,
            "timeout_s": TIMEOUT_S,
        }
        with (
            net["store"].serve(argv, port, start_s=20),
            spawn_peer(config, 16, SEED, prefix=_in(net["p"])),
        ):
            got = _pull(net["d"], config, None, 16)
    assert got["statuses"] == {"ok": 16}, got["reasons"]
    assert got["ok_exact"]


@_needs("lmcache")
def test_lmcache_server_on_a_third_host_serves_blocks_saved_on_another() -> None:
    """``lmcache_server`` on host ``store``; a writer on ``p`` saves through
    ``lm://10.x:PORT`` and exits; a reader on ``d`` loads every block exact."""
    port = 65432
    with netns.topology("p", "d", "store") as net:
        server = net["store"].address
        argv = [sys.executable, "-m", "lmcache.v1.server", server, str(port), "cpu"]
        config = {
            "backend": "lmcache",
            "max_local_cpu_gb": 0.05,
            "remote_url": f"lm://{server}:{port}",
            "namespace": "netns",
            "timeout_s": TIMEOUT_S,
        }
        with net["store"].serve(argv, port, start_s=120):
            with spawn_peer(config, 16, SEED, prefix=_in(net["p"])):
                pass
            got = _pull(net["d"], config, None, 16)
    assert got["statuses"] == {"ok": 16}, got["reasons"]
    assert got["ok_exact"]


def test_shm_refuses_a_peer_on_another_host_per_key_and_a_multi_falls_back_to_tcp(
    net: netns.Topology,
) -> None:
    shm = _served("shm")
    multi = {"backend": "multi", "policy": "fallback", "children": [shm, _served("tcp")]}
    with spawn_peer(multi, 16, SEED, prefix=net["p"].command([])) as peer:
        shm_address = peer.address["children"][0]
        alone = _pull(net["d"], shm, shm_address, 16)
        both = _pull(net["d"], multi, peer.address, 16)
    assert alone["statuses"] == {"failed": 16}
    assert "another host" in alone["reasons"][0], alone["reasons"]
    assert alone["seconds"] < 1.0, "refused at once, not at a timeout"
    assert alone["untouched"]
    assert both["statuses"] == {"ok": 16}, both["reasons"]
    assert both["ok_exact"]


SHAPED_BACKENDS = [
    "tcp",
    pytest.param("nixl", marks=_needs("nixl")),
    pytest.param("mooncake", marks=_needs("mooncake")),
]
"""The P2P backends whose data crosses the shaped wire (shm refuses other hosts)."""


@pytest.mark.parametrize("backend", SHAPED_BACKENDS)
def test_a_link_cut_mid_transfer_fails_the_rest_within_the_deadline_and_heals(
    net: netns.Topology, backend: str
) -> None:
    """256 KiB blocks over a 50 Mbit link (about 5 s for 120 blocks, timeout_s 15);
    the wire is cut a second or two in: the load ends by its deadline, the blocks
    that arrived are exact, the rest failed; once the link is back, a new load
    gets every block."""
    blocks = 120
    config, env = {**_served(backend), "timeout_s": 15.0}, BACKEND_ENV.get(backend)
    net["p"].limit_rate(50)
    with spawn_peer(config, blocks, SEED, "large", prefix=_in(net["p"], env)) as peer:
        argv = [sys.executable, "-m", "kvmux.testing.pull", "--config", json.dumps(config)]
        argv += ["--source", json.dumps(peer.address), "--blocks", str(blocks)]
        argv += ["--seed", str(SEED), "--layout", "large"]
        started = time.monotonic()
        puller = subprocess.Popen([*_in(net["d"], env), *argv], stdout=subprocess.PIPE, text=True)
        try:
            time.sleep(3.0)  # the consumer's start-up (imports) plus a second or so of bytes
            net["p"].link_down()
            out, _ = puller.communicate(timeout=15.0 + P2P_GRACE_S + 30)
        finally:
            if puller.poll() is None:
                puller.kill()
                puller.wait(timeout=10)
        elapsed = time.monotonic() - started
        cut = _result(out)
        net["p"].link_up()
        net["p"].clear_shaping()
        healed = _pull(net["d"], config, peer.address, blocks, "large", env)
    print(f"\n{backend}, link cut mid-transfer: {cut['statuses']} after {cut['seconds']:.2f} s")
    assert cut["statuses"].get("failed", 0) > 0, cut
    assert cut["seconds"] < 15.0 + P2P_GRACE_S, cut
    assert elapsed < 15.0 + P2P_GRACE_S + 20
    assert cut["ok_exact"]
    assert healed["statuses"] == {"ok": blocks}, healed["reasons"]
    assert healed["ok_exact"]


def _round_trip_s(host: netns.Host, address: str, port: int) -> float:
    """The shortest of a few TCP connects from ``host`` to ``address:port``: one
    round trip (SYN, SYN-ACK), the delay a link adds both ways."""
    code = (
        "import socket, sys, time\n"
        "best = 1e9\n"
        "for _ in range(5):\n"
        "    t = time.perf_counter()\n"
        "    socket.create_connection((sys.argv[1], int(sys.argv[2])), 5).close()\n"
        "    best = min(best, time.perf_counter() - t)\n"
        "print(best)\n"
    )
    return float(host.run([sys.executable, "-c", code, address, str(port)]).stdout)


@pytest.mark.parametrize("backend", SHAPED_BACKENDS)
@pytest.mark.parametrize("shaping", ["rate", "netem"])
def test_a_slow_link_delivers_exact_bytes_in_bounded_time(
    net: netns.Topology, shaping: str, backend: str
) -> None:
    """1 Gbit (tbf), or 100 µs each way plus 1 Gbit (netem, where the kernel has
    ``sch_netem``): 32 MiB arrive exact, no sooner than the link allows and well
    inside timeout_s; with netem a round trip takes at least the two delays."""
    if shaping == "netem" and netns.netem_unavailable() is not None:
        pytest.skip(str(netns.netem_unavailable()))
    blocks, rate_mbit, delay_us = 128, 1000, 100
    for host in (net["p"], net["d"]):
        if shaping == "netem":
            host.netem(delay_us=delay_us, rate_mbit=rate_mbit)
        else:
            host.limit_rate(rate_mbit)
    config, env = {**_served(backend), "timeout_s": 30.0}, BACKEND_ENV.get(backend)
    with spawn_peer(config, blocks, SEED, "large", prefix=_in(net["p"], env)) as peer:
        round_trip_s = _round_trip_s(net["d"], peer.address["host"], peer.address["port"])
        got = _pull(net["d"], config, peer.address, blocks, "large", env)
    floor_s = got["nbytes"] * 8 / (rate_mbit * 1e6)
    print(
        f"\n{backend} over {shaping} {rate_mbit} Mbit: {got['nbytes'] >> 20} MiB in "
        f"{got['seconds']:.2f} s, round trip {round_trip_s * 1e6:.0f} us"
    )
    assert got["statuses"] == {"ok": blocks}, got["reasons"]
    assert got["ok_exact"]
    assert got["nbytes"] == blocks * 256 * 2**10
    assert got["seconds"] >= 0.8 * floor_s, "the link was not shaped"
    assert got["seconds"] < 20.0
    if shaping == "netem":
        assert round_trip_s >= 2 * delay_us * 1e-6, "the link was not delayed"


@pytest.mark.parametrize("backend", SHAPED_BACKENDS)
def test_a_link_too_slow_for_the_deadline_fails_the_load_in_time_and_the_next_load_works(
    net: netns.Topology, backend: str
) -> None:
    """32 MiB over 40 Mbit (tbf) take about 7 s, timeout_s is 2 s: the load ends by
    its deadline, not sooner and not much later, with the keys that did not arrive
    failed (those that did are exact). Once the limit is lifted, the same consumer
    connector loads every block from the same peer."""
    blocks, rate_mbit, timeout_s = 128, 40, 2.0
    for host in (net["p"], net["d"]):
        host.limit_rate(rate_mbit)
    config, env = {**_served(backend), "timeout_s": timeout_s}, BACKEND_ENV.get(backend)
    with spawn_peer(config, blocks, SEED, "large", prefix=_in(net["p"], env)) as peer:
        argv = [sys.executable, "-m", "kvmux.testing.pull", "--config", json.dumps(config)]
        argv += ["--source", json.dumps(peer.address), "--blocks", str(blocks)]
        argv += ["--seed", str(SEED), "--layout", "large", "--wait-s", "30", "--again"]
        puller = subprocess.Popen(
            [*_in(net["d"], env), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert puller.stdin is not None
        try:
            slow = json.loads(read_line(puller, 90))
            for host in (net["p"], net["d"]):
                host.clear_shaping()
            puller.stdin.write(b"\n")
            puller.stdin.flush()
            healed = json.loads(read_line(puller, 60))
            assert puller.wait(timeout=30) == 0
        finally:
            if puller.poll() is None:
                puller.kill()
                puller.wait(timeout=10)
            puller.stdin.close()
            assert puller.stdout is not None
            puller.stdout.close()
    print(
        f"\n{backend}, {blocks >> 2} MiB over {rate_mbit} Mbit, timeout_s {timeout_s}: "
        f"{slow['statuses']} after {slow['seconds']:.2f} s ({slow['reasons'][:1]}); "
        f"limit lifted: {healed['statuses']} in {healed['seconds']:.2f} s"
    )
    assert slow["statuses"].get("failed", 0) > 0, slow
    assert set(slow["statuses"]) <= {"ok", "failed"}, slow
    assert 0.8 * timeout_s <= slow["seconds"] < timeout_s + P2P_GRACE_S, slow
    assert slow["ok_exact"]
    assert healed["statuses"] == {"ok": blocks}, healed["reasons"]
    assert healed["ok_exact"]
