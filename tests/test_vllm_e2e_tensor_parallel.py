"""Real vLLM engines of different TP sizes or block sizes: P/D tokens equal one TP=1 instance.

A TP=2 engine runs vLLM's multiprocessing executor, one worker process per
rank, each with its own kvmux connector (its own server for P2P backends)
holding one of the tiny model's two KV heads. The prefill's params carry both
ranks' addresses; a TP=1 decode takes a head from each prefill rank, and each
rank of a TP=2 decode takes its head out of the TP=1 prefill's blocks.
Counters come from every rank (``LLM.collective_rpc``), so a decode that
recomputed instead of loading fails on them, not only on tokens. A decode of
another block size is refused (kvmux keys are per block) and computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, prefill, spec, tokens

pytestmark = pytest.mark.timeout(900)

START_TIMEOUT_S = 600.0
"""A TP=2 engine is three processes (core and two ranks) starting on a shared 2-core box."""


@pytest.fixture(scope="module")
def model(tiny_model_dir: str) -> str:
    return tiny_model_dir


@pytest.fixture(scope="module")
def reference(vllm_reference: list[list[int]]) -> list[list[int]]:
    return vllm_reference


@pytest.fixture(params=[(1, 2), (2, 1)], ids=lambda p: f"prefill-tp{p[0]}-decode-tp{p[1]}")
def tp_pair(request: Any, model: str) -> Iterator[tuple[int, int, EngineProcess, EngineProcess]]:
    prefill_tp, decode_tp = request.param
    backend = {"backend": "tcp"}
    made: list[EngineProcess] = []
    try:
        for role, tp in (("kv_producer", prefill_tp), ("kv_consumer", decode_tp)):
            made.append(
                EngineProcess(
                    spec(model, backend, role, tensor_parallel_size=tp),
                    wait=False,
                    start_timeout_s=START_TIMEOUT_S,
                )
            )
        for engine in made:
            engine.wait_ready()
        yield prefill_tp, decode_tp, made[0], made[1]
    finally:
        for engine in made:
            engine.stop()


def test_pd_between_tp_sizes_gives_the_tokens_of_a_single_tp1_instance(tp_pair, reference):
    prefill_tp, decode_tp, producer, consumer = tp_pair
    params = prefill(producer)
    assert all(p["tp_size"] == prefill_tp for p in params)
    decoded = consumer.generate(PROMPTS, MAX_TOKENS, params)
    assert tokens(decoded) == reference
    ranks = consumer.call("stats")["ranks"]
    assert len(ranks) == decode_tp
    slices = max(1, prefill_tp // decode_tp)  # a block comes from each rank holding its heads
    for stats in ranks:
        assert stats["load_blocks_ok"] == LOADED_BLOCKS * slices
        assert stats.get("load_blocks_failed", 0) == stats.get("load_blocks_missing", 0) == 0


def test_a_decode_of_another_block_size_computes_locally_naming_it(model, reference):
    """vLLM runs a prefill and a decode of different block sizes; kvmux keys blocks of
    ``block_size`` tokens, so it refuses, in one line, and the decode computes."""
    backend = {"backend": "tcp"}
    producer = EngineProcess(spec(model, backend, "kv_producer"), wait=False)
    consumer = EngineProcess(spec(model, backend, "kv_consumer", block_size=64), wait=False)
    try:
        producer.wait_ready()
        consumer.wait_ready()
        decoded = consumer.generate(PROMPTS, MAX_TOKENS, prefill(producer))
        assert tokens(decoded) == reference
        refusals = [
            line
            for line in consumer.log_tail(400).splitlines()
            if "block_size differs: the prefill's is 128, this decode's 64" in line
        ]
        assert len(refusals) == len(PROMPTS)
        assert "load_calls" not in consumer.call("stats")["stats"]
    finally:
        producer.stop()
        consumer.stop()
