"""Real vLLM engines (CPU) with kvmux: greedy tokens must equal a single instance's.

Each engine runs in its own process (``kvmux.testing.vllm_engine``): vLLM
keeps one KV connector per process. Prompts and the reference: ``vllm_e2e_support``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvmux.testing.vllm_engine import EngineProcess
from vllm_e2e_support import (
    FULL_BLOCKS,
    LOADED_BLOCKS,
    MAX_TOKENS,
    PROMPTS,
    backend_param,
    installed,
    pd_engines,
    prefill,
    spec,
    tokens,
)

from support import run_lmcache_server, run_master

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(
    scope="module",
    params=[
        backend_param("shm"),
        backend_param("tcp"),
        backend_param("nixl", "nixl"),
        backend_param("mooncake", "mooncake"),
        backend_param("tcp-borrow"),
        backend_param("nixl-borrow", "nixl"),
    ],
)
def pd_pair(
    request: Any, tiny_model_dir: str
) -> Iterator[tuple[str, EngineProcess, EngineProcess]]:
    name, _, mode = request.param.partition("-")
    backend = {"backend": name, **({"save_mode": mode} if mode else {})}
    roles = (spec(tiny_model_dir, backend, role) for role in ("kv_producer", "kv_consumer"))
    with pd_engines(*roles) as (producer, consumer):
        yield request.param, producer, consumer


def test_pd_decode_gives_the_tokens_of_a_single_instance(pd_pair, vllm_reference):
    _, producer, consumer = pd_pair
    decoded = consumer.generate(PROMPTS, MAX_TOKENS, prefill(producer))
    assert tokens(decoded) == vllm_reference
    stats = consumer.call("stats")["stats"]
    assert stats["load_blocks_ok"] == LOADED_BLOCKS  # the whole prompt, partial blocks too
    assert stats.get("load_blocks_failed", 0) == stats.get("load_blocks_missing", 0) == 0


def test_pd_comparison_fails_when_the_moved_kv_is_tampered_with(pd_pair, vllm_reference):
    """The control: if identity held whatever KV arrived, the tests above would prove nothing."""
    _, producer, consumer = pd_pair
    params = prefill(producer)
    assert consumer.call("reset_prefix_cache")["ok"]
    consumer.call("corrupt_loads")
    decoded = consumer.generate(PROMPTS, MAX_TOKENS, params)
    assert tokens(decoded) != vllm_reference


@pytest.mark.parametrize(
    "backend",
    [
        {"backend": "cpu"},
        pytest.param(
            {"backend": "lmcache", "max_local_cpu_gb": 0.25},
            marks=pytest.mark.skipif(not installed("lmcache"), reason="no lmcache"),
            id="lmcache",
        ),
    ],
    ids=lambda b: b["backend"],
)
def test_saved_prefix_reloaded_gives_the_tokens_of_a_single_instance(
    tiny_model_dir, vllm_reference, backend
):
    with EngineProcess(spec(tiny_model_dir, backend)) as engine:
        assert tokens(engine.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
        assert engine.call("reset_prefix_cache")["ok"]  # vLLM forgets; kvmux must remember
        assert tokens(engine.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
        stats = engine.call("stats")["stats"]
    assert stats["load_blocks_ok"] == FULL_BLOCKS


def _after_a_restart(
    model: str, backend: dict[str, Any], reference: list[list[int]]
) -> dict[str, float]:
    """Run the prompts in an engine, stop it, run them again in a fresh engine on the same
    backend config: both give the single-instance tokens. The fresh engine's counters."""
    with EngineProcess(spec(model, backend)) as first:
        assert tokens(first.generate(PROMPTS, MAX_TOKENS)) == reference
    with EngineProcess(spec(model, backend)) as second:
        assert tokens(second.generate(PROMPTS, MAX_TOKENS)) == reference
        stats: dict[str, float] = second.call("stats")["stats"]
    return stats


def test_disk_blocks_survive_an_engine_restart(tiny_model_dir, vllm_reference, tmp_path: Path):
    backend = {"backend": "disk", "path": str(tmp_path / "kv")}
    stats = _after_a_restart(tiny_model_dir, backend, vllm_reference)
    assert stats["load_blocks_ok"] == FULL_BLOCKS


@pytest.mark.skipif(not installed("mooncake"), reason="no mooncake")
def test_mooncake_store_blocks_reach_a_fresh_engine(tiny_model_dir, vllm_reference):
    """Another engine process, which never saw the prompts, loads every full block that the
    first one saved in the store. A store value lives in its writer's segment (the store is
    not persistent: a reader started after the writer stopped finds nothing), so the writer
    stays up meanwhile, as in a deployment."""
    with run_master() as (master, _):
        backend = {
            "backend": "buffers:mooncake-store",
            "master_address": master,
            "global_segment_bytes": 32 * 2**20,
            "local_buffer_bytes": 32 * 2**20,
        }
        with EngineProcess(spec(tiny_model_dir, backend)) as writer:
            assert tokens(writer.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
            assert writer.call("stats")["stats"].get("load_blocks_ok", 0) == 0
            with EngineProcess(spec(tiny_model_dir, backend)) as reader:
                assert tokens(reader.generate(PROMPTS, MAX_TOKENS)) == vllm_reference
                stats = reader.call("stats")["stats"]
    assert stats["load_blocks_ok"] == FULL_BLOCKS
    assert stats.get("load_blocks_failed", 0) == stats.get("load_blocks_missing", 0) == 0


@pytest.mark.skipif(not installed("lmcache"), reason="no lmcache")
def test_lmcache_server_blocks_survive_an_engine_restart(tiny_model_dir, vllm_reference):
    """LMCache's engine in each vLLM process, an ``lmcache_server`` behind it: a
    fresh engine loads, in LMCache's own format, every full block the first saved."""
    with run_lmcache_server() as (url, _):
        backend = {"backend": "lmcache", "remote_url": url, "max_local_cpu_gb": 0.25}
        stats = _after_a_restart(tiny_model_dir, backend, vllm_reference)
    assert stats["load_blocks_ok"] == FULL_BLOCKS
    assert stats.get("load_blocks_failed", 0) == stats.get("load_blocks_missing", 0) == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_producer_killed_before_the_pull(tiny_model_dir, vllm_reference, policy):
    """The decode finds a dead peer: recompute gives the same tokens, fail ends the requests
    with an error; neither hangs past the backend's timeout."""
    backend = {"backend": "tcp", "timeout_s": 5}
    with pd_engines(
        spec(tiny_model_dir, backend, "kv_producer"),
        spec(tiny_model_dir, backend, "kv_consumer", policy=policy),
    ) as (producer, consumer):
        params = prefill(producer)
        producer.kill()
        started = time.monotonic()
        decoded = consumer.generate(PROMPTS, MAX_TOKENS, params)
        assert time.monotonic() - started < 60
        if policy == "recompute":
            assert tokens(decoded) == vllm_reference
        else:
            assert {o["finish_reason"] for o in decoded} == {"error"}
        assert consumer.call("stats")["stats"]["load_blocks_failed"] == LOADED_BLOCKS
