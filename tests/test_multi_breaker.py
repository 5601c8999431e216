"""Circuit breaker: a failing child is skipped, then readmitted once healthy; all in stats."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.connector import Connector
from kvmux.keys import chain_keys
from kvmux.multi.backend import MultiBackend
from kvmux.multi.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvmux.testing.faults import Die
from kvmux.testing.kv import DEFAULT_LAYOUT, KVMemory

COOLDOWN_S = 0.2
CLOSED, OPEN = float(BreakerState.CLOSED), float(BreakerState.OPEN)


def pool() -> Backend:
    return CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20, timeout_s=2.0))


@pytest.fixture
def sick() -> Die:
    return Die(pool(), mode="fail")


@pytest.fixture
def multi(sick: Die) -> Iterator[Connector]:
    breaker = {"failures": 2, "cooldown_s": COOLDOWN_S}
    multi = Connector(MultiBackend.of("fallback", [sick, pool()], breaker=breaker))
    memory = KVMemory(DEFAULT_LAYOUT, 16, "cpu", seed=2)
    multi.register(memory.layout, memory.caches)
    yield multi
    multi.close()


KEYS = chain_keys(list(range(16)), 4, "breaker")


def load_ok(multi: Connector) -> None:
    assert multi.load(KEYS, [8, 9, 10, 11]).result(timeout=5).ok


def test_the_breaker_opens_after_n_failures_and_then_skips_the_child(
    multi: Connector, sick: Die
) -> None:
    assert multi.save(KEYS, [0, 1, 2, 3]).result(timeout=5).ok  # failure 1 (the other child)
    assert multi.stats()["child.0.breaker_state"] == CLOSED
    load_ok(multi)  # failure 2: open
    stats = multi.stats()
    assert (stats["child.0.breaker_state"], stats["child.0.breaker_opens"]) == (OPEN, 1)
    calls = Connector(sick).stats()["injected_deaths"]
    load_ok(multi)
    assert multi.lookup(KEYS) == 4
    assert Connector(sick).stats()["injected_deaths"] == calls, (
        "an open breaker must not call the child"
    )
    assert multi.stats()["child.0.skipped"] >= 2


def test_a_healthy_probe_after_the_cooldown_readmits_the_child(multi: Connector, sick: Die) -> None:
    multi.save(KEYS, [0, 1, 2, 3]).result(timeout=5)
    load_ok(multi)
    time.sleep(COOLDOWN_S * 1.5)
    load_ok(multi)  # cooldown over, but health() still says sick: stays open
    assert multi.stats()["child.0.breaker_state"] == OPEN
    sick.revive()
    time.sleep(COOLDOWN_S * 1.5)
    load_ok(multi)  # healthy probe: half-open; the call answers (missing): closed
    assert multi.stats()["child.0.breaker_state"] == CLOSED
    assert multi.save(KEYS, [0, 1, 2, 3]).result(timeout=5).ok
    hits = multi.stats()["child.0.hits"]
    load_ok(multi)
    assert multi.stats()["child.0.hits"] == hits + 4


def state(breaker: CircuitBreaker) -> BreakerState:
    """The breaker's state now (a call, so type checkers do not assume it never changes)."""
    return breaker.state


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_half_open_lets_calls_through_and_one_failure_reopens() -> None:
    clock, healthy = Clock(), [False]
    breaker = CircuitBreaker(BreakerConfig(failures=2, cooldown_s=10), lambda: healthy[0], clock)
    breaker.record(False)
    assert breaker.allow()
    breaker.record(False)
    assert state(breaker) is BreakerState.OPEN
    assert not breaker.allow()
    clock.now = 11
    assert not breaker.allow(), "unhealthy probe: still open, cooldown restarts"
    healthy[0] = True
    clock.now = 15
    assert not breaker.allow(), "within the restarted cooldown"
    clock.now = 22
    assert breaker.allow()
    assert state(breaker) is BreakerState.HALF_OPEN
    breaker.record(False)
    assert (state(breaker), breaker.opens) == (BreakerState.OPEN, 2)
    clock.now = 33
    assert breaker.allow()
    breaker.record(True)
    assert state(breaker) is BreakerState.CLOSED


def test_a_health_check_that_raises_counts_as_sick() -> None:
    def probe() -> bool:
        raise RuntimeError("boom")

    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(failures=1, cooldown_s=1), probe, clock)
    breaker.record(False)
    clock.now = 5
    assert not breaker.allow()
    assert state(breaker) is BreakerState.OPEN
