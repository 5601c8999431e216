"""Where a block's bytes live in registered KV memory, as socket-ready byte views.

A block travels in its serialized form (:mod:`kvmux.blocks`: every layer's
slice of the block, in layer order, each in C order). In contiguous host
tensors that form is a short list of contiguous byte ranges of KV memory:
one per layer, or a few per layer when the block dimension is not the first
(vLLM's ``(2, num_blocks, ...)`` keeps K and V apart). A receiver that
scatters a block straight into those ranges, in that order, needs no staging
buffer and no copy afterwards, whatever the number of layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from kvmux.layout import KVLayout
from kvmux.net.memory import byte_view


class KVViews:
    """Byte views of each block's pieces in KV memory."""

    def __init__(self, layout: KVLayout, layers: list[tuple[memoryview, int, int]]) -> None:
        self._blocks = layout.num_blocks
        self._layers = layers
        """Per layer: (bytes of the whole tensor, ranges per block, range length). In a
        contiguous tensor, range j of block b starts at (j * num_blocks + b) * length."""

    @classmethod
    def of(cls, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> KVViews | None:
        """Views over ``caches``; None unless every layer is contiguous host memory
        (then stage blocks and use ``BlockCopier.copy_in``)."""
        layers = []
        for spec in layout.layers:
            tensor = caches[spec.name]
            if tensor.device.type != "cpu" or not tensor.is_contiguous():
                return None
            outer = math.prod(spec.shape[: spec.block_dim])
            layers.append((byte_view(tensor), outer, spec.block_nbytes // outer))
        return cls(layout, layers)

    def views(self, blocks: Sequence[int]) -> list[memoryview]:
        """The blocks' ranges, in serialized order, one block after the other."""
        n = self._blocks
        return [
            memory[(j * n + block) * seg : (j * n + block + 1) * seg]
            for block in blocks
            for memory, outer, seg in self._layers
            for j in range(outer)
        ]
