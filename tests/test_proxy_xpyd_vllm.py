"""``kvmux proxy`` in front of two prefill and two decode real vLLM servers (2P2D, tcp).

Four server starts are the expensive part, so one cluster serves the module
and its tests run in order on it: answers equal a single instance's and every
server gets work; then one prefill is killed with SIGKILL while two clients
keep sending requests, which all still succeed (it is taken out of rotation,
and both decodes pull from the prefill that is left); then it is restarted on
the same port and put back. The servers, the client and the checks are
:mod:`xpyd_support`'s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmux.demo.run import stop_all
from kvmux.demo.servers import ProxyThread, VllmServer
from kvmux.models import tiny_model
from xpyd_support import (
    SPEC,
    Xpyd,
    ask_through_a_prefill_fault,
    check_answers_equal_one_instance_and_every_server_is_used,
    decode_args,
    group_alive,
    prefill_args,
    prompts_of,
    wait_for,
)

pytestmark = pytest.mark.timeout(900)


@dataclass
class Loopback:
    """The four servers (a restarted prefill replaces one) and the client of the proxy."""

    prefill: list[VllmServer]
    decode: list[VllmServer]
    client: Xpyd
    log_dir: Path
    model_dir: Path


def _prefill_server(model_dir: Path, log_dir: Path, name: str, port: int | None) -> VllmServer:
    return VllmServer(name, model_dir, prefill_args(), log_dir=log_dir, port=port)


@pytest.fixture(scope="module")
def xpyd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loopback]:
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    from kvmux.proxy import ProxyConfig

    log_dir = tmp_path_factory.mktemp("xpyd-logs")
    model_dir = tiny_model(SPEC)
    prefill = [_prefill_server(model_dir, log_dir, f"prefill-{i}", None) for i in range(2)]
    decode = [
        VllmServer(f"decode-{i}", model_dir, decode_args(), log_dir=log_dir) for i in range(2)
    ]
    servers = [*prefill, *decode]
    proxy: ProxyThread | None = None
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        config = ProxyConfig(
            prefill=[s.url for s in prefill],
            decode=[s.url for s in decode],
            port=0,
            timeout_s=180,
            probe_interval_s=0.5,
        )
        proxy = ProxyThread(config)
        client = Xpyd(config.prefill, config.decode, proxy.start())
        cluster = Loopback(prefill, decode, client, log_dir, model_dir)
        yield cluster
        servers = [*cluster.prefill, *cluster.decode]  # a restarted prefill replaced one
    finally:
        if proxy is not None:
            proxy.stop()
        stop_all(servers)
    for server in servers:
        assert server.pid is None or not group_alive(server.pid), f"{server} still running"


def test_xpyd_answers_equal_one_instance_and_every_server_is_used(xpyd: Loopback) -> None:
    check_answers_equal_one_instance_and_every_server_is_used(xpyd.client, seed=500)


def test_xpyd_same_prompt_goes_back_to_the_servers_that_hold_its_prefix(xpyd: Loopback) -> None:
    (prompt,) = prompts_of(1, seed=600)
    first, again = xpyd.client.ask(prompt), xpyd.client.ask(prompt)
    assert (again.prefill, again.decode) == (first.prefill, first.decode)
    assert again.token_ids == first.token_ids == xpyd.client.reference(prompt)


def test_xpyd_a_killed_prefill_is_taken_out_and_put_back_once_restarted(xpyd: Loopback) -> None:
    victim = xpyd.prefill[0]

    def kill() -> None:
        assert victim.pid is not None
        os.killpg(victim.pid, signal.SIGKILL)  # the whole server: API process and engine

    outage = ask_through_a_prefill_fault(xpyd.client, victim.url, kill, seed=700, fault_name="kill")
    victim.stop(grace_s=5)  # reaps it; its group is gone already

    reborn = _prefill_server(xpyd.model_dir, xpyd.log_dir, "prefill-0-restarted", victim.port)
    xpyd.prefill[0] = reborn
    reborn.start().wait_ready(600)
    healthy_at = time.monotonic()
    wait_for(lambda: xpyd.client.stats()["prefill"][reborn.url]["in_rotation"], 30)
    print(
        f"\n{outage.done_before} of 8 answered before the kill, none failed; "
        f"{outage.victim['sent']} requests sent to the killed prefill in all; "
        f"restarted one back in rotation {time.monotonic() - healthy_at:.2f} s after its "
        f"/health answered (probe interval 0.5 s)"
    )
    again = [xpyd.client.ask(p) for p in outage.prompts[8:]]
    assert [a.token_ids for a in again] == outage.references[8:]
    assert reborn.url in {a.prefill for a in again}, "the restarted prefill got no request"
