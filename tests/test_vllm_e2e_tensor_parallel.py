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
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, pd_engines, prefill, spec, tokens

pytestmark = pytest.mark.timeout(900)

START_TIMEOUT_S = 600.0
"""A TP=2 engine is three processes (core and two ranks) starting on a shared 2-core box."""


@pytest.fixture(params=[(1, 2), (2, 1)], ids=lambda p: f"prefill-tp{p[0]}-decode-tp{p[1]}")
def tp_pair(
    request: Any, tiny_model_dir: str
) -> Iterator[tuple[int, int, EngineProcess, EngineProcess]]:
    prefill_tp, decode_tp = request.param
    backend = {"backend": "tcp"}
    with pd_engines(
        spec(tiny_model_dir, backend, "kv_producer", tensor_parallel_size=prefill_tp),
        spec(tiny_model_dir, backend, "kv_consumer", tensor_parallel_size=decode_tp),
        start_timeout_s=START_TIMEOUT_S,
    ) as (producer, consumer):
        yield prefill_tp, decode_tp, producer, consumer


def test_pd_between_tp_sizes_gives_the_tokens_of_a_single_tp1_instance(tp_pair, vllm_reference):
    prefill_tp, decode_tp, producer, consumer = tp_pair
    params = prefill(producer)
    assert all(p["tp_size"] == prefill_tp for p in params)
    decoded = consumer.generate(PROMPTS, MAX_TOKENS, params)
    assert tokens(decoded) == vllm_reference
    ranks = consumer.call("stats")["ranks"]
    assert len(ranks) == decode_tp
    slices = max(1, prefill_tp // decode_tp)  # a block comes from each rank holding its heads
    for stats in ranks:
        assert stats["load_blocks_ok"] == LOADED_BLOCKS * slices
        assert stats.get("load_blocks_failed", 0) == stats.get("load_blocks_missing", 0) == 0


def test_a_decode_of_another_block_size_computes_locally_naming_it(tiny_model_dir, vllm_reference):
    """vLLM runs a prefill and a decode of different block sizes; kvmux keys blocks of
    ``block_size`` tokens, so it refuses, in one line, and the decode computes."""
    backend = {"backend": "tcp"}
    with pd_engines(
        spec(tiny_model_dir, backend, "kv_producer"),
        spec(tiny_model_dir, backend, "kv_consumer", block_size=64),
    ) as (producer, consumer):
        decoded = consumer.generate(PROMPTS, MAX_TOKENS, prefill(producer))
        assert tokens(decoded) == vllm_reference
        refusals = [
            line
            for line in consumer.log_tail(400).splitlines()
            if "block_size differs: the prefill's is 128, this decode's 64" in line
        ]
        assert len(refusals) == len(PROMPTS)
        assert "load_calls" not in consumer.call("stats")["stats"]
