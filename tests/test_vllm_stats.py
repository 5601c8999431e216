"""kvmux's stats through vLLM: counters add up, levels (``kvmux.stats.LEVELS``) read
their present value, in vLLM's log line and on its Prometheus ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import VllmConfig

from kvmux.adapters.vllm.connector import KvmuxConnector
from kvmux.adapters.vllm.stats import LEVELS_KEY, KvmuxPromMetrics, KvmuxStats, worker_report
from kvmux.models import tiny_model
from kvmux.stats import is_level
from vllm_harness import BLOCK, FakeEngine, producer_and_consumer

pytestmark = pytest.mark.timeout(120)


class Exported:
    """kvmux's Prometheus metrics in a registry of their own, read back by name."""

    def __init__(self, engines: int = 1) -> None:
        self.registry = CollectorRegistry()

        def bind(cls: Any) -> Any:
            return lambda *a, **kw: cls(*a, registry=self.registry, **kw)

        metrics = KvmuxConnector.build_prom_metrics(
            VllmConfig(),
            {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
            ["engine"],
            {i: [str(i)] for i in range(engines)},
        )
        assert isinstance(metrics, KvmuxPromMetrics)
        self.metrics = metrics

    def observe(self, data: dict[str, Any], engine: int = 0) -> None:
        # What vLLM's front end gets: a step's reports, merged, as a plain dict.
        self.metrics.observe(KvmuxConnector.build_kv_connector_stats(data).to_dict(), engine)

    def level(self, stat: str, engine: int = 0) -> float | None:
        return self.registry.get_sample_value(
            "vllm:kvmux_level", {"engine": str(engine), "stat": stat}
        )

    def counter(self, stat: str, engine: int = 0) -> float | None:
        return self.registry.get_sample_value(
            "vllm:kvmux_stat_total", {"engine": str(engine), "stat": stat}
        )


class Worker:
    """A worker's successive stats snapshots, turned into its reports."""

    def __init__(self, rank: str) -> None:
        self.rank = rank
        self.before: dict[str, float] = {}

    def report(self, **now: float) -> dict[str, Any]:
        out = worker_report(now, self.before, self.rank)
        self.before = now
        return out


def merged(*reports: dict[str, Any]) -> dict[str, Any]:
    """One step's reports from several workers, merged as vLLM's output aggregator does."""
    stats = [KvmuxStats(data=r) for r in reports if r]
    total = stats[0]
    for other in stats[1:]:
        total = total.aggregate(other)
    return total.data


def test_a_level_going_10_4_10_reads_10_in_prometheus_not_16() -> None:
    exported, worker = Exported(), Worker("0")
    for stored in (10, 4, 10):
        exported.observe(worker.report(blocks_stored=stored, save_blocks_ok=stored))
    assert exported.level("blocks_stored") == 10
    assert exported.counter("blocks_stored") is None
    assert exported.counter("save_blocks_ok") == 10 + 0 + 6  # a counter's drop is no drop


def test_levels_fall_to_zero_and_are_never_exported_as_counters() -> None:
    exported, worker = Exported(), Worker("0")
    exported.observe(worker.report(server_connections=3, capacity_blocks=64))
    exported.observe(worker.report(server_connections=0, capacity_blocks=64))
    assert exported.level("server_connections") == 0
    assert exported.level("capacity_blocks") == 64
    samples = {s.labels["stat"] for m in exported.registry.collect() for s in m.samples}
    assert {"server_connections", "capacity_blocks"} <= samples
    assert exported.counter("server_connections") is None


def test_an_engines_level_is_the_sum_of_each_workers_latest_value() -> None:
    exported, rank0, rank1 = Exported(), Worker("0"), Worker("1")
    exported.observe(merged(rank0.report(blocks_stored=10), rank1.report(blocks_stored=5)))
    assert exported.level("blocks_stored") == 15
    # Only rank 0 changed in this step: rank 1's last value still counts.
    exported.observe(merged(rank0.report(blocks_stored=4), rank1.report(blocks_stored=5)))
    assert exported.level("blocks_stored") == 9


def test_engines_keep_their_own_levels() -> None:
    exported = Exported(engines=2)
    exported.observe(Worker("0").report(blocks_stored=7), engine=0)
    exported.observe(Worker("0").report(blocks_stored=2), engine=1)
    assert (exported.level("blocks_stored", 0), exported.level("blocks_stored", 1)) == (7, 2)


def test_the_log_line_sums_counters_over_steps_and_shows_levels_as_last_reported() -> None:
    rank0, rank1 = Worker("0"), Worker("1")
    steps = [
        merged(rank0.report(blocks_stored=10, load_bytes=2e9, load_seconds=1.0)),
        merged(rank0.report(blocks_stored=4, load_bytes=4e9, load_seconds=2.0)),
        merged(rank1.report(blocks_stored=1)),
    ]
    interval = KvmuxConnector.build_kv_connector_stats(steps[0])
    for step in steps[1:]:
        interval = interval.aggregate(KvmuxConnector.build_kv_connector_stats(step))
    reduced = interval.reduce()
    assert reduced["blocks_stored"] == 4 + 1
    assert reduced["load_bytes"] == 4e9 and reduced["load_GBps"] == 2.0
    assert LEVELS_KEY not in reduced


def test_merging_reports_leaves_the_reports_themselves_unchanged() -> None:
    first = Worker("0").report(blocks_stored=10)
    kept = {LEVELS_KEY: {"0": {"blocks_stored": 10}}}
    KvmuxStats(data=dict(first)).aggregate(KvmuxStats(data=Worker("0").report(blocks_stored=3)))
    assert first == kept


def test_a_worker_reports_nothing_when_nothing_changed_and_all_levels_when_one_did() -> None:
    worker = Worker("0")
    worker.report(blocks_stored=2, capacity_blocks=8, save_calls=1)
    assert worker.report(blocks_stored=2, capacity_blocks=8, save_calls=1) == {}
    assert worker.report(blocks_stored=1, capacity_blocks=8, save_calls=1) == {
        LEVELS_KEY: {"0": {"blocks_stored": 1, "capacity_blocks": 8}}
    }
    assert KvmuxStats(data={}).is_empty()
    assert not KvmuxStats(data={LEVELS_KEY: {"0": {"blocks_stored": 0}}}).is_empty()


# --------------------------------------------- through the adapter, in vLLM's scheduler


@pytest.fixture
def pd_pair() -> Iterator[tuple[FakeEngine, FakeEngine]]:
    with producer_and_consumer(tiny_model(), {"backend": "tcp"}) as pair:
        yield pair


def test_the_producers_gauges_follow_its_backend_when_a_consumer_comes_and_goes(
    pd_pair: tuple[FakeEngine, FakeEngine],
) -> None:
    producer, consumer = pd_pair
    exported = Exported()
    report = producer.worker.get_kv_connector_stats

    def exporting() -> Any:  # the worker's per-step report, as vLLM's front end gets it
        stats = report()
        if stats is not None:
            exported.observe(stats.to_dict())
        return stats

    producer.worker.get_kv_connector_stats = exporting  # type: ignore[method-assign]
    connections_seen: list[float | None] = []
    for seed in range(2):
        prompt = [3 + (seed * 17 + i * 5) % 250 for i in range(2 * BLOCK + 1)]
        req = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
        producer.run()
        params = dict(producer.result(req).kv_transfer_params)
        decode = consumer.add(prompt, max_tokens=2, params=params)
        consumer.run(until=[decode])
        producer.step()
        connections_seen.append(exported.level("server_connections"))
    assert connections_seen == [1, 1]

    consumer.close()  # its connection to the producer's server goes
    backend = producer.worker.worker_side.connector
    deadline = time.monotonic() + 10
    while backend.stats()["server_connections"] and time.monotonic() < deadline:
        time.sleep(0.01)
    producer.step()
    levels = {k: v for k, v in backend.stats().items() if is_level(k)}
    assert levels["server_connections"] == 0 and levels["blocks_stored"] == 6
    assert {k: exported.level(k) for k in levels} == levels
    assert exported.counter("save_blocks_ok") == backend.stats()["save_blocks_ok"]


def test_the_demos_log_totals_add_up_counters_and_leave_levels_out(tmp_path: Path) -> None:
    from kvmux.demo.run import transfer_totals

    lines = [
        KvmuxStats(data=Worker("0").report(load_blocks_ok=2, load_bytes=8, load_seconds=1.0)),
        KvmuxStats(data={"load_blocks_ok": 3, LEVELS_KEY: {"0": {"blocks_stored": 5}}}),
    ]
    log = tmp_path / "decode.log"
    log.write_text(
        "".join(
            "INFO [loggers.py:1] KV Transfer metrics: "
            + ", ".join(f"{k}={v}" for k, v in line.reduce().items())
            + "\n"
            for line in lines
        )
    )
    assert transfer_totals(log) == {"load_blocks_ok": 5, "load_bytes": 8, "load_seconds": 1.0}
