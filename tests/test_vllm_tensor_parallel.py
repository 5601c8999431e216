"""P/D between engines of different tensor-parallel sizes: KV heads split or gathered.

vLLM's real Scheduler and kvmux's adapter with ``vllm_harness``'s fake model,
whose KV value depends on the token, its position and the (global) KV head,
and which checks, every step, every head of every rank's KV it reads. A
decode rank that got another rank's heads, or heads in the wrong place,
fails there.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.adapters.vllm.tensor_parallel import HeadSlice, head_slices, mapping_note
from kvmux.models import TinyModelSpec, tiny_model
from vllm_harness import BLOCK, FakeEngine

from support import wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir() -> Any:
    return tiny_model()


def _prompt(n: int) -> list[int]:
    return [3 + (i * 7) % 250 for i in range(n)]


def _backend(name: str, tmp_path: Path) -> dict[str, Any]:
    return (
        {"backend": "disk", "path": str(tmp_path / "kv")} if name == "disk" else {"backend": name}
    )


def _pd(
    engines: list[FakeEngine], producer: FakeEngine, consumer: FakeEngine, blocks: int = 3
) -> tuple[str, str, dict[str, Any]]:
    """Prefill on ``producer``, decode on ``consumer``: (prefill id, decode id, params)."""
    engines += [producer, consumer]
    prompt = _prompt(blocks * BLOCK + 5)
    req = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    producer.run()
    params = dict(producer.result(req).kv_transfer_params)
    decode = consumer.add(prompt, max_tokens=4, params=params)
    consumer.run()
    assert len(consumer.tokens(decode)) == 4
    assert consumer.kv_errors == []
    return req, decode, params


def _reference_tokens(engines: list[FakeEngine], model_dir: Any, blocks: int = 3) -> list[int]:
    single = FakeEngine(model_dir, {"backend": "cpu"}, role="kv_both")
    engines.append(single)
    req = single.add(_prompt(blocks * BLOCK + 5), max_tokens=4)
    single.run()
    return single.tokens(req)


def test_head_slices_split_and_gather_by_rank() -> None:
    assert head_slices(4, 1, 2, 1) == [HeadSlice(0, 2, 0, 2)]
    assert head_slices(4, 2, 1, 0) == [HeadSlice(0, 0, 0, 2), HeadSlice(1, 0, 2, 2)]
    assert head_slices(8, 2, 4, 3) == [HeadSlice(1, 2, 0, 2)]
    assert head_slices(8, 4, 2, 1) == [HeadSlice(2, 0, 0, 2), HeadSlice(3, 0, 2, 2)]
    assert head_slices(4, 2, 2, 1) == [HeadSlice(1, 0, 0, 2)]


def test_heads_replicated_over_ranks_are_not_mapped() -> None:
    with pytest.raises(ValueError, match="2 KV heads are not divisible by the decode's TP size 4"):
        head_slices(2, 1, 4, 0)
    with pytest.raises(ValueError, match="prefill's TP size 3"):
        mapping_note(4, 3, 1)


@pytest.mark.parametrize("backend", ["tcp", "shm", "disk"])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 2)])
def test_a_decode_of_another_tp_size_runs_on_exactly_its_heads(
    engines, model_dir, tmp_path, caplog, backend, prefill_tp, decode_tp
):
    caplog.set_level(logging.INFO, logger="kvmux")
    config = _backend(backend, tmp_path)
    producer = FakeEngine(model_dir, config, role="kv_producer", tp_size=prefill_tp)
    consumer = FakeEngine(model_dir, config, role="kv_consumer", tp_size=decode_tp)
    _, decode, params = _pd(engines, producer, consumer)
    assert consumer.tokens(decode) == _reference_tokens(engines, model_dir)
    assert params["tp_size"] == prefill_tp
    sources = params["kvmux"]["sources"]
    assert (sources is None) == (prefill_tp == 1 or backend == "disk")
    if sources is not None:  # every prefill rank serves its own heads
        assert len({(s["host"], s["port"]) for s in sources}) == prefill_tp
    for worker in consumer.workers:  # each rank loaded all four blocks (its heads of them)
        stats = worker.worker_side.stats()
        slices = 1 if prefill_tp <= decode_tp else prefill_tp // decode_tp
        assert stats["load_blocks_ok"] == 4 * slices
        assert stats.get("load_error_blocks", 0) == 0
    mapped = [r.getMessage() for r in caplog.records if "mapping KV heads" in r.getMessage()]
    if prefill_tp == decode_tp:
        assert mapped == []
    else:
        assert len(mapped) == 1
        assert f"prefill TP={prefill_tp} -> decode TP={decode_tp} over 2 KV heads" in mapped[0]
    assert not consumer.scheduler.requests
    assert consumer.free_blocks() == consumer.free_at_start


def test_every_prefill_rank_releases_its_publication_once_the_decode_loaded(engines, model_dir):
    producer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_producer", tp_size=2)
    consumer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_consumer", tp_size=1)
    engines += [producer, consumer]
    prompt = _prompt(2 * BLOCK + 3)
    req = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    producer.run()
    ranks = [w.worker_side for w in producer.workers]
    assert [w.connector.stats()["pinned_blocks"] for w in ranks] == [3, 3]
    consumer.add(prompt, max_tokens=3, params=producer.result(req).kv_transfer_params)
    consumer.run()
    wait_until(lambda: all(w.stats().get("leases_released") == 1 for w in ranks), 5.0)
    assert [w.stats()["published_leases"] for w in ranks] == [0, 0]
    assert [w.connector.stats()["pinned_blocks"] for w in ranks] == [0, 0]
    assert consumer.worker.worker_side.stats()["lease_releases_sent"] == 2  # one per rank


def test_a_decode_on_a_fixed_port_pulls_foreign_ranks_from_free_ports(engines, model_dir):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    producer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_producer", tp_size=2)
    fixed = {"backend": "tcp", "port": port}
    consumer = FakeEngine(model_dir, fixed, role="kv_consumer")
    _pd(engines, producer, consumer)
    assert consumer.worker.worker_side.address()["port"] == port
    assert consumer.worker.worker_side.stats()["load_blocks_ok"] == 8


def test_a_decode_of_another_block_size_computes_locally_naming_the_block_size(
    engines, model_dir, caplog
):
    caplog.set_level(logging.WARNING, logger="kvmux")
    producer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_producer")
    consumer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_consumer", block_size=2 * BLOCK)
    _, decode, _ = _pd(engines, producer, consumer)
    lines = [r.getMessage() for r in caplog.records if decode in r.getMessage()]
    assert len(lines) == 1, lines
    assert "block_size differs: the prefill's is 16, this decode's 32" in lines[0]
    assert "load_calls" not in consumer.worker.worker_side.stats()


def test_another_model_of_another_tp_size_is_refused_naming_the_model(engines, model_dir, caplog):
    caplog.set_level(logging.WARNING, logger="kvmux")
    other = tiny_model(TinyModelSpec(seed=1))
    producer = FakeEngine(model_dir, {"backend": "tcp"}, role="kv_producer", tp_size=2)
    consumer = FakeEngine(other, {"backend": "tcp"}, role="kv_consumer")
    _, decode, _ = _pd(engines, producer, consumer)
    lines = [r.getMessage() for r in caplog.records if decode in r.getMessage()]
    assert len(lines) == 1, lines
    assert "another model: model differs" in lines[0]


def test_one_model_in_two_dtypes_and_tp_sizes_is_refused_at_the_handshake_naming_the_dtype(
    engines, model_dir, caplog
):
    caplog.set_level(logging.WARNING, logger="kvmux")
    shared = {"backend": "tcp", "vllm": {"namespace": "tiny"}}
    producer = FakeEngine(model_dir, shared, role="kv_producer", tp_size=2, dtype="float32")
    consumer = FakeEngine(model_dir, shared, role="kv_consumer", dtype="bfloat16")
    _, decode, _ = _pd(engines, producer, consumer)
    lines = [r.getMessage() for r in caplog.records if decode in r.getMessage()]
    assert len(lines) == 1, lines
    assert "dtype differs: the producer's is 'float32', the consumer's 'bfloat16'" in lines[0]
    assert consumer.worker.worker_side.stats().get("load_blocks_ok", 0) == 0
