"""``lmcache``: the real LMCache engine as kvmux storage, in every tier it offers
here (its CPU tier, a local disk, an ``lm://`` server, ``mooncakestore://``),
with the KV layout converted to LMCache's own ``KV_2LTD`` format."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lmcache")

from kvmux.backends.lmcache import LmcacheBackend
from kvmux.connector import Connector
from kvmux.errors import TransferError
from kvmux.keys import BlockKey, chain_keys
from kvmux.layout import KVLayout
from kvmux.registry import create_connector, entries
from kvmux.testing.configs import registry_factory
from kvmux.testing.cross_process import statuses
from kvmux.testing.harness import ConnectorFactory
from kvmux.testing.peer import block_bytes, empty_caches, make_caches, make_layout, spawn_peer
from kvmux.testing.suite import ConnectorSuite

from support import run_lmcache_server, run_master

pytestmark = pytest.mark.timeout(600)

SEED = 23
N = 24
SMALL = {"max_local_cpu_gb": 0.05}
"""LMCache zero-fills its whole host-memory pool at start: keep the tests' small."""


@pytest.fixture(scope="module")
def lm_server() -> Iterator[str]:
    with run_lmcache_server() as (url, _):
        yield url


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    pytest.importorskip("mooncake")
    with run_master() as (address, _):
        yield address


def mooncake_config(master: str) -> dict[str, Any]:
    return {**SMALL, "remote_url": f"mooncakestore://{master}"}


# ------------------------------------------------------------------ the suite


class TestLmcacheCpuConformance(ConnectorSuite):
    """LMCache's own host-memory tier."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        return registry_factory("lmcache", SMALL, tmp_path)


class TestLmcacheDiskConformance(ConnectorSuite):
    """LMCache's local disk tier alone (no CPU tier)."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> ConnectorFactory:
        config = {**SMALL, "local_cpu": False, "local_disk": str(tmp_path / "lmcache-disk")}
        return registry_factory("lmcache", config, tmp_path)


class TestLmcacheServerConformance(ConnectorSuite):
    """An ``lmcache_server`` behind the CPU tier: blocks outlive the connector."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path, lm_server: str) -> ConnectorFactory:
        return registry_factory("lmcache", {**SMALL, "remote_url": lm_server}, tmp_path)


class TestLmcacheMooncakeStoreConformance(ConnectorSuite):
    """Mooncake Store as LMCache's remote tier."""

    @pytest.fixture
    def connector_factory(self, tmp_path: Path, master: str) -> ConnectorFactory:
        return registry_factory("lmcache", mooncake_config(master), tmp_path)


# ----------------------------------------------------------- layout conversion

L, H, D, BS, NB = 3, 2, 4, 8, 6


def coded(kv: int, layer: int, token: int, head: int, dim: int, block: int) -> float:
    """A value naming its own position (exact in float32)."""
    return float((((((block * 2 + kv) * L + layer) * BS + token) * H + head) * D) + dim)


def expected_chunk(block: int) -> torch.Tensor:
    """LMCache's ``KV_2LTD`` chunk for ``block``, written out from its definition:
    ``[kv, layer, token, head * D + dim]``."""
    out = torch.empty(2, L, BS, H * D)
    for kv in range(2):
        for layer in range(L):
            for t in range(BS):
                for h in range(H):
                    for d in range(D):
                        out[kv, layer, t, h * D + d] = coded(kv, layer, t, h, d, block)
    return out


def vllm_gpu_caches() -> tuple[dict[str, torch.Tensor], KVLayout]:
    """vLLM's GPU layout ``[K/V, blocks, tokens, heads, dim]``, as the adapter declares it."""
    caches = {f"l{i}": torch.empty(2, NB, BS, H, D) for i in range(L)}
    for layer, t in enumerate(caches.values()):
        for kv, b, tok, h, d in torch.cartesian_prod(*map(torch.arange, t.shape)).tolist():
            t[kv, b, tok, h, d] = coded(kv, layer, tok, h, d, b)
    return caches, KVLayout.from_caches(caches, BS, block_dim=1, dims="KTHD")


def vllm_cpu_caches() -> tuple[dict[str, torch.Tensor], KVLayout]:
    """vLLM's CPU layout ``[blocks, heads, tokens, 2 x dim]`` (keys in the first
    half of each head's block), viewed the way the adapter registers it."""
    raw = {f"l{i}": torch.empty(NB, H, BS, 2 * D) for i in range(L)}
    for layer, t in enumerate(raw.values()):
        flat = t.view(NB, H, 2 * BS, D)  # vLLM's own reading: rows [0, BS) keys, then values
        for b, h, row, d in torch.cartesian_prod(*map(torch.arange, flat.shape)).tolist():
            flat[b, h, row, d] = coded(row // BS, layer, row % BS, h, d, b)
    views = {n: t.view(NB, H, 2, BS, D) for n, t in raw.items()}
    return views, KVLayout.from_caches(views, BS, block_dim=0, dims="HKTD")


@pytest.mark.parametrize("make", [vllm_gpu_caches, vllm_cpu_caches], ids=["gpu", "cpu"])
def test_stored_chunks_are_lmcache_kv_2ltd_whatever_the_engine_layout(make: Any) -> None:
    caches, layout = make()
    connector = create_connector({"backend": "lmcache", **SMALL})
    try:
        connector.register(layout, caches)
        keys = chain_keys(list(range(2 * BS)), BS, "conv")
        assert connector.save(keys, [4, 1]).result(30).ok
        backend = connector.backend
        assert isinstance(backend, LmcacheBackend)
        storage = backend._engine.storage_manager
        lmc_keys = backend._lmc_keys(keys)
        for key, block in zip(lmc_keys, [4, 1], strict=True):
            (obj,) = storage.batched_get([key])
            try:
                assert tuple(obj.tensor.shape) == (2, L, BS, H * D)
                assert torch.equal(obj.tensor, expected_chunk(block))
            finally:
                obj.ref_count_down()
        for t in caches.values():
            t.zero_()
        assert connector.load(keys, [0, 5]).result(30).ok
        again, _ = make()
        for name, t in caches.items():
            src = again[name].movedim(layout.layers[0].block_dim, 0)
            got = t.movedim(layout.layers[0].block_dim, 0)
            assert torch.equal(got[0], src[4]) and torch.equal(got[5], src[1])
    finally:
        connector.close()


def test_a_layer_with_another_shape_is_refused_at_register() -> None:
    caches = {"a": torch.zeros(4, 2, BS, H, D), "b": torch.zeros(4, 2, BS, H, 2 * D)}
    connector = create_connector({"backend": "lmcache", **SMALL})
    try:
        with pytest.raises(Exception, match="same block shape"):
            connector.register(KVLayout.from_caches(caches, BS), caches)
    finally:
        connector.close()


# ------------------------------------------------------------- across processes


def _read_all(config: dict[str, Any], keys: list[Any]) -> torch.Tensor:
    reader = create_connector(config)
    try:
        caches = empty_caches(N)
        reader.register(make_layout(caches), caches)
        assert reader.lookup(keys) == N
        result = reader.load(keys, list(range(N))).result(timeout=60)
        assert result.ok, result.not_ok[:2]
        return block_bytes(caches, range(N))
    finally:
        reader.close()


def test_server_blocks_outlive_the_process_that_saved_them(lm_server: str) -> None:
    config = {"backend": "lmcache", **SMALL, "remote_url": lm_server, "namespace": "xproc"}
    with spawn_peer(config, N, SEED) as writer:
        keys = writer.keys
    assert torch.equal(_read_all(config, keys), block_bytes(make_caches(SEED, N), range(N)))


def test_mooncake_store_blocks_reach_another_process(master: str) -> None:
    """Mooncake keeps values in its clients' memory: the writer stays up."""
    config = {"backend": "lmcache", **mooncake_config(master), "namespace": "xproc"}
    with spawn_peer(config, N, SEED) as writer:
        got = _read_all(config, writer.keys)
    assert torch.equal(got, block_bytes(make_caches(SEED, N), range(N)))


def test_another_layout_never_reads_these_blocks(lm_server: str) -> None:
    config = {"backend": "lmcache", **SMALL, "remote_url": lm_server, "namespace": "mismatch"}
    with spawn_peer(config, N, SEED) as writer:
        keys = writer.keys
    other = create_connector(config)
    try:
        caches = empty_caches(N, "other")  # same shapes, another dtype
        other.register(make_layout(caches), caches)
        assert other.lookup(keys) == 0
        assert set(statuses(other.load(keys, list(range(N))).result(30))) == {"missing"}
    finally:
        other.close()


# ------------------------------------------------------------------- failures


def test_a_server_that_is_down_is_a_clear_error_at_creation() -> None:
    with run_lmcache_server() as (url, _):
        pass  # started and stopped: nothing listens there now
    with pytest.raises(TransferError, match=r"unreachable.*lmcache_server"):
        create_connector({"backend": "lmcache", "remote_url": url})


def test_a_master_that_is_down_is_a_clear_error_at_creation() -> None:
    pytest.importorskip("mooncake")
    with run_master() as (address, _):
        pass
    with pytest.raises(TransferError, match="unreachable"):
        create_connector({"backend": "lmcache", "remote_url": f"mooncakestore://{address}"})


def test_server_killed_mid_load_never_hangs_nor_gives_wrong_bytes() -> None:
    """The remote is the only place the blocks are. Killed while a load runs:
    every key ends within the timeout, those that arrived are exact; after it,
    a load fails every key fast and ``health`` says why."""
    expected = block_bytes(make_caches(SEED, N), range(N))
    with run_lmcache_server() as (url, proc):
        config = {"backend": "lmcache", **SMALL, "remote_url": url, "timeout_s": 3}
        with spawn_peer(config, N, SEED) as writer:
            keys = writer.keys
        first, then = create_connector(config), create_connector(config)
        try:
            caches, later = empty_caches(N), empty_caches(N)
            first.register(make_layout(caches), caches)
            then.register(make_layout(later), later)
            assert first.health().healthy
            handle = first.load(keys, list(range(N)))
            os.kill(proc.pid, signal.SIGKILL)
            during = handle.result(timeout=3 + 5)
            arrived = [i for i, o in enumerate(during.outcomes) if o.ok]
            if arrived:
                assert torch.equal(block_bytes(caches, arrived), expected[arrived])
            started = time.monotonic()
            after = then.load(keys, list(range(N))).result(timeout=3 + 5)
            assert time.monotonic() - started < 3 + 2
            assert set(statuses(after)) == {"failed"}, statuses(after)
            health = then.health()
            assert not health.healthy and "Connection refused" in health.detail
        finally:
            first.close()
            then.close()


# ------------------------------------------------------------------- install


def test_listing_shows_lmcache_available_here_and_the_hint_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    entry = next(e for e in entries.scan("backends") if e.name == "lmcache")
    assert entry.extras == ("lmcache",)
    assert entry.unavailable_reason() is None
    real = entries._satisfied
    monkeypatch.setattr(entries, "_satisfied", lambda req: req.name != "lmcache" and real(req))
    reason = entry.unavailable_reason() or ""
    assert "lmcache==0.5.6" in reason and "pip install 'kvmux[lmcache]'" in reason


def blocked_reads(
    monkeypatch: pytest.MonkeyPatch, after_read: Callable[[], None] = lambda: None
) -> tuple[Connector, list[BlockKey], threading.Event]:
    """A registered connector (``timeout_s`` 1) holding four saved blocks, whose
    LMCache reads block until the returned event is set, then run ``after_read``:
    a remote over a cut link. The caller sets the event, then closes."""
    conn = create_connector({"backend": "lmcache", **SMALL, "timeout_s": 1.0})
    caches = make_caches(SEED, 4)
    layout = make_layout(caches)
    conn.register(layout, caches)
    keys = chain_keys(list(range(4 * layout.block_size)), layout.block_size, "hang")
    assert conn.save(keys, list(range(4))).result(10).ok
    storage = conn.backend._engine.storage_manager  # type: ignore[attr-defined]
    blocking, released = storage.batched_get, threading.Event()

    def blocked_get(*args: Any, **kwargs: Any) -> Any:
        released.wait(60)
        got = blocking(*args, **kwargs)
        after_read()
        return got

    monkeypatch.setattr(storage, "batched_get", blocked_get)
    return conn, keys, released


def test_a_retrieve_that_blocks_fails_every_block_at_the_deadline_not_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """LMCache's reads block (a remote over a cut link): the load ends at its
    deadline with every block failed, since the abandoned read may still write them."""
    conn, keys, released = blocked_reads(monkeypatch)
    try:
        started = time.monotonic()
        result = conn.load(keys, list(range(4))).result(10)
        took = time.monotonic() - started
        assert set(statuses(result)) == {"failed"}, statuses(result)
        assert 1.0 <= took < 2.5, took
    finally:
        released.set()
        conn.close()


def test_close_destroys_the_engine_only_after_an_abandoned_retrieve_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A retrieve abandoned at its deadline goes on copying out of LMCache's memory
    objects once its read returns; destroying the engine under it freed them (a
    SIGSEGV in the copy, seen in CI). ``close`` waits for it, within ``timeout_s``."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    events: list[str] = []

    def read_then_linger() -> None:  # the copy out of what it read comes after this
        time.sleep(0.2)
        events.append("retrieve read")

    conn, keys, released = blocked_reads(monkeypatch, read_then_linger)
    destroy = LMCacheEngineBuilder.destroy

    def recorded(instance_id: str) -> None:
        events.append("destroy")
        destroy(instance_id)

    monkeypatch.setattr(LMCacheEngineBuilder, "destroy", recorded)
    try:
        result = conn.load(keys, list(range(4))).result(10)
        assert set(statuses(result)) == {"failed"}, statuses(result)
    finally:
        released.set()
        conn.close()
    assert events == ["retrieve read", "destroy"], events
