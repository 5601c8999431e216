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
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing import netns
from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, installed, prefill, spec, tokens

pytestmark = [
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
    pytest.mark.timeout(900),
]

TIMEOUT_S = 8.0
SLACK_S = 6.0
"""On top of timeout_s and computing the prompts: a loaded 2-core machine."""
BREAKER_COOLDOWN_S = 1.0
SLOW_MBIT = 4
"""The cut test's link: the prompts' KV (about 1.2 MiB) takes a few seconds on it."""


class Hosts:
    """The topology and the engines of one backend."""

    def __init__(self, net: netns.Topology, producer: EngineProcess, consumer: EngineProcess):
        self.net, self.producer, self.consumer = net, producer, consumer

    def stats(self) -> dict[str, float]:
        stats: dict[str, float] = self.consumer.call("stats")["stats"]
        return stats

    def shape(self, rate_mbit: int | None) -> None:
        for host in self.net.hosts.values():
            if rate_mbit is None:
                host.clear_shaping()
            else:  # a small burst: the first MiB must not pass at line rate
                host.limit_rate(rate_mbit, burst_kib=96)


def _served(backend: str) -> dict[str, Any]:
    return {"backend": backend, "host": "0.0.0.0", "timeout_s": TIMEOUT_S}


BACKENDS = {
    "tcp": _served("tcp"),
    "nixl": _served("nixl"),
    "mooncake": _served("mooncake"),
    "shm-then-tcp": {
        "backend": "multi",
        "policy": "fallback",
        "timeout_s": TIMEOUT_S,
        "children": [_served("shm"), _served("tcp")],
        "breaker": {"cooldown_s": BREAKER_COOLDOWN_S},
    },
}
"""``shm-then-tcp``: shm refuses the other host per key, the tcp child serves. Its
breaker opens on the failures of the cut; it is let through again (the tcp
child is healthy) once the cooldown has passed."""


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
    backend = BACKENDS[request.param]
    env = {"UCX_TLS": "tcp,self"} if request.param == "nixl" else {}
    with netns.topology("p", "d") as net:
        producer = EngineProcess(
            spec(tiny_model_dir, backend, "kv_producer", env=env),
            wait=False,
            prefix=net["p"].command([]),
        )
        consumer = EngineProcess(
            spec(tiny_model_dir, backend, "kv_consumer", env=env),
            wait=False,
            prefix=net["d"].command([]),
        )
        try:
            producer.wait_ready()
            consumer.wait_ready()
            yield Hosts(net, producer, consumer)
        finally:
            producer.stop()
            consumer.stop()


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
    assert hosts.consumer.call("reset_prefix_cache")["ok"]
    started = time.monotonic()
    assert tokens(hosts.consumer.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
    compute_s = time.monotonic() - started
    assert hosts.consumer.call("reset_prefix_cache")["ok"]

    params = prefill(hosts.producer)
    before = hosts.stats()
    hosts.shape(SLOW_MBIT)
    cutter = threading.Timer(1.0, hosts.net["p"].link_down)
    try:
        started = time.monotonic()
        cutter.start()
        decoded = hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)
        took = time.monotonic() - started
    finally:
        cutter.cancel()
        cutter.join()
        hosts.net["p"].link_up()
        hosts.shape(None)
    after = hosts.stats()
    print(f"\nlink cut while loading: decode {took:.2f} s (timeout_s={TIMEOUT_S})")
    assert tokens(decoded) == vllm_reference
    assert after.get("load_blocks_failed", 0) > before.get("load_blocks_failed", 0)
    assert took < TIMEOUT_S + compute_s + SLACK_S

    time.sleep(BREAKER_COOLDOWN_S + 0.5)  # a multi's breaker lets the healed child through
    assert hosts.consumer.call("reset_prefix_cache")["ok"]
    params = prefill(hosts.producer)
    healed_before = hosts.stats()
    assert tokens(hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)) == vllm_reference
    healed = hosts.stats()
    assert healed["load_blocks_ok"] - healed_before["load_blocks_ok"] == LOADED_BLOCKS


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
