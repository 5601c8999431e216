"""KV memory for the suite: small engine-like tensors and an independent byte oracle.

The suite must not trust the code it checks, so it reads and writes blocks
here with plain tensor indexing on ``uint8`` views, never through
:class:`kvmux.blocks.BlockCopier` (which backends use). Data is random
*bytes*, not random numbers: any backend that converts values (through a
float, a NaN canonicalisation, a wrong dtype) changes some bytes and fails.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from kvmux.layout import KVLayout


@dataclass(frozen=True)
class LayoutCase:
    """The shape of an engine's KV cache: ``layers`` tensors of one dtype whose
    dimension ``block_dim`` indexes blocks and whose other dimensions are ``block_shape``."""

    id: str
    dtype: torch.dtype
    layers: int
    block_shape: tuple[int, ...]
    block_dim: int = 0
    block_size: int = 4

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        dims = list(self.block_shape)
        dims.insert(self.block_dim, num_blocks)
        return tuple(dims)

    @property
    def block_nbytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.layers * math.prod(self.block_shape) * itemsize


LAYOUTS: tuple[LayoutCase, ...] = (
    LayoutCase("float16-2layers", torch.float16, 2, (4, 2, 8)),
    LayoutCase("bfloat16-2layers", torch.bfloat16, 2, (4, 2, 8)),
    LayoutCase("float32-3layers", torch.float32, 3, (4, 2, 4)),
    # vLLM's (2, num_blocks, block_size, heads, head_dim): K and V share a tensor,
    # so one block is two strided slices, not one contiguous range.
    LayoutCase("vllm-kv-first-bfloat16", torch.bfloat16, 2, (2, 4, 2, 8), block_dim=1),
)
"""Layouts every round-trip test runs on."""

DEFAULT_LAYOUT = LAYOUTS[0]

TINY_LAYOUT = LayoutCase("tiny-float16", torch.float16, 1, (4, 2, 8))
"""128-byte blocks, for tests that move thousands of them."""


class KVMemory:
    """One engine instance's KV tensors, with helpers to fill and read whole blocks."""

    def __init__(self, case: LayoutCase, num_blocks: int, device: str, seed: int) -> None:
        self.case = case
        self.num_blocks = num_blocks
        self.caches = {
            f"layer.{i}": torch.zeros(case.shape(num_blocks), dtype=case.dtype, device=device)
            for i in range(case.layers)
        }
        self.layout = KVLayout.from_caches(self.caches, case.block_size, case.block_dim)
        self._gen = torch.Generator().manual_seed(seed)
        self.fill_random(range(num_blocks))  # zeros would hide a backend that loads nothing

    def _u8(self, name: str) -> torch.Tensor:
        return self.caches[name].view(torch.uint8)

    def fill_random(self, block_ids: range | list[int]) -> None:
        """Give each block fresh random bytes (never what it held before)."""
        for name in self.caches:
            u8 = self._u8(name)
            for block in block_ids:
                dst = u8.select(self.case.block_dim, block)
                noise = torch.randint(0, 256, dst.shape, generator=self._gen, dtype=torch.uint8)
                dst.copy_(noise.to(dst.device))

    def blocks(self, block_ids: list[int] | range) -> torch.Tensor:
        """A CPU ``[len(block_ids), block_nbytes]`` copy of the blocks, layers end to end."""
        index = torch.tensor(list(block_ids), dtype=torch.long)
        parts = []
        for name in self.caches:
            u8 = self._u8(name)
            picked = u8.index_select(self.case.block_dim, index.to(u8.device))
            parts.append(picked.movedim(self.case.block_dim, 0).reshape(len(index), -1).cpu())
        return torch.cat(parts, dim=1)


def assert_blocks_equal(
    actual: torch.Tensor, expected: torch.Tensor, labels: list[str], what: str
) -> None:
    """Fail naming the first block (by ``labels``) whose bytes differ, and where."""
    assert actual.shape == expected.shape, f"{what}: shapes {actual.shape} vs {expected.shape}"
    differ = (actual != expected).any(dim=1)
    if not bool(differ.any()):
        return
    row = int(differ.nonzero()[0])
    bad = (actual[row] != expected[row]).nonzero().flatten()
    first = int(bad[0])
    raise AssertionError(
        f"{what}: {int(differ.sum())} of {len(labels)} blocks differ; first is {labels[row]}: "
        f"{len(bad)} of {actual.shape[1]} bytes wrong, byte {first} is "
        f"0x{int(actual[row, first]):02x}, expected 0x{int(expected[row, first]):02x}"
    )


def seed_from(text: str) -> int:
    """A stable 63-bit seed from a test id: reruns see the same bytes."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
