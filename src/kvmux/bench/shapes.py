"""KV-like shapes the benchmarks move: big blocks, many small blocks, and one block
(where what counts is the time a transfer adds, not its bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmux.layout import KVLayout


@dataclass(frozen=True)
class Shape:
    """``blocks`` blocks, each ``layers`` x ``[2, tokens, heads, head_dim]`` bf16."""

    name: str
    blocks: int
    layers: int
    tokens: int
    heads: int
    head_dim: int = 64

    @property
    def block_nbytes(self) -> int:
        return self.layers * 2 * self.tokens * self.heads * self.head_dim * 2

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_nbytes

    def caches(self, num_blocks: int, seed: int = 0) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        shape = (num_blocks, 2, self.tokens, self.heads, self.head_dim)
        return {
            f"layer.{i}": torch.randint(-1000, 1000, shape, generator=gen).to(torch.bfloat16)
            for i in range(self.layers)
        }

    def layout(self, caches: dict[str, torch.Tensor]) -> KVLayout:
        return KVLayout.from_caches(caches, block_size=self.tokens)


SHAPES = {
    s.name: s
    for s in (
        # 8 layers x 32 KiB: a 16-token block of an 8-KV-head, 64-dim bf16 model
        Shape("256x256KiB", blocks=256, layers=8, tokens=16, heads=8),
        Shape("4096x16KiB", blocks=4096, layers=2, tokens=16, heads=2),
        Shape("1x256KiB", blocks=1, layers=8, tokens=16, heads=8),
    )
}
