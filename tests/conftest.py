"""Shared fixtures: small KV layouts, fake installed distributions, the vLLM reference."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvmux.connector import Connector

from support import caches, fake_dist, layout

__all__ = [
    "caches",
    "engines",
    "fake_dist",
    "layout",
    "opened",
    "tiny_model_dir",
    "vllm_reference",
]


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from kvmux.models import tiny_model

    return str(tiny_model())


@pytest.fixture(scope="session")
def vllm_reference(tiny_model_dir: str) -> list[list[int]]:
    """Greedy tokens of one plain vLLM instance for the shared prompts: what kvmux must match."""
    pytest.importorskip("vllm")
    from vllm_e2e_support import reference_tokens

    return reference_tokens(tiny_model_dir)


@pytest.fixture
def opened() -> Iterator[list[Connector]]:
    """Connectors a test opens (it appends them); closed, newest first, when it ends
    (waking any injected sleep)."""
    conns: list[Connector] = []
    yield conns
    for conn in reversed(conns):
        conn.close()


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """The ``vllm_harness.FakeEngine``s a test makes (it appends them), closed after it."""
    made: list[Any] = []
    yield made
    for engine in made:
        engine.close()
