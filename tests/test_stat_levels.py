"""``kvmux.stats.LEVELS`` against what the built-ins really report.

A stat that falls but is not declared a level would be summed as a counter
by vLLM's exporter and lose its drops; a declared level nobody reports is a
stale entry. Both are found here by running each built-in through saves,
loads past its capacity, a consumer coming and going, and releases (a closed
connector's stats are not read: nothing reports after close).
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmux.connector import Connector
from kvmux.registry import create_connector
from kvmux.stats import LEVELS, is_level
from kvmux.testing.peer import empty_caches, make_caches, make_keys, make_layout

pytestmark = pytest.mark.timeout(120)

BLOCKS = 8
SMALL_BLOCK_BYTES = 2 * 2 * 16 * 4 * 32 * 2
"""One block of the peer layout ``small`` (two float16 layers of ``[2, 16, 4, 32]``)."""


class Recorder:
    """Every stats snapshot of the connectors it watches, by label."""

    def __init__(self) -> None:
        self.snapshots: dict[str, list[dict[str, float]]] = {}

    def snap(self, label: str, connector: Connector) -> None:
        self.snapshots.setdefault(label, []).append(connector.stats())

    def fallen(self) -> set[tuple[str, str]]:
        out = set()
        for label, snaps in self.snapshots.items():
            for before, after in itertools.pairwise(snaps):
                out |= {(label, k) for k, v in after.items() if k in before and v < before[k]}
        return out

    def reported(self) -> set[str]:
        return {k.rpartition(".")[2] for snaps in self.snapshots.values() for s in snaps for k in s}


def registered(config: dict[str, Any], filled: bool) -> Connector:
    connector = create_connector(config)
    caches = make_caches(3, 2 * BLOCKS) if filled else empty_caches(2 * BLOCKS)
    connector.register(make_layout(caches), caches)
    return connector


def store_workload(config: dict[str, Any], rec: Recorder, label: str) -> None:
    """One connector: saves past its capacity, loads, releases, close."""
    conn = registered(config, filled=True)
    keys = make_keys(2 * BLOCKS)
    rec.snap(label, conn)
    for start in range(0, 2 * BLOCKS, 4):
        part = list(range(start, start + 4))
        conn.save([keys[i] for i in part], part).result(timeout=10)
        rec.snap(label, conn)
    conn.load(keys[:4], [0, 1, 2, 3]).result(timeout=10)
    rec.snap(label, conn)
    conn.release(keys)
    rec.snap(label, conn)
    conn.close()


def p2p_workload(config: dict[str, Any], rec: Recorder, label: str) -> None:
    """A producer and a consumer in this process: the consumer pulls, goes away, and
    the producer releases what it published."""
    producer = registered(config, filled=True)
    consumer = registered(config, filled=False)
    keys = make_keys(BLOCKS)
    try:
        rec.snap(label, producer)
        producer.save(keys, list(range(BLOCKS))).saved(10)
        rec.snap(label, producer)
        consumer.load(keys, list(range(BLOCKS)), producer.address()).result(timeout=20)
        rec.snap(label, producer)
    finally:
        consumer.close()
    deadline = time.monotonic() + 10
    while producer.stats().get("server_connections") and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.snap(label, producer)
    producer.release(keys)
    rec.snap(label, producer)
    producer.close()


def workloads(tmp_path: Path) -> dict[str, Callable[[Recorder, str], None]]:
    cpu = {"backend": "cpu", "capacity_bytes": BLOCKS * SMALL_BLOCK_BYTES}
    out: dict[str, Callable[[Recorder, str], None]] = {
        "cpu": lambda rec, label: store_workload(cpu, rec, label),
        "disk": lambda rec, label: store_workload(
            {
                "backend": "disk",
                "path": str(tmp_path / "disk"),
                "capacity_bytes": cpu["capacity_bytes"],
            },
            rec,
            label,
        ),
        "checksum": lambda rec, label: store_workload(
            {"backend": "checksum", "inner": {"backend": "disk", "path": str(tmp_path / "sum")}},
            rec,
            label,
        ),
        "multi": lambda rec, label: store_workload(
            {
                "backend": "multi",
                "policy": "tiered",
                "children": [cpu, {"backend": "disk", "path": str(tmp_path / "tier")}],
                "tiers": [{"capacity_blocks": 4}],
                "write": "back",
            },
            rec,
            label,
        ),
    }
    p2p = {"tcp": "tcp", "shm": "shm", "nixl": "nixl", "mooncake": "mooncake"}
    needs = {"nixl": "nixl", "mooncake": "mooncake"}
    for label, backend in p2p.items():
        if label in needs and importlib.util.find_spec(needs[label]) is None:
            continue
        config = {"backend": backend, "timeout_s": 10.0, "capacity_bytes": 4 * 2**20}
        out[label] = lambda rec, lbl, config=config: p2p_workload(config, rec, lbl)
    borrow = {"backend": "tcp", "timeout_s": 10.0, "save_mode": "borrow"}
    out["tcp-borrow"] = lambda rec, label: p2p_workload(borrow, rec, label)
    return out


def test_every_stat_that_falls_is_a_declared_level_and_every_level_is_reported(
    tmp_path: Path,
) -> None:
    rec = Recorder()
    ran = workloads(tmp_path)
    for label, run in ran.items():
        run(rec, label)
    undeclared = sorted(f"{label}: {name}" for label, name in rec.fallen() if not is_level(name))
    assert undeclared == [], "stats that fall must be declared in kvmux.stats.LEVELS"
    assert {name for _, name in rec.fallen()}, "the workloads must make some level fall"
    if {"nixl", "mooncake"} <= set(ran):
        assert set(LEVELS) - rec.reported() == set(), "declared levels no built-in reports"
