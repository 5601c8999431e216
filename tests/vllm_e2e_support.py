"""What the real-engine tests share: prompts, engine specs and the single-instance reference.

Prompts are a few CPU blocks (128 tokens) long and prefilled in chunks smaller
than a prompt, so every path (several steps per prompt, a partial last block)
runs. The model runs in float32, where a prefix loaded from elsewhere plus a
recomputed tail give the logits of one full prefill (shared/NOTES.md: bf16
needs vLLM's own prefix-cache hit as the reference instead).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest

from kvmux.models import random_prompts
from kvmux.testing.vllm_engine import EngineProcess, EngineSpec

BLOCK = 128
MAX_TOKENS = 12
CHUNK = 256  # max_num_batched_tokens: below every prompt's length
PROMPTS = [p for i, n in enumerate((300, 389, 517)) for p in random_prompts(1, n, seed=i)]
LOADED_BLOCKS = sum(math.ceil(len(p) / BLOCK) for p in PROMPTS)
FULL_BLOCKS = sum(len(p) // BLOCK for p in PROMPTS)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (an optional backend's package)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def backend_param(name: str, module: str | None = None) -> Any:
    """``name`` as a pytest parameter, skipped where ``module`` (the optional package the
    backend needs) is not installed."""
    missing = module is not None and not installed(module)
    return pytest.param(name, marks=pytest.mark.skipif(missing, reason=f"no {module}"), id=name)


@contextlib.contextmanager
def pd_engines(
    producer: EngineSpec, consumer: EngineSpec, **engine: Any
) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    """A prefill and a decode engine, started together (their slow starts overlap) and
    ready; both stopped by PID when the ``with`` block ends, whatever happened in it.
    ``engine``: more :class:`EngineProcess` arguments (``start_timeout_s``)."""
    started: list[EngineProcess] = []
    try:
        for role in (producer, consumer):
            started.append(EngineProcess(role, wait=False, **engine))
        for process in started:
            process.wait_ready()
        yield started[0], started[1]
    finally:
        for process in started:
            process.stop()


def spec(model: str, backend: dict[str, Any] | None, role: str = "kv_both", **kw: Any) -> Any:
    transfer = None
    if backend is not None:
        transfer = {
            "kv_connector": "kvmux",
            "kv_role": role,
            "kv_connector_extra_config": backend,
            "kv_load_failure_policy": kw.pop("policy", "recompute"),
        }
    return EngineSpec(model=model, max_num_batched_tokens=CHUNK, kv_transfer_config=transfer, **kw)


def reference_tokens(model: str) -> list[list[int]]:
    with EngineProcess(spec(model, None)) as engine:
        return tokens(engine.generate(PROMPTS, MAX_TOKENS))


def tokens(outputs: list[dict[str, Any]]) -> list[list[int]]:
    return [o["token_ids"] for o in outputs]


def prefill(
    producer: EngineProcess, prompts: list[list[int]] | None = None
) -> list[dict[str, Any]]:
    prompts = PROMPTS if prompts is None else prompts
    outs = producer.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    params = [o["kv_transfer_params"] for o in outs]
    assert all(p and p["do_remote_prefill"] for p in params), params
    return params
