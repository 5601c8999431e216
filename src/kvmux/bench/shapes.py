"""KV-like shapes the benchmarks move: big blocks, many small blocks, and one block
(where what counts is the time a transfer adds, not its bandwidth)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
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

    def scattered_pieces(
        self, src_ptr: int, dst_ptr: int
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], int]:
        """(source addresses, destination addresses, bytes each) of one piece per
        block per layer: the source packed, the destination blocks scattered over a
        buffer twice the shape's size. What the raw-library baselines READ, so that
        they issue as many pieces as kvmux does."""
        piece = self.block_nbytes // self.layers
        blocks = np.random.default_rng(0).permutation(2 * self.blocks)[: self.blocks]
        n = self.blocks * self.layers
        src = src_ptr + np.arange(n, dtype=np.uint64) * np.uint64(piece)
        dst_piece = np.repeat(blocks.astype(np.uint64), self.layers) * np.uint64(self.layers)
        dst_piece += np.tile(np.arange(self.layers, dtype=np.uint64), self.blocks)
        return src, dst_ptr + dst_piece * np.uint64(piece), piece


SHAPES = {
    s.name: s
    for s in (
        # 8 layers x 32 KiB: a 16-token block of an 8-KV-head, 64-dim bf16 model
        Shape("256x256KiB", blocks=256, layers=8, tokens=16, heads=8),
        Shape("4096x16KiB", blocks=4096, layers=2, tokens=16, heads=2),
        Shape("1x256KiB", blocks=1, layers=8, tokens=16, heads=8),
    )
}
