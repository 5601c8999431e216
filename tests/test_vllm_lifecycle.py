"""The vLLM adapter under vLLM's real Scheduler, with a fake model that checks its KV.

Every step the fake model verifies that all KV a request has so far (computed
or loaded through kvmux) is exactly what computing it would write, so a block
loaded wrongly, too late or not at all fails the test where it happens.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus

from kvmux.adapters.vllm.config import ExtraConfigError
from kvmux.adapters.vllm.connector import KvmuxConnector
from kvmux.adapters.vllm.keys import RequestKeys
from kvmux.connector import Connector
from kvmux.errors import ConfigError, UnknownBackendError
from kvmux.handle import Outcome
from kvmux.keys import BlockKey
from kvmux.models import tiny_model
from kvmux.testing.faults import Delay, DropKeys, FaultWrapper
from vllm_harness import BLOCK, FakeEngine

from support import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir() -> Any:
    return tiny_model()


def _engine(
    engines: list[FakeEngine], model_dir: Any, extra: dict[str, Any], **kw: Any
) -> FakeEngine:
    engine = FakeEngine(model_dir, extra, **kw)
    engines.append(engine)
    return engine


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 17 + i * 5) % 250 for i in range(n)]


def _wrap(engine: FakeEngine, make: Any) -> Any:
    """Put ``make(backend)`` (a fault wrapper) between the worker's connector and its backend."""
    worker = engine.worker.worker_side
    worker.connector = Connector(make(worker.connector.backend))
    return worker.connector


def _prefill(engine: FakeEngine, prompt: list[int]) -> dict[str, Any]:
    req = engine.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    engine.run()
    params = engine.result(req).kv_transfer_params
    assert params is not None and params["do_remote_prefill"] is True
    return dict(params)


def _assert_clean(engine: FakeEngine) -> None:
    assert engine.kv_errors == []
    assert not engine.scheduler.requests
    assert engine.free_blocks() == engine.free_at_start


def test_pd_decode_waits_for_the_whole_prompt_then_runs_on_loaded_kv(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    prompt = _prompt(3 * BLOCK + 5)
    params = _prefill(producer, prompt)
    assert params["kvmux"]["num_tokens"] == len(prompt)
    assert params["prompt_token_ids"] == prompt

    req = consumer.add(prompt, max_tokens=4, params=params)
    consumer.step()
    assert consumer.status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer.run()
    assert len(consumer.tokens(req)) == 4
    stats = consumer.worker.worker_side.connector.stats()
    assert stats["load_blocks_ok"] == 4  # three full blocks and the partial one
    _assert_clean(producer)
    _assert_clean(consumer)


def test_reuse_loads_a_saved_prefix_after_vllm_forgot_it(engines, model_dir):
    engine = _engine(engines, model_dir, {"backend": "cpu"})
    prompt = _prompt(4 * BLOCK + 3)
    engine.add(prompt)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    longer = prompt + _prompt(BLOCK, seed=9)
    engine.add(longer)
    engine.run()
    stats = engine.worker.worker_side.connector.stats()
    assert stats["load_blocks_ok"] == 4
    _assert_clean(engine)


def test_chunked_prefill_saves_every_block_under_its_own_key(engines, model_dir, tmp_path):
    store = {"backend": "disk", "path": str(tmp_path / "kv")}
    writer = _engine(engines, model_dir, store, role="kv_producer", max_batched=BLOCK)
    prompt = _prompt(6 * BLOCK + 1)
    writer.add(prompt, max_tokens=1)
    writer.run()
    assert writer.worker.worker_side.connector.stats()["save_blocks_ok"] == 6
    reader = _engine(engines, model_dir, store, role="kv_consumer", max_batched=BLOCK)
    reader.add(prompt, max_tokens=2)
    reader.run()
    assert reader.worker.worker_side.connector.stats()["load_blocks_ok"] == 6
    _assert_clean(writer)
    _assert_clean(reader)


def test_abort_during_a_load_frees_the_blocks_exactly_once(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    prompt = _prompt(2 * BLOCK)
    params = _prefill(producer, prompt)
    _wrap(consumer, lambda inner: Delay(inner, 0.5))
    req = consumer.add(prompt, params=params)
    consumer.step()
    assert consumer.status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer.abort(req)
    deadline = time.monotonic() + 10
    while consumer.scheduler.has_requests() and time.monotonic() < deadline:
        consumer.step()
        time.sleep(0.01)
    _assert_clean(consumer)


def _leases(engine: FakeEngine) -> dict[str, float]:
    stats = engine.worker.worker_side.stats()
    return {k: v for k, v in stats.items() if "lease" in k}


def _step_until(engine: FakeEngine, done: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not met in time"
        engine.step()
        time.sleep(0.01)


def test_a_prefill_publishes_its_blocks_and_the_decode_releases_them_once_loaded(
    engines, model_dir
):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    prompt = _prompt(2 * BLOCK + 3)
    params = _prefill(producer, prompt)
    assert params["kvmux"]["lease"] and params["kvmux"]["lease_s"] == 120.0
    assert _leases(producer)["published_leases"] == 1
    assert producer.worker.worker_side.connector.stats()["pinned_blocks"] == 3
    consumer.add(prompt, max_tokens=3, params=params)
    consumer.run()
    wait_until(lambda: _leases(producer)["leases_released"] == 1, 5.0)
    assert _leases(producer)["published_leases"] == 0
    assert producer.worker.worker_side.connector.stats()["pinned_blocks"] == 0
    assert _leases(consumer)["lease_releases_sent"] == 1
    _assert_clean(consumer)


def test_a_decode_waiting_for_its_load_renews_the_publication(engines, model_dir):
    producer = _engine(
        engines, model_dir, {"backend": "tcp", "vllm": {"lease_s": 0.6}}, role="kv_producer"
    )
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    prompt = _prompt(2 * BLOCK)
    params = _prefill(producer, prompt)
    _wrap(consumer, lambda inner: Delay(inner, 1.5))  # a long queue before the pull
    req = consumer.add(prompt, max_tokens=2, params=params)
    consumer.run()
    assert len(consumer.tokens(req)) == 2
    assert consumer.worker.worker_side.connector.stats()["load_blocks_ok"] == 2
    counts = _leases(producer)
    assert counts["leases_extended"] >= 3, counts
    assert counts.get("leases_expired", 0) == 0
    wait_until(lambda: _leases(producer)["leases_released"] == 1, 5.0)
    _assert_clean(consumer)


def test_a_decode_aborted_during_its_load_releases_the_publication_at_once(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    prompt = _prompt(2 * BLOCK)
    params = _prefill(producer, prompt)
    _wrap(consumer, lambda inner: Delay(inner, 2.0))
    req = consumer.add(prompt, params=params)
    consumer.step()
    assert consumer.status(req) == RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer.abort(req)
    aborted = time.monotonic()
    _step_until(consumer, lambda: _leases(producer).get("leases_released") == 1)
    assert time.monotonic() - aborted < 1.5, "released only when the load ended"
    assert _leases(producer)["published_leases"] == 0
    _step_until(consumer, lambda: not consumer.scheduler.has_requests())
    _assert_clean(consumer)  # its blocks are free once the load has ended


def test_a_decode_aborted_while_its_load_waits_behind_a_hung_peer_frees_its_blocks_at_once(
    engines, model_dir
):
    """Five loads from a peer that never answers: the lane's four wait for their
    deadline; the fifth, queued, is aborted, never runs, and its blocks are free
    at once. The other four fail at their deadline and are recomputed."""
    backend = {"backend": "tcp", "timeout_s": 2.0}
    producer = _engine(engines, model_dir, backend, role="kv_producer")
    consumer = _engine(engines, model_dir, backend, role="kv_consumer")
    prompts = [_prompt(2 * BLOCK, seed=s) for s in range(5)]
    with socket.create_server(("127.0.0.1", 0)) as mute:
        hung = {"host": "127.0.0.1", "port": mute.getsockname()[1]}
        params = []
        for prompt in prompts:
            p = _prefill(producer, prompt)
            params.append({**p, "kvmux": {**p["kvmux"], "source": hung}})
        reqs = [
            consumer.add(pr, max_tokens=2, params=pa)
            for pr, pa in zip(prompts, params, strict=True)
        ]
        consumer.step()
        assert all(consumer.status(r) == RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs)
        free = consumer.free_blocks()
        consumer.abort(reqs[-1])
        aborted = time.monotonic()
        _step_until(consumer, lambda: consumer.free_blocks() > free, timeout_s=1.0)
        assert time.monotonic() - aborted < 1.0
        assert all(consumer.status(r) == RequestStatus.WAITING_FOR_REMOTE_KVS for r in reqs[:-1])
        consumer.run()
    assert all(len(consumer.tokens(r)) == 2 for r in reqs[:-1])
    assert consumer.worker.worker_side.stats()["load_error_blocks"] == 4 * 2
    _assert_clean(consumer)


def test_a_decode_request_rejected_before_the_engine_releases_the_publication(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    params = _prefill(producer, _prompt(2 * BLOCK + 1))
    consumer.reject(params)
    consumer.run()
    wait_until(lambda: _leases(producer).get("leases_released") == 1, 5.0)
    assert _leases(producer)["published_leases"] == 0
    assert "load_calls" not in consumer.worker.worker_side.connector.stats()
    _assert_clean(consumer)


def test_params_the_decode_refuses_release_the_publication(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    params = _prefill(producer, _prompt(2 * BLOCK + 1))
    consumer.add(_prompt(2 * BLOCK + 1, seed=5), max_tokens=2, params=params)  # other tokens
    consumer.run()
    wait_until(lambda: _leases(producer).get("leases_released") == 1, 5.0)


def test_an_aborted_prefill_releases_its_own_publication(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    req = producer.add(_prompt(2 * BLOCK), max_tokens=50, params={"do_remote_decode": True})
    _step_until(producer, lambda: _leases(producer).get("published_leases") == 1)
    producer.abort(req)  # a client gone: vLLM returns its params to nobody
    producer.run()
    counts = _leases(producer)
    assert counts["published_leases"] == 0 and counts["leases_released"] == 1
    _assert_clean(producer)


class _HoldSaves(FaultWrapper):
    """A backend that borrows blocks (``borrows_blocks``) at its simplest: a save
    ends only when its keys are released."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.capabilities = dataclasses.replace(inner.capabilities, borrows_blocks=True)
        self.pending: list[tuple[list[BlockKey], threading.Event]] = []

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> Sequence[Outcome]:
        outcomes = super().save(keys, block_ids)
        released = threading.Event()
        self.pending.append((keys, released))
        while not (released.is_set() or self._stop.wait(0.01)):  # closing ends the wait
            pass  # a lane thread of this wrapper holds the save meanwhile
        return outcomes

    def release(self, keys: list[BlockKey]) -> None:
        released = set(keys)
        for held, event in self.pending:
            if released.issuperset(held):
                event.set()


def test_lease_ends_the_delayed_free_of_a_request_nobody_pulls(engines, model_dir):
    extra = {"backend": "cpu", "vllm": {"lease_s": 0.3}}
    producer = _engine(engines, model_dir, extra, role="kv_producer")
    _wrap(producer, _HoldSaves)
    req = producer.add(_prompt(2 * BLOCK + 1), max_tokens=1, params={"do_remote_decode": True})
    producer.run(until=[req])
    assert req in producer.scheduler.requests  # finished, blocks held for the consumer
    started = time.monotonic()
    while producer.scheduler.has_requests() and time.monotonic() - started < 10:
        producer.step()
        time.sleep(0.02)
    assert time.monotonic() - started >= 0.25
    assert producer.worker.worker_side.stats()["lease_expired_requests"] == 1
    _assert_clean(producer)


def test_preempted_requests_resume_on_correct_kv_and_free_everything(engines, model_dir):
    engine = _engine(engines, model_dir, {"backend": "cpu"}, num_blocks=14)
    reqs = [engine.add(_prompt(2 * BLOCK + 3, seed=s), max_tokens=3 * BLOCK) for s in range(4)]
    engine.run(timeout_s=60)
    assert all(len(engine.tokens(r)) == 3 * BLOCK for r in reqs)
    assert engine.preempted, "the test must make vLLM preempt"
    _assert_clean(engine)


@pytest.mark.parametrize("lost", ["one", "all"])
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_blocks_that_fail_to_load_follow_vllms_failure_policy(engines, model_dir, policy, lost):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer", policy=policy)
    prompt = _prompt(4 * BLOCK + 2)
    params = _prefill(producer, prompt)
    keys = RequestKeys(params["kvmux"]["namespace"], BLOCK).upto(prompt, len(prompt))
    dropped = [keys[2]] if lost == "one" else keys
    _wrap(consumer, lambda inner: DropKeys(inner, keys=dropped))
    req = consumer.add(prompt, max_tokens=3, params=params)
    consumer.run()  # a request that lost blocks is not sent to load them again
    assert consumer.worker.worker_side.stats()["load_error_blocks"] == len(dropped)
    if policy == "recompute":
        assert len(consumer.tokens(req)) == 3
    else:
        assert consumer.result(req).finish_reason == FinishReason.ERROR
    _assert_clean(consumer)


def test_an_unknown_backend_fails_engine_start_with_a_did_you_mean(model_dir):
    """Refused while vLLM builds its config (preflight), before any connector exists."""
    with pytest.raises(ExtraConfigError, match="Did you mean 'shm'") as info:
        FakeEngine(model_dir, {"backend": "shn"})
    assert isinstance(info.value.__cause__, UnknownBackendError)
    assert "kv_connector_extra_config.backend" in str(info.value)


def test_a_bad_adapter_option_names_its_path(model_dir):
    with pytest.raises(ExtraConfigError, match=r"kv_connector_extra_config\.vllm\.lease_s") as info:
        FakeEngine(model_dir, {"backend": "cpu", "vllm": {"lease_s": -1}})
    assert isinstance(info.value.__cause__, ConfigError)
    assert "(got -1)" in str(info.value)


def test_prefill_params_for_other_tokens_are_refused_not_loaded(engines, model_dir):
    producer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = _engine(engines, model_dir, {"backend": "tcp"}, role="kv_consumer")
    params = _prefill(producer, _prompt(2 * BLOCK + 1))
    req = consumer.add(_prompt(2 * BLOCK + 1, seed=5), max_tokens=2, params=params)
    consumer.step()
    assert consumer.status(req) != RequestStatus.WAITING_FOR_REMOTE_KVS
    consumer.run()
    assert "load_calls" not in consumer.worker.worker_side.connector.stats()
    _assert_clean(consumer)


def test_connector_stats_add_up_across_workers_and_reduce_to_rates():
    from kvmux.adapters.vllm.stats import KvmuxStats

    a = KvmuxStats(data={"load_bytes": 2e9, "load_seconds": 1.0})
    b = KvmuxStats(data={"load_bytes": 2e9, "load_seconds": 1.0, "save_calls": 1})
    reduced = a.aggregate(b).reduce()
    assert reduced["load_bytes"] == 4e9 and reduced["save_calls"] == 1
    assert reduced["load_GBps"] == 2.0
    assert KvmuxStats(data={}).is_empty()
    assert KvmuxConnector.build_kv_connector_stats({"x": 1}).data == {"x": 1}


def test_kvmux_counters_reach_prometheus_under_one_labelled_metric(engines, model_dir):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvmux.adapters.vllm.stats import KvmuxPromMetrics

    registry = CollectorRegistry()

    def bind(cls: Any) -> Any:
        return lambda *a, **kw: cls(*a, registry=registry, **kw)

    engine_config = _engine(engines, model_dir, {"backend": "cpu"}).config
    metrics = KvmuxConnector.build_prom_metrics(
        engine_config,
        {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
        ["engine"],
        {0: ["0"]},
    )
    assert isinstance(metrics, KvmuxPromMetrics)
    metrics.observe({"load_bytes": 4096, "child.1.fallbacks": 2, "unchanged": 0})
    metrics.observe({"load_bytes": 4096})
    value = registry.get_sample_value
    assert value("vllm:kvmux_stat_total", {"engine": "0", "stat": "load_bytes"}) == 8192
    assert value("vllm:kvmux_stat_total", {"engine": "0", "stat": "child.1.fallbacks"}) == 2


# ------------------------------------------------- borrowed blocks (save_mode borrow)

BORROW = {"backend": "tcp", "save_mode": "borrow"}


def _lent(engine: FakeEngine) -> float:
    return engine.worker.worker_side.stats().get("lent_blocks", 0)


def _step_until_clean(engine: FakeEngine, timeout_s: float = 10.0) -> None:
    """Step until vLLM holds no request (a delayed free ends once the blocks are back)."""
    _step_until(engine, lambda: not engine.scheduler.requests, timeout_s)


def test_borrowed_blocks_reach_the_decode_and_return_once_it_has_them(engines, model_dir):
    producer = _engine(engines, model_dir, BORROW, role="kv_producer")
    consumer = _engine(engines, model_dir, BORROW, role="kv_consumer")
    prompt = _prompt(3 * BLOCK + 5)
    prefill = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    producer.run(until=[prefill])
    params = dict(producer.result(prefill).kv_transfer_params)
    assert _lent(producer) == 4  # nothing copied: the engine's own blocks, held for the decode
    assert producer.scheduler.requests, "vLLM freed blocks a consumer has yet to read"
    req = consumer.add(prompt, max_tokens=4, params=params)
    consumer.run()
    assert len(consumer.tokens(req)) == 4  # the fake model checked every loaded block
    assert consumer.worker.worker_side.connector.stats()["load_blocks_ok"] == 4
    _step_until_clean(producer)
    assert _lent(producer) == 0
    _assert_clean(producer)
    _assert_clean(consumer)


def test_borrowed_blocks_nobody_pulls_return_at_the_lease_end(engines, model_dir):
    extra = {**BORROW, "vllm": {"lease_s": 0.3}}
    producer = _engine(engines, model_dir, extra, role="kv_producer")
    req = producer.add(_prompt(2 * BLOCK + 1), max_tokens=1, params={"do_remote_decode": True})
    producer.run(until=[req])
    started = time.monotonic()
    _step_until_clean(producer)
    assert time.monotonic() - started >= 0.2
    assert _lent(producer) == 0
    _assert_clean(producer)


def test_preempted_requests_give_borrowed_blocks_back_and_resume_on_correct_kv(engines, model_dir):
    engine = _engine(engines, model_dir, BORROW, num_blocks=14)
    reqs = [engine.add(_prompt(2 * BLOCK + 3, seed=s), max_tokens=3 * BLOCK) for s in range(4)]
    engine.run(timeout_s=60)
    assert all(len(engine.tokens(r)) == 3 * BLOCK for r in reqs)
    assert engine.preempted, "the test must make vLLM preempt"
    assert _lent(engine) == 0
    _assert_clean(engine)
