"""Where a block's bytes live in registered KV memory, as socket-ready payloads.

A block travels in its serialized form (:mod:`kvmux.blocks`: every layer's
slice of the block, in layer order, each in C order). In contiguous host
tensors that form is a short list of contiguous byte ranges of KV memory, the
block's pieces (:mod:`kvmux.addressing`): one per layer, or a few per layer
when the block dimension is not the first (vLLM's ``(2, num_blocks, ...)``
keeps K and V apart). A receiver that scatters a block straight into those
ranges, in that order, needs no staging buffer and no copy afterwards,
whatever the number of layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvmux.addressing import BlockAddressing
from kvmux.layout import KVLayout
from kvmux.net import iovec
from kvmux.net.iovec import IoVecs
from kvmux.net.memory import byte_view


class KVViews:
    """The byte ranges of blocks in KV memory."""

    def __init__(self, addressing: BlockAddressing, memory: list[memoryview]) -> None:
        self._addressing = addressing
        self._memory = memory
        """Each layer's whole tensor as bytes: keeps the memory of every payload alive."""
        self._pieces = [(memory[p.layer], p.offset, p.step, p.nbytes) for p in addressing.pieces]
        """Per piece: (bytes of its layer's whole tensor, offset for block 0, step, length)."""

    @classmethod
    def of(cls, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> KVViews | None:
        """Ranges in ``caches``; None unless every layer is contiguous host memory
        (then stage blocks and use ``BlockCopier.copy_in``)."""
        addressing = BlockAddressing.of(layout, caches) if layout.device == "cpu" else None
        if addressing is None:
            return None
        return cls(addressing, [byte_view(caches[spec.name]) for spec in layout.layers])

    def payload(self, blocks: Sequence[int]) -> IoVecs | list[memoryview]:
        """The blocks' ranges, in serialized order, one block after the other: for a
        few blocks a view per piece, for more one table of them all, computed with
        numpy (a view per piece of a 4096-block batch cost milliseconds; see
        :func:`kvmux.net.iovec.worth_a_table`)."""
        if iovec.worth_a_table(len(blocks)):
            return IoVecs(self._addressing.ranges(blocks), self._memory)
        return [
            memory[offset + block * step : offset + block * step + length]
            for block in blocks
            for memory, offset, step, length in self._pieces
        ]
