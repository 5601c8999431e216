"""``nixl``: a producer's pool registered with a real NIXL agent; consumers READ it
straight into their KV memory, across OS processes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

from kvmux.backends.nixl import NixlBackend
from kvmux.keys import chain_keys
from kvmux.registry import create_connector, entries
from kvmux.testing.configs import registry_factory
from kvmux.testing.harness import ConnectorFactory
from kvmux.testing.peer import (
    PeerProcess,
    block_bytes,
    empty_caches,
    make_caches,
    make_layout,
    spawn_peer,
)
from kvmux.testing.suite import ConnectorSuite

from support import P2P_TIMEOUT_S, Consumer, statuses, wait_until

SEED = 13
N = 64
POOL_BYTES = 4 * 2**20
CONFIG: dict[str, Any] = {
    "backend": "nixl",
    "timeout_s": P2P_TIMEOUT_S,
    "capacity_bytes": POOL_BYTES,
}


def open_consumer(num_blocks: int = 2 * N, layout: str = "small", **config: Any) -> Consumer:
    connector = create_connector({**CONFIG, **config})
    caches = empty_caches(num_blocks, layout)
    connector.register(make_layout(caches), caches)
    return Consumer(connector, caches)


@pytest.fixture(scope="module")
def producer() -> Iterator[PeerProcess]:
    with spawn_peer(CONFIG, N, SEED) as peer:
        yield peer


@pytest.fixture(scope="module")
def expected() -> torch.Tensor:
    return block_bytes(make_caches(SEED, N), range(N))


@pytest.fixture
def consumer() -> Iterator[Consumer]:
    c = open_consumer()
    yield c
    c.connector.close()


# ----------------------------------------------------------- conformance suite


class TestNixlConformance(ConnectorSuite):
    """The whole suite, built through the registry like every built-in."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("nixl", {"capacity_bytes": 8 * 2**20}, tmp_path)


# ------------------------------------------------------------ across processes


def test_blocks_from_another_process_arrive_byte_exact(
    producer: PeerProcess, consumer: Consumer, expected: torch.Tensor
) -> None:
    dst = list(range(2 * N - 1, N - 1, -1))
    result = consumer.load(producer.keys, dst, producer.address)
    assert result.ok, result.not_ok[:2]
    assert result.nbytes == N * consumer.connector.copier.block_nbytes
    assert torch.equal(consumer.blocks(dst), expected)
    again = consumer.load(producer.keys[:8], list(range(8)), producer.address)
    assert again.ok and torch.equal(consumer.blocks(range(8)), expected[:8])
    assert consumer.connector.lookup(producer.keys, producer.address) == N


def test_unknown_keys_are_missing_and_leave_their_blocks_untouched(
    producer: PeerProcess, consumer: Consumer, expected: torch.Tensor
) -> None:
    unknown = chain_keys(list(range(64)), 16, "nobody-saved-this")
    keys = [unknown[0], producer.keys[3], unknown[1], producer.keys[4]]
    result = consumer.load(keys, [0, 1, 2, 3], producer.address)
    assert statuses(result) == ["missing", "ok", "missing", "ok"]
    assert torch.equal(consumer.blocks([1, 3]), expected[[3, 4]])
    assert not consumer.blocks([0, 2]).any()


def test_a_consumer_with_another_layout_is_refused_at_handshake(producer: PeerProcess) -> None:
    other = open_consumer(num_blocks=8, layout="other")
    try:
        result = other.load(producer.keys[:4], [0, 1, 2, 3], producer.address)
        assert statuses(result) == ["failed"] * 4
        reason = result.outcomes[0].reason or ""
        assert "LayoutError" in reason and "layout mismatch" in reason
        assert not other.blocks(range(4)).any()
    finally:
        other.connector.close()


@pytest.mark.parametrize("fate", ["killed", "stopped"])
def test_a_producer_dying_mid_transfer_fails_keys_within_timeout(
    fate: str, producer: PeerProcess, expected: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer pins the blocks and answers, then dies (SIGKILL) or freezes
    (SIGSTOP: alive, never progresses) just as the READ starts."""
    big = 1024
    consumer = open_consumer(num_blocks=big)
    conn = consumer.connector.backend
    assert isinstance(conn, NixlBackend)
    try:
        with spawn_peer({**CONFIG, "capacity_bytes": 20 * 2**20}, big, SEED) as doomed:
            real_read = conn.transport.agent.read

            def read_as_it_dies(*args: Any, **kwargs: Any) -> None:
                if fate == "killed":
                    doomed.kill()
                else:
                    os.kill(doomed.pid, signal.SIGSTOP)
                real_read(*args, **kwargs)

            monkeypatch.setattr(conn.transport.agent, "read", read_as_it_dies)
            start = time.monotonic()
            during = consumer.load(doomed.keys, list(range(big)), doomed.address)
            elapsed = time.monotonic() - start
            monkeypatch.undo()
            if fate == "stopped":
                os.kill(doomed.pid, signal.SIGCONT)
        assert elapsed < P2P_TIMEOUT_S + 1, elapsed
        assert statuses(during) == ["failed"] * big
        # The survivor loads from another producer at once.
        again = consumer.load(producer.keys, list(range(N)), producer.address)
        assert again.ok and torch.equal(consumer.blocks(range(N)), expected)
    finally:
        consumer.connector.close()


def test_a_producer_ends_a_vanished_consumers_pins_and_serves_the_next(
    producer: PeerProcess, expected: torch.Tensor
) -> None:
    """In process: a consumer that closes mid-pull leaves no pin behind."""
    caches = make_caches(SEED, N)
    owner = Consumer(create_connector(CONFIG), caches)
    try:
        owner.connector.register(make_layout(caches), caches)
        assert owner.connector.save(producer.keys, list(range(N))).result().ok
        quitter = open_consumer()
        quitter.connector.load(producer.keys, list(range(N)), owner.connector.address())
        quitter.connector.close()
        wait_until(lambda: owner.connector.stats()["nixl_leases"] == 0, P2P_TIMEOUT_S)
        fresh = open_consumer()
        try:
            result = fresh.load(producer.keys, list(range(N)), owner.connector.address())
            assert result.ok and torch.equal(fresh.blocks(range(N)), expected)
            wait_until(lambda: owner.connector.stats()["nixl_leases"] == 0, P2P_TIMEOUT_S)
        finally:
            fresh.connector.close()
    finally:
        owner.connector.close()


# ---------------------------------------------------------------- in process


def test_an_idle_agent_burns_no_core() -> None:
    """NIXL's own progress thread spins; ours sleeps while nobody holds a pin."""
    conn = open_consumer(num_blocks=4)
    try:
        time.sleep(0.2)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert busy < 0.2, f"idle connector used {busy:.0%} of a core"
    finally:
        conn.connector.close()


def test_listing_shows_nixl_available_here_and_the_hint_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = next(e for e in entries.scan("connectors") if e.name == "nixl")
    assert entry.extras == ("nixl",)
    assert entry.unavailable_reason() is None
    real = entries._satisfied
    monkeypatch.setattr(
        entries, "_satisfied", lambda req: not req.name.startswith("nixl") and real(req)
    )
    reason = entry.unavailable_reason() or ""
    assert "nixl==1.5.1" in reason and "pip install 'kvmux[nixl]'" in reason
