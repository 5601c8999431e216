"""vLLM P/D through a shared store, with the store, the prefill and the decode on
three separate hosts (network namespaces).

The store server runs in host ``store``, bound to its 10.x address: a
``mooncake_master`` for ``buffers:mooncake-store``, an ``lmcache_server`` for
``lmcache`` with ``remote_url: lm://...``. The prefill engine (host ``p``) and
the decode (host ``d``) both name that address; nothing reaches the decode
through ``kv_transfer_params`` but the request itself.

The link cut is the *store's* (host ``store``). For lmcache the bytes live on
the server, so the decode loses them. For Mooncake Store the bytes live in the
writer's segment (the prefill's client, host ``p``, read over the Transfer
Engine, which the P/D tests of ``test_vllm_netns.py`` already cut), while every
read first asks the master where the value is: cutting the store host is the
failure mode new here, a decode whose index stops answering mid-load. Either
way the loads fail by their deadline (kvmux bounds the clients' blocking
calls), vLLM recomputes, the tokens are right; with the link back the next P/D
loads every block. Needs root and iproute2: skipped, saying why, otherwise.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing import netns
from netns_support import (
    HEAL_S,
    NEEDS_NETNS,
    TIMEOUT_S,
    Hosts,
    a_cut_while_loading_recomputes,
    loads_every_block_again,
    pd_across,
    wait_reachable,
)
from vllm_e2e_support import installed

from support import MOONCAKE_MASTER

pytestmark = NEEDS_NETNS

PORT = 50051
"""The store server's port in its own host (a fresh namespace: always free)."""


def _server(kind: str, address: str) -> tuple[list[str], dict[str, Any]]:
    """The store server's command line in host ``store`` and the backend config
    that reaches it at ``address``."""
    if kind == "mooncake-store":
        argv = [
            str(MOONCAKE_MASTER),
            f"--rpc_address={address}",
            f"--rpc_port={PORT}",
            f"--metrics_host={address}",
            f"--metrics_port={PORT + 1}",
        ]
        backend = {
            "backend": "buffers:mooncake-store",
            "master_address": f"{address}:{PORT}",
            "global_segment_bytes": 32 * 2**20,
            "local_buffer_bytes": 32 * 2**20,
        }
    else:
        argv = [sys.executable, "-m", "lmcache.v1.server", address, str(PORT), "cpu"]
        backend = {
            "backend": "lmcache",
            "remote_url": f"lm://{address}:{PORT}",
            "max_local_cpu_gb": 0.25,
            "local_cpu": False,
        }
    return argv, {**backend, "timeout_s": TIMEOUT_S}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(
            "mooncake-store",
            marks=pytest.mark.skipif(not MOONCAKE_MASTER.exists(), reason="no mooncake_master"),
        ),
        pytest.param(
            "lmcache", marks=pytest.mark.skipif(not installed("lmcache"), reason="no lmcache")
        ),
    ],
)
def hosts(request: Any, tiny_model_dir: str) -> Iterator[Hosts]:
    with netns.topology("p", "d", "store") as net:
        argv, backend = _server(request.param, net["store"].address)
        with (
            net["store"].serve(argv, PORT, start_s=120),
            pd_across(net, tiny_model_dir, backend) as hosts,
        ):
            yield hosts


def test_pd_through_a_store_on_another_host_matches_a_single_instance(
    hosts: Hosts, vllm_reference: list[list[int]]
) -> None:
    loads_every_block_again(hosts, vllm_reference, within_s=0)


def test_the_stores_link_cut_while_decode_loads_recomputes_by_the_deadline(
    hosts: Hosts, vllm_reference: list[list[int]]
) -> None:
    """The links are slowed so the loads take seconds, then the store's is cut one
    second into the decode: the loads fail by their deadline, vLLM recomputes, the
    tokens are a single instance's; once the store answers new connections again,
    P/D loads every block (within HEAL_S: old connections resume at their next
    TCP retransmission)."""
    a_cut_while_loading_recomputes(hosts, "store", vllm_reference)

    reached = wait_reachable(hosts, "store", PORT, HEAL_S)
    rounds = loads_every_block_again(hosts, vllm_reference, within_s=HEAL_S)
    print(f"healed: store reachable after {reached:.2f} s, every block loaded in round {rounds}")
