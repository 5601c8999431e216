"""``multi`` inside real vLLM engines: a sick first child never changes the tokens.

The composition is P/D over ``tcp`` with a shared ``disk`` behind it, under the
``fallback`` policy: the prefill saves to both; the decode pulls from the
prefill's pool and falls back, block by block, to the disk. Killing or
corrupting the first child must leave the greedy tokens equal to a single
instance's, served from the disk without recomputing; losing both must end in
vLLM's recompute, with the same tokens.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import LOADED_BLOCKS, MAX_TOKENS, PROMPTS, prefill, spec, tokens

pytestmark = pytest.mark.timeout(900)


def _fallback(disk: Path, first: dict[str, Any]) -> dict[str, Any]:
    return {
        "backend": "multi",
        "policy": "fallback",
        "children": [first, {"backend": "disk", "path": str(disk)}],
    }


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "kv"


def _pair(model: str, config: dict[str, Any]) -> tuple[EngineProcess, EngineProcess]:
    producer = EngineProcess(spec(model, config, "kv_producer"), wait=False)
    consumer = EngineProcess(spec(model, config, "kv_consumer"), wait=False)
    return producer, consumer


@pytest.fixture
def stopped() -> Iterator[list[EngineProcess]]:
    engines: list[EngineProcess] = []
    yield engines
    for engine in engines:
        engine.stop()


def test_first_child_killed_the_disk_child_serves_every_block(
    tiny_model_dir, vllm_reference, disk, stopped
):
    config = _fallback(disk, {"backend": "tcp", "timeout_s": 5})
    producer, consumer = _pair(tiny_model_dir, config)
    stopped += [producer, consumer]
    params = prefill(producer)
    producer.kill()  # the tcp child's peer is gone before the pull
    assert tokens(consumer.generate(PROMPTS, MAX_TOKENS, params)) == vllm_reference
    stats = consumer.call("stats")["stats"]
    assert stats["load_blocks_ok"] == LOADED_BLOCKS  # nothing left for vLLM to recompute
    assert stats["child.1.hits"] >= LOADED_BLOCKS
    assert stats["child.0.failures"] > 0

    # Both children gone: every block fails, vLLM recomputes, the tokens stay right.
    shutil.rmtree(disk)
    assert consumer.call("reset_prefix_cache")["ok"]
    assert tokens(consumer.generate(PROMPTS, MAX_TOKENS, params)) == vllm_reference
    assert consumer.call("stats")["stats"]["load_error_blocks"] == LOADED_BLOCKS


def test_first_child_corrupting_blocks_is_caught_by_checksums(
    tiny_model_dir, vllm_reference, disk, stopped
):
    first = {"backend": "checksum", "inner": {"backend": "tcp"}}
    producer, consumer = _pair(tiny_model_dir, _fallback(disk, first))
    stopped += [producer, consumer]
    params = prefill(producer)
    # Damage what the tcp transport delivers, below the checksum that must notice.
    consumer.call("corrupt_loads", path=["backend", "children", 0, "backend", "inner"])
    assert tokens(consumer.generate(PROMPTS, MAX_TOKENS, params)) == vllm_reference
    stats = consumer.call("stats")["stats"]
    assert stats["load_blocks_ok"] == LOADED_BLOCKS
    assert stats["child.0.failures"] > 0 and stats["child.1.hits"] >= LOADED_BLOCKS
