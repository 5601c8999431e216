"""A producer killed (SIGKILL) and restarted on the same port, for every P2P backend.

The consumer keeps its connector throughout, as a decode engine would: what it
cached for the dead producer (links, mapped segment, NIXL agent) must not be
read as the new one. A load that names the dead producer's address fails at
once, saying it restarted; a load with the new producer's address works.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest
import torch

from kvmux.registry import create_connector
from kvmux.testing.cross_process import Consumer, statuses
from kvmux.testing.peer import block_bytes, empty_caches, make_caches, make_layout, spawn_peer

from support import P2P_TIMEOUT_S, free_port

N = 16
POOL_BYTES = 4 * 2**20
FAST_S = 2.0
"""A stale load must end well inside ``timeout_s``: it is refused, not waited out."""


def _backend(name: str, module: str | None = None) -> Any:
    missing = module is not None and importlib.util.find_spec(module) is None
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"no {module}"))


BACKENDS = [
    _backend("tcp"),
    _backend("shm"),
    _backend("nixl", "nixl"),
    _backend("mooncake", "mooncake"),
]


def _config(backend: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": backend,
        "timeout_s": P2P_TIMEOUT_S,
        "capacity_bytes": POOL_BYTES,
        **extra,
    }


@pytest.fixture(params=BACKENDS)
def consumer(request: pytest.FixtureRequest) -> Any:
    connector = create_connector(_config(request.param))
    caches = empty_caches(2 * N)
    connector.register(make_layout(caches), caches)
    yield request.param, Consumer(connector, caches)
    connector.close()


def test_a_restarted_producer_fails_stale_loads_at_once_and_serves_new_ones(consumer: Any) -> None:
    backend, client = consumer
    blocks = list(range(N))
    producer_config = _config(backend, port=free_port())
    with spawn_peer(producer_config, N, seed=1) as first:
        warm = client.load(first.keys, blocks, first.address)  # links, mappings, agents cached
        assert warm.ok and torch.equal(
            client.blocks(blocks), block_bytes(make_caches(1, N), blocks)
        )
        first.kill()
        with spawn_peer(producer_config, N, seed=2) as second:
            assert second.address["port"] == first.address["port"]
            assert second.address["incarnation"] != first.address["incarnation"]
            client.caches["layer.0"].zero_()
            start = time.monotonic()
            stale = client.load(first.keys, blocks, first.address)
            elapsed = time.monotonic() - start
            assert statuses(stale) == ["failed"] * N
            reason = stale.outcomes[0].reason or ""
            assert "PeerRestartedError" in reason and "restarted" in reason, reason
            assert elapsed < FAST_S, (
                f"a stale load took {elapsed:.2f} s (timeout_s {P2P_TIMEOUT_S})"
            )
            assert not client.caches["layer.0"][:N].any(), "a stale load wrote into KV memory"
            assert client.connector.lookup(first.keys, first.address) == 0

            fresh = client.load(second.keys, blocks, second.address)  # the same consumer object
            assert fresh.ok, fresh.not_ok[:2]
            assert torch.equal(client.blocks(blocks), block_bytes(make_caches(2, N), blocks))


def test_a_consumer_that_never_met_the_dead_producer_fails_its_params_at_once(
    consumer: Any,
) -> None:
    """Params carried to a fresh decode after their producer was replaced: the very
    first handshake at that address shows the other incarnation."""
    backend, client = consumer
    producer_config = _config(backend, port=free_port())
    with spawn_peer(producer_config, N, seed=1) as first:
        stale_address = first.address
        first.kill()
        with spawn_peer(producer_config, N, seed=2):
            start = time.monotonic()
            stale = client.load(first.keys, list(range(N)), stale_address)
            assert time.monotonic() - start < FAST_S
            assert statuses(stale) == ["failed"] * N
            assert "restarted" in (stale.outcomes[0].reason or "")
