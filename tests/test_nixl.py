"""``nixl``: a producer's pool registered with a real NIXL agent; consumers READ it
straight into their KV memory, across OS processes."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("nixl")

from kvmux.backends.nixl import NixlBackend
from kvmux.connector import Connector
from kvmux.keys import chain_keys
from kvmux.registry import create_connector, entries
from kvmux.testing.configs import registry_factory
from kvmux.testing.cross_process import Consumer, CrossProcessTests, open_consumer
from kvmux.testing.harness import ConnectorFactory
from kvmux.testing.peer import PeerProcess, make_caches, make_layout
from kvmux.testing.suite import ConnectorSuite

from support import P2P_TIMEOUT_S, wait_until

CONFIG: dict[str, Any] = {
    "backend": "nixl",
    "timeout_s": P2P_TIMEOUT_S,
    "capacity_bytes": 4 * 2**20,
}


# ----------------------------------------------------------- conformance suite


class TestNixlConformance(ConnectorSuite):
    """The whole suite, built through the registry like every built-in."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("nixl", {"capacity_bytes": 8 * 2**20}, tmp_path)


class TestNixlBorrowingConformance(ConnectorSuite):
    """The whole suite with ``save_mode: borrow``: consumers READ the producer's KV memory."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("nixl", {"save_mode": "borrow"}, tmp_path)


# ------------------------------------------------------------ across processes


class TestNixlAcrossProcesses(CrossProcessTests):
    peer_config = CONFIG
    seed = 13

    def transfer_call(self, connector: Connector) -> tuple[object, str]:
        backend = connector.backend
        assert isinstance(backend, NixlBackend)
        return backend.transport.agent, "read"

    def test_a_producer_ends_a_vanished_consumers_pins_and_serves_the_next(
        self, producer: PeerProcess, expected: torch.Tensor
    ) -> None:
        """In process: a consumer that closes mid-pull leaves no pin behind."""
        n = self.blocks
        caches = make_caches(self.seed, n)
        owner = Consumer(create_connector(CONFIG), caches)
        try:
            owner.connector.register(make_layout(caches), caches)
            assert owner.connector.save(producer.keys, list(range(n))).result().ok
            quitter = self.open_consumer()
            quitter.connector.load(producer.keys, list(range(n)), owner.connector.address())
            quitter.connector.close()
            wait_until(lambda: owner.connector.stats()["nixl_leases"] == 0, P2P_TIMEOUT_S)
            fresh = self.open_consumer()
            try:
                result = fresh.load(producer.keys, list(range(n)), owner.connector.address())
                assert result.ok and torch.equal(fresh.blocks(range(n)), expected)
                wait_until(lambda: owner.connector.stats()["nixl_leases"] == 0, P2P_TIMEOUT_S)
            finally:
                fresh.connector.close()
        finally:
            owner.connector.close()


# ---------------------------------------------------------------- in process


def test_an_idle_agent_burns_no_core() -> None:
    """NIXL's own progress thread spins; ours sleeps while nobody holds a pin."""
    conn = open_consumer(CONFIG, num_blocks=4)
    try:
        time.sleep(0.2)
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(1.0)
        busy = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert busy < 0.2, f"idle connector used {busy:.0%} of a core"
    finally:
        conn.connector.close()


def test_a_stuck_consumers_pin_ends_at_lease_s_by_the_transport_alone() -> None:
    """A consumer that located blocks and then went silent (no READ, no unpin, its
    connection open) holds them ``lease_s``; the transport ends that pin, agent hold
    included, and the store's own reaper leaves it to the transport."""
    lease_s = 0.3
    owner = open_consumer({**CONFIG, "lease_s": lease_s}, num_blocks=4)
    try:
        keys = chain_keys(range(4 * 16), 16, "stuck")
        assert owner.connector.save(keys, [0, 1, 2, 3]).result().ok
        backend = owner.connector.backend
        assert isinstance(backend, NixlBackend)
        transport, store = backend.transport, backend.transport.store
        silent = SimpleNamespace(leases=set())
        with store.lock:
            rows = store.find_rows(keys)
            transport.pin(rows, silent)  # type: ignore[arg-type]
            store.slots.reap(time.monotonic() + 3600)
            assert store.slots.pinned == 4, "the store's reaper ended the transport's pin"
        assert owner.connector.stats()["nixl_leases"] == 1
        wait_until(lambda: owner.connector.stats()["nixl_leases"] == 0, lease_s + P2P_TIMEOUT_S)
        assert store.slots.pinned == 0 and not silent.leases
        assert transport.agent._holds == 0
    finally:
        owner.connector.close()


def test_listing_shows_nixl_available_here_and_the_hint_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = next(e for e in entries.scan("backends") if e.name == "nixl")
    assert entry.extras == ("nixl",)
    assert entry.unavailable_reason() is None
    real = entries._satisfied
    monkeypatch.setattr(
        entries, "_satisfied", lambda req: not req.name.startswith("nixl") and real(req)
    )
    reason = entry.unavailable_reason() or ""
    assert "nixl==1.5.1" in reason and "pip install 'kvmux[nixl]'" in reason
