"""vLLM P/D with the prefill and the decode on separate hosts (network namespaces).

One topology and one prefill/decode pair per backend serve the module: the
prefill engine runs in host ``p``, the decode in host ``d``; the backend binds
``0.0.0.0`` and advertises its 10.x address, which reaches the decode through
the prefill's ``kv_transfer_params``. Then the wire is cut while the decode
loads (the load fails at its deadline, vLLM recomputes, the tokens are right)
and the link is slowed (the tokens are right, in bounded time). Needs root and
iproute2: skipped, saying why, otherwise.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing import netns
from netns_support import (
    BREAKER_COOLDOWN_S,
    NEEDS_NETNS,
    TIMEOUT_S,
    Hosts,
    a_cut_while_loading_recomputes,
    loads_every_block_again,
    netns_backends,
    pd_across,
)
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, installed, prefill, tokens

pytestmark = NEEDS_NETNS

BACKENDS = netns_backends(TIMEOUT_S, BREAKER_COOLDOWN_S)


@pytest.fixture(
    scope="module",
    params=[
        "tcp",
        pytest.param("nixl", marks=pytest.mark.skipif(not installed("nixl"), reason="no nixl")),
        pytest.param(
            "mooncake", marks=pytest.mark.skipif(not installed("mooncake"), reason="no mooncake")
        ),
        "shm-then-tcp",
    ],
)
def hosts(request: Any, tiny_model_dir: str) -> Iterator[Hosts]:
    env = {"UCX_TLS": "tcp,self"} if request.param == "nixl" else {}
    with (
        netns.topology("p", "d") as net,
        pd_across(net, tiny_model_dir, BACKENDS[request.param], env) as hosts,
    ):
        yield hosts


def test_pd_across_hosts_matches_a_single_instance(
    hosts: Hosts, vllm_reference: list[list[int]]
) -> None:
    params = prefill(hosts.producer)
    assert all(hosts.net["p"].address in json.dumps(p) for p in params), params
    before = hosts.stats()
    started = time.monotonic()
    decoded = hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)
    print(f"\nP/D across hosts: decode with loads {time.monotonic() - started:.2f} s")
    after = hosts.stats()
    assert tokens(decoded) == vllm_reference
    assert after["load_blocks_ok"] - before.get("load_blocks_ok", 0) == LOADED_BLOCKS
    assert after.get("load_blocks_failed", 0) == before.get("load_blocks_failed", 0)


def test_a_link_cut_while_decode_loads_recomputes_by_the_deadline(
    hosts: Hosts, vllm_reference: list[list[int]]
) -> None:
    """The link is slowed so the loads take seconds, then cut one second into the
    decode: the loads fail by their deadline, vLLM recomputes, the tokens are a
    single instance's; with the link back, the next P/D loads every block."""
    a_cut_while_loading_recomputes(hosts, "p", vllm_reference)

    time.sleep(BREAKER_COOLDOWN_S + 0.5)  # a multi's breaker lets the healed child through
    loads_every_block_again(hosts, vllm_reference, within_s=0)


def test_a_slow_link_gives_the_right_tokens_in_bounded_time(
    hosts: Hosts, vllm_reference: list[list[int]]
) -> None:
    """100 Mbit each way (tc tbf; netem delay where the kernel has it)."""
    assert hosts.consumer.call("reset_prefix_cache")["ok"]
    params = prefill(hosts.producer)
    before = hosts.stats()
    delay = netns.netem_unavailable() is None
    for host in hosts.net.hosts.values():
        if delay:
            host.netem(delay_us=100, rate_mbit=100)
        else:
            host.limit_rate(100)
    try:
        started = time.monotonic()
        decoded = hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)
        took = time.monotonic() - started
    finally:
        hosts.shape(None)
    shaping = "netem 100 us + 100 Mbit" if delay else "tbf 100 Mbit"
    print(f"\nP/D over {shaping}: decode with loads {took:.2f} s")
    after = hosts.stats()
    assert tokens(decoded) == vllm_reference
    assert after["load_blocks_ok"] - before["load_blocks_ok"] == LOADED_BLOCKS
    assert took < TIMEOUT_S
