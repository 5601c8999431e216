"""What the vLLM-across-hosts tests share: the backends, a prefill and a decode
engine each in its own host, and the cut-while-loading and heal steps."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvmux.testing import netns
from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, prefill, spec, tokens

NEEDS_NETNS = [
    pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
    pytest.mark.timeout(900),
]
"""The marks of a module of these tests: root and iproute2 (an honest skip), and
time for engines to start on a loaded machine."""
TIMEOUT_S = 8.0
SLACK_S = 6.0
"""On top of timeout_s and computing the prompts: a loaded 2-core machine."""
BREAKER_COOLDOWN_S = 1.0
SLOW_MBIT = 4
"""The cut test's link: the prompts' KV (about 1.2 MiB) takes a few seconds on it."""
HEAL_S = 60.0
"""How long a healed link may take to carry a whole P/D again: connections that
saw the cut resume at their next TCP retransmission, seconds after ``link_up``."""


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

    def compute_seconds(self, reference: list[list[int]]) -> float:
        """How long the decode takes to compute the prompts itself (no loads): what a
        recompute after a failed load adds on this machine now."""
        assert self.consumer.call("reset_prefix_cache")["ok"]
        started = time.monotonic()
        assert tokens(self.consumer.generate(PROMPTS, MAX_TOKENS)) == reference
        took = time.monotonic() - started
        assert self.consumer.call("reset_prefix_cache")["ok"]
        return took


def netns_backends(timeout_s: float, cooldown_s: float) -> dict[str, dict[str, Any]]:
    """The peer-to-peer backends, each binding ``0.0.0.0`` and advertising its 10.x
    address. ``shm-then-tcp``: shm refuses the other host per key, the tcp child
    serves; its breaker opens on the failures of a cut and lets the (healthy) tcp
    child through again once ``cooldown_s`` has passed."""

    def served(backend: str) -> dict[str, Any]:
        return {"backend": backend, "host": "0.0.0.0", "timeout_s": timeout_s}

    return {
        "tcp": served("tcp"),
        "nixl": served("nixl"),
        "mooncake": served("mooncake"),
        "shm-then-tcp": {
            "backend": "multi",
            "policy": "fallback",
            "timeout_s": timeout_s,
            "children": [served("shm"), served("tcp")],
            "breaker": {"cooldown_s": cooldown_s},
        },
    }


@contextlib.contextmanager
def pd_across(
    net: netns.Topology, model: str, backend: dict[str, Any], env: dict[str, str] | None = None
) -> Iterator[Hosts]:
    """The prefill engine in host ``p``, the decode in ``d``, started together and
    ready; both stopped by PID at the end."""
    env = env or {}
    producer = EngineProcess(
        spec(model, backend, "kv_producer", env=env), wait=False, prefix=net["p"].command([])
    )
    consumer = EngineProcess(
        spec(model, backend, "kv_consumer", env=env), wait=False, prefix=net["d"].command([])
    )
    try:
        producer.wait_ready()
        consumer.wait_ready()
        yield Hosts(net, producer, consumer)
    finally:
        producer.stop()
        consumer.stop()


def _decode_with_a_link_cut(
    hosts: Hosts, cut: str, params: list[dict[str, Any]]
) -> tuple[list[list[int]], float]:
    """The decode of ``params`` over a slowed link, host ``cut``'s wire cut one
    second into it; the link is back and plain when this returns. The tokens and
    how long the decode took."""
    hosts.shape(SLOW_MBIT)
    cutter = threading.Timer(1.0, hosts.net[cut].link_down)
    try:
        started = time.monotonic()
        cutter.start()
        decoded = hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)
        took = time.monotonic() - started
    finally:
        cutter.cancel()
        cutter.join()
        hosts.net[cut].link_up()
        hosts.shape(None)
    return tokens(decoded), took


def a_cut_while_loading_recomputes(hosts: Hosts, cut: str, reference: list[list[int]]) -> float:
    """Prefill, then decode over a slowed link with host ``cut``'s wire cut one
    second into the loads: some loads fail, the tokens are a single instance's,
    and the decode ends within its deadline plus a recompute. How long it took."""
    compute_s = hosts.compute_seconds(reference)
    params = prefill(hosts.producer)
    before = hosts.stats()
    decoded, took = _decode_with_a_link_cut(hosts, cut, params)
    after = hosts.stats()
    print(f"\nhost {cut}'s link cut while loading: decode {took:.2f} s (timeout_s={TIMEOUT_S})")
    assert decoded == reference
    assert after.get("load_blocks_failed", 0) > before.get("load_blocks_failed", 0)
    assert took < TIMEOUT_S + compute_s + SLACK_S
    return took


def wait_reachable(hosts: Hosts, target: str, port: int, within_s: float) -> float:
    """Block until a new connection from hosts ``p`` and ``d`` to ``target``'s port
    succeeds (the healed wire carries packets again); the seconds it took."""
    started = time.monotonic()
    address = hosts.net[target].address
    for name in ("p", "d"):
        with hosts.net[name].entered():
            while True:
                try:
                    socket.create_connection((address, port), timeout=0.5).close()
                    break
                except OSError:
                    assert time.monotonic() - started < within_s, f"{name} cannot reach {target}"
                    time.sleep(0.1)
    return time.monotonic() - started


def loads_every_block_again(hosts: Hosts, reference: list[list[int]], within_s: float) -> int:
    """P/D after a heal, repeated until the decode loads every block or ``within_s``
    has passed (connections that saw the cut resume at their next retransmission);
    the tokens are right every time. How many P/D rounds it took."""
    until = time.monotonic() + within_s
    rounds = 0
    while True:
        rounds += 1
        assert hosts.consumer.call("reset_prefix_cache")["ok"]
        params = prefill(hosts.producer)
        before = hosts.stats()
        assert tokens(hosts.consumer.generate(PROMPTS, MAX_TOKENS, params)) == reference
        after = hosts.stats()
        loaded = after["load_blocks_ok"] - before.get("load_blocks_ok", 0)
        if loaded == LOADED_BLOCKS or time.monotonic() >= until:
            assert loaded == LOADED_BLOCKS, f"{loaded} of {LOADED_BLOCKS} after {rounds} rounds"
            assert after.get("load_blocks_failed", 0) == before.get("load_blocks_failed", 0)
            return rounds
