"""``mooncake`` (Transfer Engine, P2P) and ``mooncake-store`` (Mooncake Store as a
LookupBuffer) with the real ``mooncake`` package, across OS processes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("mooncake")

from kvmux.backends.mooncake import MooncakeBackend
from kvmux.buffers.mooncake_store import MooncakeStoreBuffer, MooncakeStoreConfig, close_clients
from kvmux.connector import Connector
from kvmux.errors import ClosedError, TransferError, TransferTimeout
from kvmux.keys import chain_keys
from kvmux.net.mooncake_engine import MooncakeEngine
from kvmux.registry import create_connector, entries
from kvmux.testing.configs import registry_factory
from kvmux.testing.cross_process import Consumer, CrossProcessTests, open_consumer
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

from support import P2P_TIMEOUT_S, free_port, run_master, wait_until

SEED = 17
N = 64
CONFIG: dict[str, Any] = {
    "backend": "mooncake",
    "timeout_s": P2P_TIMEOUT_S,
    "capacity_bytes": 4 * 2**20,
}


# ------------------------------------------------------------- mooncake (P2P)


class TestMooncakeConformance(ConnectorSuite):
    """The whole suite, built through the registry like every built-in."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("mooncake", {"capacity_bytes": 8 * 2**20}, tmp_path)


class TestMooncakeBorrowingConformance(ConnectorSuite):
    """The whole suite with ``save_mode: borrow``: consumers READ the producer's KV memory."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("mooncake", {"save_mode": "borrow"}, tmp_path)


class TestMooncakeAcrossProcesses(CrossProcessTests):
    peer_config = CONFIG
    blocks = N
    seed = SEED

    def transfer_call(self, connector: Connector) -> tuple[object, str]:
        backend = connector.backend
        assert isinstance(backend, MooncakeBackend)
        return backend.transport.engine, "read"

    def test_a_read_larger_than_the_te_queue_is_split(
        self,
        producer: PeerProcess,
        consumer: Consumer,
        expected: torch.Tensor,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """More ranges than TE queues per peer would fail and break the engine: split them."""
        conn = consumer.connector.backend
        assert isinstance(conn, MooncakeBackend)
        calls: list[int] = []
        real = conn.transport.engine._engine.batch_transfer_sync_read

        class Counting:
            def batch_transfer_sync_read(self, peer: str, *ranges: list[int]) -> int:
                calls.append(len(ranges[0]))
                return int(real(peer, *ranges))

        monkeypatch.setattr(conn.transport.engine, "max_batch", 10)
        monkeypatch.setattr(conn.transport.engine, "_engine", Counting())
        dst = torch.randperm(N, generator=torch.Generator().manual_seed(3)).tolist()
        result = consumer.load(producer.keys, dst, producer.address)
        assert result.ok, result.not_ok[:2]
        assert torch.equal(consumer.blocks(dst), expected)
        assert max(calls) <= 10 and sum(calls) >= N


def test_thousands_of_small_blocks_in_one_batch() -> None:
    """4096 16 KiB blocks scattered: TE's default queue would fail this batch."""
    n = 4096
    caches = make_caches(SEED, n)
    slow_ok = {"timeout_s": 20.0}  # 64 MiB over loopback TCP on a shared 2-core machine
    owner = create_connector({**CONFIG, **slow_ok, "capacity_bytes": 2 * n * 16384})
    big = open_consumer({**CONFIG, **slow_ok}, num_blocks=n)
    try:
        owner.register(make_layout(caches), caches)
        keys = chain_keys(list(range(n * 16)), 16, "many")
        assert owner.save(keys, list(range(n))).result().ok
        dst = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        result = big.load(keys, dst, owner.address(), bound_s=30)
        assert result.ok, result.not_ok[:2]
        assert torch.equal(big.blocks(dst), block_bytes(caches, range(n)))
    finally:
        big.connector.close()
        owner.close()


def test_pins_end_after_a_load() -> None:
    caches = make_caches(SEED, 8)
    owner = create_connector(CONFIG)
    reader = open_consumer(CONFIG, num_blocks=8)
    try:
        owner.register(make_layout(caches), caches)
        keys = chain_keys(list(range(8 * 16)), 16, "pins")
        assert owner.save(keys, list(range(8))).result().ok
        assert reader.load(keys, list(range(8)), owner.address()).ok
        deadline = time.monotonic() + P2P_TIMEOUT_S
        while owner.stats()["mooncake_pinned_slots"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert owner.stats()["mooncake_pinned_slots"] == 0
    finally:
        reader.connector.close()
        owner.close()


def test_a_read_abandoned_at_its_deadline_stops_competing_for_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TE's synchronous read busy-polls until its bytes come and cannot be cancelled:
    once the caller stops waiting, its thread may run only on an idle core
    (SCHED_IDLE), or pollers on a cut link starve the engine recomputing their
    blocks (a vLLM decode across hosts, 2 cores: recompute 0.07 s became 0.54 s,
    on a busier box it ran past the test's deadline)."""
    engine = MooncakeEngine("127.0.0.1", "tcp", "", 8192)
    stuck, release = threading.Event(), threading.Event()
    policies: list[int] = []

    class Polling:
        def batch_transfer_sync_read(self, peer: str, *ranges: list[int]) -> int:
            stuck.set()
            release.wait(10.0)
            policies.append(os.sched_getscheduler(0))
            return 0

    monkeypatch.setattr(engine, "_engine", Polling())
    try:
        with pytest.raises(TransferTimeout):
            engine.read("127.0.0.1:1", [0], [0], [1], timeout_s=0.3)
        assert stuck.is_set()
    finally:
        release.set()
    wait_until(lambda: bool(policies), 5.0)
    assert policies == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the caller keeps its own priority"


def test_an_abandoned_read_keeps_its_destination_memory_alive_until_te_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TE writes by address: a read abandoned at its deadline that completes later
    (a frozen peer resumed, a cut link back) must find its destination still
    allocated, not freed and handed to someone else."""
    engine = MooncakeEngine("127.0.0.1", "tcp", "", 8192)
    stuck, release, returned = threading.Event(), threading.Event(), threading.Event()

    class Late:
        def batch_transfer_sync_read(self, peer: str, *ranges: list[int]) -> int:
            stuck.set()
            release.wait(10.0)
            returned.set()
            return 0

    monkeypatch.setattr(engine, "_engine", Late())
    kv = torch.zeros(16)
    alive = weakref.ref(kv)
    try:
        with pytest.raises(TransferTimeout):
            engine.read("127.0.0.1:1", [kv.data_ptr()], [0], [64], timeout_s=0.3, keep=kv)
        del kv
        gc.collect()
        assert stuck.is_set() and alive() is not None, "freed while TE may still write"
    finally:
        release.set()
    wait_until(returned.is_set, 5.0)
    wait_until(lambda: gc.collect() >= 0 and alive() is None, 5.0)  # then let go


def test_two_connectors_of_a_process_may_register_the_same_kv() -> None:
    """TE refuses a second registration of the same memory; the shared engine counts them."""
    caches = empty_caches(N)
    first, second = create_connector(CONFIG), create_connector(CONFIG)
    owner = create_connector(CONFIG)
    try:
        first.register(make_layout(caches), caches)
        second.register(make_layout(caches), caches)
        first.close()  # must not unregister the memory second still reads into
        src = make_caches(SEED, N)
        owner.register(make_layout(src), src)
        keys = chain_keys(list(range(N * 16)), 16, "shared-kv")
        assert owner.save(keys, list(range(N))).result().ok
        result = second.load(keys, list(range(N)), owner.address()).result(timeout=30)
        assert result.ok, result.not_ok[:2]
        assert torch.equal(block_bytes(caches, range(N)), block_bytes(src, range(N)))
    finally:
        for conn in (first, second, owner):
            conn.close()


def test_listing_shows_both_entries_with_the_mooncake_extra() -> None:
    found = {(e.group, e.name): e for g in ("backends", "buffers") for e in entries.scan(g)}
    for key in (("backends", "mooncake"), ("buffers", "mooncake-store")):
        assert found[key].extras == ("mooncake",)
        assert found[key].unavailable_reason() is None


# ------------------------------------------------------ mooncake-store (buffer)


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    with run_master() as (address, _):
        yield address
        close_clients(address)  # before the master goes: else exit waits on dead clients


def store_config(master: str, tag: str) -> dict[str, Any]:
    return {
        "master_address": master,
        "global_segment_bytes": 16 * 2**20,
        "local_buffer_bytes": 16 * 2**20,
        "key_prefix": f"kvmux-test/{tag}/",
    }


class TestMooncakeStoreConformance(ConnectorSuite):
    """The whole suite on the store, through the registry (BufferBackend)."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path, master: str) -> ConnectorFactory:
        return registry_factory(
            "buffers:mooncake-store", store_config(master, tmp_path.name), tmp_path
        )


def test_store_blocks_cross_processes_byte_exact(master: str) -> None:
    config = {"backend": "buffers:mooncake-store", **store_config(master, "xproc")}
    with spawn_peer(config, N, SEED) as writer:
        reader = create_connector(config)
        try:
            caches = empty_caches(N)
            reader.register(make_layout(caches), caches)
            assert reader.lookup(writer.keys) == N
            result = reader.load(writer.keys, list(range(N))).result(timeout=30)
            assert result.ok, result.not_ok[:2]
            expected = block_bytes(make_caches(SEED, N), range(N))
            assert torch.equal(block_bytes(caches, range(N)), expected)
            assert reader.lookup(writer.keys) == 0  # consumed
        finally:
            reader.close()


def test_a_stored_value_lives_in_its_writers_segment(master: str) -> None:
    # With another client's segment mounted (the peer process), the master would
    # place about half the values there; the writer asks for its own.
    config = {"backend": "buffers:mooncake-store", **store_config(master, "placement")}
    with spawn_peer(config, 2, SEED):
        buffer = MooncakeStoreBuffer(MooncakeStoreConfig(**store_config(master, "placement")))
        keys = chain_keys(range(12 * 16), 16, "placement")
        for i, key in enumerate(keys):
            buffer.insert(key, torch.full((4096,), i, dtype=torch.uint8))
        endpoints = {
            replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for key in keys
            for replica in buffer._store.get_replica_desc(buffer._name(key))
        }
        assert len(endpoints) == 1, endpoints
    for i, key in enumerate(keys):  # the peer and its segment are gone; ours holds them
        got = buffer.drop_select(key, timeout=5)
        assert got is not None and torch.equal(got, torch.full((4096,), i, dtype=torch.uint8))
    buffer.close()


HEALTH_CHILD = """
import json, os, signal, sys
from kvmux.buffers.mooncake_store import MooncakeStoreBuffer, MooncakeStoreConfig, close_clients
buffer = MooncakeStoreBuffer(MooncakeStoreConfig(**json.loads(sys.argv[1])))
before = buffer.health()
os.kill(int(sys.argv[2]), signal.SIGKILL)
after = buffer.health()
print(json.dumps([before.healthy, after.healthy, after.detail]), flush=True)
os._exit(0)  # a client whose master is gone makes a normal exit wait 10-30 s
"""


def test_store_health_tracks_the_master() -> None:
    """In a child process that kills the master: the dead client stays there."""
    with run_master() as (address, proc):
        config = json.dumps(store_config(address, "health"))
        child = subprocess.run(
            [sys.executable, "-c", HEALTH_CHILD, config, str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr[-2000:]
        before, after, detail = json.loads(child.stdout.strip().splitlines()[-1])
        assert before and not after and address in detail


def test_a_closed_store_buffer_is_unhealthy_and_refuses_calls(master: str) -> None:
    buffer = MooncakeStoreBuffer(MooncakeStoreConfig(**store_config(master, "closed")))
    assert buffer.health().healthy
    buffer.close()
    assert not buffer.health().healthy
    with pytest.raises(ClosedError):
        buffer.contains(chain_keys(list(range(16)), 16, "x")[0])


def test_master_down_is_a_clear_error_at_creation() -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(TransferError, match=r"master .* is unreachable"):
        create_connector(
            {
                "backend": "buffers:mooncake-store",
                "timeout_s": 2.0,
                "master_address": f"127.0.0.1:{port}",
            }
        )
    assert time.monotonic() - start < 3
