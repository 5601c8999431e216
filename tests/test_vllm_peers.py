"""Real vLLM engines (CPU) whose P/D peer restarts, or is not the same model.

* A prefill engine killed (SIGKILL) and restarted on the same port: the
  decode engine, never restarted, fails the dead prefill's params at once
  (recomputing, so its tokens stay right) and loads the new prefill's.
* A prefill and a decode of two different models, and one model prefilled in
  float32 but decoded in bfloat16: the load is refused with one log line per
  request naming the field that differs, and the decode's tokens are its own
  single-instance output.

Prompts and the reference: ``vllm_e2e_support``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.models import TinyModelSpec, tiny_model
from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import (
    LOADED_BLOCKS,
    MAX_TOKENS,
    PROMPTS,
    backend_param,
    prefill,
    spec,
    tokens,
)

from support import free_port

pytestmark = pytest.mark.timeout(900)

TIMEOUT_S = 30.0
"""The backends' ``timeout_s``: a refusal that came from waiting it out would show."""
FAST_S = 20.0
"""A decode whose loads are refused at once ends well before ``TIMEOUT_S``."""


def _stats(engine: EngineProcess) -> dict[str, float]:
    stats: dict[str, float] = engine.call("stats")["stats"]
    return stats


def _decode(engine: EngineProcess, params: list[dict[str, Any]]) -> tuple[list[list[int]], float]:
    """Decode the prompts from ``params`` with the engine's own prefix cache emptied
    (else a second decode of the same prompts would load nothing); tokens and seconds."""
    assert engine.call("reset_prefix_cache")["ok"]
    start = time.monotonic()
    out = tokens(engine.generate(PROMPTS, MAX_TOKENS, params))
    return out, time.monotonic() - start


def _log_lines(engine: EngineProcess, *needles: str) -> list[str]:
    return [line for line in engine.log_tail(400).splitlines() if all(n in line for n in needles)]


@pytest.mark.parametrize(
    "backend", [backend_param("tcp"), backend_param("shm"), backend_param("nixl", "nixl")]
)
def test_a_prefill_restarted_on_its_port_is_never_read_as_the_old_one(
    tiny_model_dir: str, vllm_reference: list[list[int]], backend: str
) -> None:
    producer_config = {"backend": backend, "port": free_port(), "timeout_s": TIMEOUT_S}
    producer_spec = spec(tiny_model_dir, producer_config, "kv_producer")
    consumer_spec = spec(
        tiny_model_dir, {"backend": backend, "timeout_s": TIMEOUT_S}, "kv_consumer"
    )
    producer = EngineProcess(producer_spec, wait=False)
    consumer = EngineProcess(consumer_spec, wait=False)
    restarted: EngineProcess | None = None
    try:
        old_params = prefill(producer)
        decoded, _ = _decode(consumer, old_params)
        assert decoded == vllm_reference
        assert _stats(consumer)["load_blocks_ok"] == LOADED_BLOCKS

        producer.kill()
        restarted = EngineProcess(producer_spec)
        decoded, seconds = _decode(consumer, old_params)
        assert decoded == vllm_reference  # recomputed
        assert seconds < FAST_S, f"stale loads took {seconds:.1f} s (timeout_s {TIMEOUT_S})"
        stats = _stats(consumer)
        assert stats["load_blocks_failed"] == LOADED_BLOCKS
        assert len(_log_lines(consumer, "PeerRestartedError", "restarted")) == len(PROMPTS)

        decoded, _ = _decode(consumer, prefill(restarted))  # the same decode engine
        assert decoded == vllm_reference
        assert _stats(consumer)["load_blocks_ok"] == 2 * LOADED_BLOCKS
    finally:
        for engine in (producer, consumer, restarted):
            if engine is not None:
                engine.stop()


def _reference(model: str, **kw: Any) -> list[list[int]]:
    with EngineProcess(spec(model, None, **kw)) as engine:
        return tokens(engine.generate(PROMPTS, MAX_TOKENS))


def test_pd_between_two_models_recomputes_naming_the_model(tiny_model_dir: str) -> None:
    other_model = str(tiny_model(TinyModelSpec(seed=1)))
    backend = {"backend": "shm", "timeout_s": TIMEOUT_S}
    producer = EngineProcess(spec(tiny_model_dir, backend, "kv_producer"), wait=False)
    consumer = EngineProcess(spec(other_model, backend, "kv_consumer"), wait=False)
    try:
        reference = _reference(other_model)
        decoded, _ = _decode(consumer, prefill(producer))
        assert decoded == reference
        lines = _log_lines(consumer, "model differs", repr(tiny_model_dir), repr(other_model))
        assert len(lines) == len(PROMPTS), consumer.log_tail()
        assert _stats(consumer).get("load_blocks_ok", 0) == 0
    finally:
        producer.stop()
        consumer.stop()


def test_a_float32_prefill_is_refused_by_a_bfloat16_decode_naming_the_dtype(
    tiny_model_dir: str,
) -> None:
    """One model under one ``namespace`` (so the keys agree and the request reaches the
    handshake), computed in two dtypes: its KV is not interchangeable."""
    backend = {"backend": "tcp", "timeout_s": TIMEOUT_S, "vllm": {"namespace": "tiny"}}
    producer = EngineProcess(spec(tiny_model_dir, backend, "kv_producer"), wait=False)
    consumer = EngineProcess(
        spec(tiny_model_dir, backend, "kv_consumer", dtype="bfloat16"), wait=False
    )
    try:
        reference = _reference(tiny_model_dir, dtype="bfloat16")
        decoded, seconds = _decode(consumer, prefill(producer))
        assert decoded == reference  # recomputed in bfloat16, as a single instance would
        assert seconds < FAST_S
        needle = "dtype differs: the producer's is 'float32', the consumer's 'bfloat16'"
        lines = _log_lines(consumer, "IncompatiblePeerError", needle)
        assert len(lines) == len(PROMPTS), consumer.log_tail()
        stats = _stats(consumer)
        assert stats["load_blocks_failed"] == LOADED_BLOCKS
        assert stats.get("load_blocks_ok", 0) == 0
    finally:
        producer.stop()
        consumer.stop()
