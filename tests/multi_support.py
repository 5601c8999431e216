"""What the multi tests share: ``cpu`` pool children, one request's keys and blocks."""

from __future__ import annotations

from kvmux.backend import Backend
from kvmux.backends.cpu import CpuPoolBackend, CpuPoolConfig
from kvmux.keys import BlockKey, chain_keys

N = 8
"""Blocks of one request."""

SRC, DST = list(range(N)), list(range(16, 16 + N))
"""Where a request's blocks are saved from and loaded into (a 32-block memory)."""


def pool(timeout_s: float = 2.0) -> Backend:
    """A child: a small ``cpu`` pool."""
    return CpuPoolBackend(CpuPoolConfig(capacity_bytes=2**20, timeout_s=timeout_s))


def keys(n: int = N, tag: str = "multi") -> list[BlockKey]:
    return chain_keys(list(range(n * 4)), 4, tag)
