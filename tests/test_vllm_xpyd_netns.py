"""xPyD across hosts: ``kvmux proxy``, two prefill and two decode vLLM servers, each
on a host of its own (network namespaces of :mod:`kvmux.testing.netns`), over
kvmux's ``tcp`` backend, ``nixl`` where it is installed (UCX over TCP), and
``shm`` then ``tcp`` in a ``multi`` (shm refuses the other host, the tcp child
serves). Mooncake's Transfer Engine is left out here: its cluster costs about
twice a tcp one (170 s against 90 s when measured), and it crosses hosts in
``test_netns.py``.

Five hosts on one switch: ``proxy`` runs ``kvmux proxy`` (the CLI, listening on
its 10.x address) and is where the test's client sits (its sockets are opened
in that host's network, :meth:`kvmux.testing.netns.Host.entered`); ``p0``,
``p1``, ``d0``, ``d1`` run one vLLM API server each, listening on their own
10.x address, with the kvmux backend bound to ``0.0.0.0`` and advertising
that address: each decode pulls a request's KV from whichever
prefill served it, across hosts. The servers start side by side; one
cluster per backend serves the module and its tests run in order on it.

Then ``p0``'s link is cut while two clients keep sending requests: the proxy
notices the silent host (``--unreachable-after-s``, :mod:`kvmux.proxy.liveness`),
takes it out, and retries its prefills on ``p1``; decodes that were pulling
from ``p0`` fail their loads by the backend's ``timeout_s`` and recompute.
No request fails; once the link is back its ``/health`` answers and the proxy
puts it back. Everything is stopped by PID, and no process may be left in any
host. Needs root and iproute2: skipped, saying why, otherwise.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvmux.demo.run import stop_all
from kvmux.demo.servers import VllmServer
from kvmux.models import tiny_model
from kvmux.testing import netns
from netns_support import NEEDS_NETNS, netns_backends
from vllm_e2e_support import installed
from xpyd_support import (
    SPEC,
    Xpyd,
    ask_through_a_prefill_fault,
    check_answers_equal_one_instance_and_every_server_is_used,
    decode_args,
    group_alive,
    prefill_args,
    wait_for,
)

pytestmark = NEEDS_NETNS

PROXY_PORT = 8000
UNREACHABLE_AFTER_S = 3.0
LOAD_TIMEOUT_S = 8.0
"""The backend's ``timeout_s``: a decode pulling from the cut host gives up then."""
BREAKER_COOLDOWN_S = 1.0


BACKENDS: dict[str, dict[str, Any]] = {
    name: config
    for name, config in netns_backends(LOAD_TIMEOUT_S, BREAKER_COOLDOWN_S).items()
    if name != "mooncake"
}
"""``shm-then-tcp``: every decode's shm child refuses the prefill on another host
per key at once and the tcp child serves; its breaker, should the cut's
failures open it, lets the healthy tcp child through again after the cooldown."""
BACKEND_ENV: dict[str, dict[str, str]] = {"nixl": {"UCX_TLS": "tcp,self"}}
"""NIXL between hosts: UCX over TCP (its same-host transports would find the
other namespace on this kernel and bypass the network)."""


@dataclass
class Hosts:
    net: netns.Topology
    prefill: list[VllmServer]
    decode: list[VllmServer]
    client: Xpyd


def _server(
    host: netns.Host, name: str, args: list[str], log_dir: Path, env: dict[str, str]
) -> VllmServer:
    return VllmServer(
        name,
        tiny_model(SPEC),
        args,
        log_dir=log_dir,
        env=env,
        host=host.address,
        prefix=host.command([]),
    )


@pytest.fixture(
    scope="module",
    params=[
        "tcp",
        pytest.param("nixl", marks=pytest.mark.skipif(not installed("nixl"), reason="no nixl")),
        "shm-then-tcp",
    ],
)
def hosts(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Hosts]:
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    name = request.param
    backend = BACKENDS[name]
    env = BACKEND_ENV.get(name, {})
    log_dir = tmp_path_factory.mktemp(f"xpyd-netns-{name}-logs")
    with netns.topology("proxy", "p0", "p1", "d0", "d1") as net:
        prefill = [
            _server(net[f"p{i}"], f"prefill-{i}", prefill_args(**backend), log_dir, env)
            for i in range(2)
        ]
        decode = [
            _server(net[f"d{i}"], f"decode-{i}", decode_args(**backend), log_dir, env)
            for i in range(2)
        ]
        servers = [*prefill, *decode]
        front = net["proxy"]
        try:
            for server in servers:
                server.start()
            with front.entered():
                for server in servers:
                    server.wait_ready(600)
            argv = [sys.executable, "-m", "kvmux.cli.main", "proxy", "--host", front.address]
            argv += ["--port", str(PROXY_PORT), "--timeout-s", "180", "--probe-interval-s", "0.5"]
            argv += ["--unreachable-after-s", str(UNREACHABLE_AFTER_S)]
            for role, role_servers in (("prefill", prefill), ("decode", decode)):
                argv += [arg for s in role_servers for arg in (f"--{role}", s.url)]
            with front.serve(argv, PROXY_PORT, start_s=60):
                client = Xpyd(
                    [s.url for s in prefill],
                    [s.url for s in decode],
                    f"http://{front.address}:{PROXY_PORT}",
                    network=front.entered,
                )
                yield Hosts(net, prefill, decode, client)
        finally:
            for host in net.hosts.values():
                host.link_up()  # a failed test may have left one cut: stop_all needs no wire
            stop_all(servers)
        for server in servers:
            assert server.pid is None or not group_alive(server.pid), f"{server} still running"
        left = {name: host.pids() for name, host in net.hosts.items()}
        assert not any(left.values()), f"processes left in the hosts: {left}"


def test_xpyd_across_hosts_answers_equal_one_instance_and_every_server_is_used(
    hosts: Hosts,
) -> None:
    addresses = {u.split("//")[1].split(":")[0] for u in hosts.client.prefill_urls}
    addresses |= {u.split("//")[1].split(":")[0] for u in hosts.client.decode_urls}
    assert addresses == {hosts.net[n].address for n in ("p0", "p1", "d0", "d1")}
    check_answers_equal_one_instance_and_every_server_is_used(hosts.client, seed=900)


def test_a_prefill_host_whose_link_is_cut_is_taken_out_and_put_back_once_it_is_up(
    hosts: Hosts,
) -> None:
    client = hosts.client
    victim = client.prefill_urls[0]
    try:
        outage = ask_through_a_prefill_fault(
            client, victim, hosts.net["p0"].link_down, seed=1000, fault_name="cut"
        )
    finally:
        hosts.net["p0"].link_up()
    slowest = outage.slowest_after_s
    assert slowest < 60, f"{slowest:.1f} s: waited for the proxy's deadline (180 s)"
    up_at = time.monotonic()
    wait_for(lambda: client.stats()["prefill"][victim]["in_rotation"], 30)
    print(
        f"\n{outage.done_before} of 8 answered before the cut, none failed; slowest after "
        f"it {slowest:.1f} s; p0 out because "
        f"{outage.victim['last_problem']!r}; back in rotation {time.monotonic() - up_at:.2f} s "
        "after its link came up"
    )
    again = [client.ask(p) for p in outage.prompts[8:]]
    assert [a.token_ids for a in again] == outage.references[8:]
    assert victim in {a.prefill for a in again}, "the healed prefill got no request"
