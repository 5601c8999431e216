"""Deadlines that hold under concurrency: a hung peer delays only the loads from it.

A peer process that stops (SIGSTOP: alive, its sockets open, never answering)
is what a frozen or overloaded producer looks like from the network. Every
load from it must end within the consumer's ``timeout_s`` counted from the
call, however many are in flight at once, and a load from a healthy peer
meanwhile must not wait for them.

The producers run in other processes (:mod:`kvmux.testing.peer`), built from
the backend's registry config (the ``peer_config`` fixture). A factory made by
:func:`kvmux.testing.configs.registry_factory` (the pytest plugin's included)
has one; a backend whose factory has none skips these tests, saying why.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from kvmux.connector import Connector
from kvmux.errors import ConfigError
from kvmux.handle import Handle, Status
from kvmux.testing.harness import Harness, finish, summary
from kvmux.testing.peer import (
    PeerProcess,
    block_bytes,
    empty_caches,
    make_caches,
    make_layout,
    spawn_peer,
)
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase

HUNG_LOADS = 8
"""Loads in flight at once against the hung peer: more than any sane thread pool."""
PER_LOAD = 2
"""Blocks per load."""
TIMEOUT_S = 3.0
"""The consumer's ``timeout_s`` in these tests."""
SLACK_S = 2.0
"""How far past ``TIMEOUT_S`` a load from the hung peer may end (a busy machine). A
second wave of loads, queued behind the first, would end a whole ``TIMEOUT_S`` late."""
HUNG_SEED, HEALTHY_SEED = 101, 202


class DeadlineTests(SuiteBase):
    @requires("p2p")
    def test_concurrent_loads_from_a_hung_peer_all_end_within_the_timeout(
        self, harness: Harness, peer_config: Mapping[str, Any] | None
    ) -> None:
        config = _runnable(harness, peer_config)
        consumer = _consumer(harness, HUNG_LOADS * PER_LOAD + 1)
        with spawn_peer(config, PER_LOAD + 1, HUNG_SEED) as hung:
            _warm_up(consumer, hung, HUNG_SEED)
            with hung.stopped():
                started = time.monotonic()
                loads = _start_loads(consumer, hung, HUNG_LOADS)
                ended = _ends(loads, started)
        _check_hung_loads(loads, ended)

    @requires("p2p", "not one_peer")
    def test_a_load_from_a_healthy_peer_is_not_delayed_by_a_hung_one(
        self, harness: Harness, peer_config: Mapping[str, Any] | None
    ) -> None:
        config = _runnable(harness, peer_config)
        consumer = _consumer(harness, (HUNG_LOADS + 1) * PER_LOAD + 1)
        with (
            spawn_peer(config, PER_LOAD + 1, HUNG_SEED) as hung,
            spawn_peer(config, PER_LOAD + 1, HEALTHY_SEED) as healthy,
        ):
            _warm_up(consumer, hung, HUNG_SEED)
            _warm_up(consumer, healthy, HEALTHY_SEED)
            with hung.stopped():
                started = time.monotonic()
                loads = _start_loads(consumer, hung, HUNG_LOADS)
                blocks = [HUNG_LOADS * PER_LOAD + 1 + i for i in range(PER_LOAD)]
                asked = time.monotonic()
                good = consumer.load(healthy, slice(1, 1 + PER_LOAD), blocks)
                result = finish(good, TIMEOUT_S + SLACK_S, "load from the healthy peer")
                took = time.monotonic() - asked
                ended = _ends(loads, started)
            expected = block_bytes(make_caches(HEALTHY_SEED, PER_LOAD + 1), range(1, PER_LOAD + 1))
            assert result.ok, f"load from the healthy peer: {summary(result)}"
            assert torch.equal(consumer.blocks(blocks), expected), "healthy peer's bytes differ"
        assert took < TIMEOUT_S / 2, (
            f"a load from a healthy peer took {took:.2f} s while {HUNG_LOADS} loads waited "
            f"on a hung one (timeout_s={TIMEOUT_S}): it queued behind them"
        )
        _check_hung_loads(loads, ended)


def _runnable(harness: Harness, peer_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if peer_config is None:
        pytest.skip(
            "needs the backend's registry config to run a peer process: build the factory "
            "with kvmux.testing.configs.registry_factory or override the peer_config fixture"
        )
    if "cpu" not in harness.capabilities.memory_kinds:
        pytest.skip("the peer process registers host (cpu) memory; the backend takes none")
    return peer_config


@dataclass
class _Consumer:
    """A registered consumer connector and its KV memory (the peers' layout)."""

    connector: Connector
    caches: dict[str, torch.Tensor]

    def load(self, peer: PeerProcess, keys: slice, blocks: list[int]) -> Handle:
        return self.connector.load(peer.keys[keys], blocks, peer.address)

    def blocks(self, blocks: list[int]) -> torch.Tensor:
        return block_bytes(self.caches, blocks)


def _consumer(harness: Harness, num_blocks: int) -> _Consumer:
    """A registered consumer with ``TIMEOUT_S`` and zeroed memory."""
    try:
        connector = harness.open(timeout_s=TIMEOUT_S)
    except (TypeError, ConfigError) as exc:
        if "timeout_s" not in str(exc):
            raise
        pytest.skip(f"requires config field 'timeout_s' (the factory refused it: {exc})")
    caches = empty_caches(num_blocks)
    connector.register(make_layout(caches), caches)
    return _Consumer(connector, caches)


def _warm_up(consumer: _Consumer, peer: PeerProcess, seed: int) -> None:
    """One good load of the peer's first block, as an engine that has pulled before:
    the consumer is connected (and, for a pipe, attached) when the peer stops."""
    result = finish(consumer.load(peer, slice(0, 1), [0]), TIMEOUT_S + SLACK_S, "load")
    assert result.ok, f"warm-up load from a live peer: {summary(result)}"
    expected = block_bytes(make_caches(seed, 1), [0])
    assert torch.equal(consumer.blocks([0]), expected), "warm-up load delivered wrong bytes"


def _start_loads(consumer: _Consumer, peer: PeerProcess, count: int) -> list[Handle]:
    """``count`` loads of the peer's blocks after the first, each into blocks of its own."""
    keys = slice(1, 1 + PER_LOAD)
    return [
        consumer.load(peer, keys, [1 + i * PER_LOAD + j for j in range(PER_LOAD)])
        for i in range(count)
    ]


def _ends(loads: list[Handle], started: float) -> list[float | None]:
    """Seconds from ``started`` to each load's end; None for one still running after
    ``TIMEOUT_S + SLACK_S`` (then the test fails, after the peer is resumed)."""
    ended: list[float | None] = [None] * len(loads)
    until = started + TIMEOUT_S + SLACK_S
    while time.monotonic() < until and None in ended:
        for i, load in enumerate(loads):
            if ended[i] is None and load.poll():
                ended[i] = time.monotonic() - started
        time.sleep(0.005)
    return ended


def _check_hung_loads(loads: list[Handle], ended: list[float | None]) -> None:
    late = [i for i, t in enumerate(ended) if t is None]
    assert not late, (
        f"{len(late)} of {len(loads)} concurrent loads from a hung peer were still running "
        f"{TIMEOUT_S + SLACK_S:.1f} s after they were asked for (timeout_s={TIMEOUT_S}); "
        f"the others ended after {sorted(t for t in ended if t is not None)} s: a deadline "
        "counts from the call, not from when a thread gets round to the load"
    )
    for load in loads:
        result = finish(load, SLACK_S, "load from a hung peer")
        assert Status.OK not in {o.status for o in result.outcomes}, (
            f"a hung peer cannot have delivered blocks: {summary(result)}"
        )
