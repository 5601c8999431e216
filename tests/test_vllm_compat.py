"""A prefill and a decode that are not the same model: refused, named, recomputed.

vLLM's real Scheduler and kvmux's adapter with the fake model of
``vllm_harness`` (which checks every KV it reads). Two ways a mismatch shows:

* by default the block keys name the model, so the decode's scheduler sees
  the prefill's params are for another model and computes locally;
* with a shared ``namespace`` (declared to be one model), the keys agree and
  the P2P handshake is what refuses: the load fails per block and vLLM's
  ``kv_load_failure_policy`` recomputes them.

Either way one log line per request names the field that differs.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.models import TinyModelSpec, tiny_model
from vllm_harness import BLOCK, FakeEngine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    return tiny_model(), tiny_model(TinyModelSpec(seed=1))


def _prompt(n: int) -> list[int]:
    return [3 + (i * 5) % 250 for i in range(n)]


def _pd(engines: list[FakeEngine], producer: FakeEngine, consumer: FakeEngine) -> str:
    """Prefill a prompt on ``producer``, decode it on ``consumer``; the decode's id."""
    engines += [producer, consumer]
    prompt = _prompt(3 * BLOCK + 5)
    req = producer.add(prompt, max_tokens=1, params={"do_remote_decode": True})
    producer.run()
    params = producer.result(req).kv_transfer_params
    decode = consumer.add(prompt, max_tokens=4, params=params)
    consumer.run()
    assert len(consumer.tokens(decode)) == 4
    assert consumer.kv_errors == []  # it decoded on KV it computed itself, and it was right
    return decode


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_decode_of_another_model_computes_locally_naming_the_model(engines, models, caplog):
    caplog.set_level(logging.WARNING, logger="kvmux")
    prefill_model, decode_model = models
    tcp = {"backend": "tcp"}
    decode = _pd(
        engines,
        FakeEngine(prefill_model, tcp, role="kv_producer"),
        FakeEngine(decode_model, tcp, role="kv_consumer"),
    )
    lines = _lines(caplog, decode)
    assert len(lines) == 1, lines
    assert "another model: model differs" in lines[0]
    assert repr(str(prefill_model)) in lines[0] and repr(str(decode_model)) in lines[0]
    assert "load_calls" not in engines[-1].worker.worker_side.connector.stats()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_one_model_in_two_dtypes_is_refused_at_the_handshake_naming_the_dtype(
    engines, models, caplog, backend
):
    caplog.set_level(logging.WARNING, logger="kvmux")
    model, _ = models
    shared = {"backend": backend, "vllm": {"namespace": "tiny"}}
    decode = _pd(
        engines,
        FakeEngine(model, shared, role="kv_producer", dtype="float32"),
        FakeEngine(model, shared, role="kv_consumer", dtype="bfloat16"),
    )
    lines = _lines(caplog, decode)
    assert len(lines) == 1, lines
    assert "did not load" in lines[0] and "IncompatiblePeerError" in lines[0]
    assert "dtype differs: the producer's is 'float32', the consumer's 'bfloat16'" in lines[0]
    stats = engines[-1].worker.worker_side.stats()
    assert stats["load_error_blocks"] == 4 and stats.get("load_blocks_ok", 0) == 0
