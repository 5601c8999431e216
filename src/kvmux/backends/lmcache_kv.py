"""kvmux blocks <-> LMCache memory objects: the KV layout conversion.

LMCache keeps one chunk of KV as a ``KV_2LTD`` tensor ``[kv, layers, tokens,
hidden]``: ``kv`` is 2 (keys, then values; 1 where a layer has no K/V
dimension), ``hidden`` is heads x head size. An engine's blocks are laid out
its own way (vLLM's CPU backend: ``[heads, K/V, tokens, head size]`` per block;
its GPU backends: ``[K/V, tokens, heads, head size]``), so each side of the
copy needs a permutation, which :class:`ChunkView` works out once per layer.

Copying is LMCache's "GPU connector" job; its CUDA kernels do not run on a CPU
and its stock CPU stand-in stores nothing, hence :class:`BlockCopyConnector`.
One LMCache chunk is exactly one kvmux block (``chunk_size == block_size``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj

from kvmux.errors import LayoutError
from kvmux.layout import KVLayout, LayerSpec

Objs = Sequence[MemoryObj]
Ints = Sequence[int]


@dataclass(frozen=True)
class ChunkView:
    """How one layer's block reads as LMCache's ``[kv, tokens, hidden]``.

    ``order`` permutes the block's dimensions into K/V (if any), tokens, then
    the hidden dimensions: heads before head size where ``dims`` names them,
    else the remaining dimensions in their own order.
    """

    order: tuple[int, ...]
    kv: int
    hidden_shape: tuple[int, ...]
    has_kv_dim: bool

    @classmethod
    def of(cls, spec: LayerSpec, block_size: int) -> ChunkView:
        shape = spec.block_shape
        kv_dim, token_dim = _roles(spec, block_size)
        if shape[token_dim] != block_size:
            raise LayoutError(
                f"layer {spec.name!r}: its token dimension has {shape[token_dim]} entries, "
                f"the block size is {block_size}"
            )
        kv = 1 if kv_dim is None else shape[kv_dim]
        if kv not in (1, 2):
            raise LayoutError(f"layer {spec.name!r}: a K/V dimension of size {kv}")
        lead = [token_dim] if kv_dim is None else [kv_dim, token_dim]
        if spec.dims is not None and "H" in spec.dims and "D" in spec.dims:
            hidden = [spec.dims.index("H"), spec.dims.index("D")]
        else:
            hidden = [i for i in range(len(shape)) if i not in lead]
        return cls(tuple(lead + hidden), kv, tuple(shape[i] for i in hidden), kv_dim is not None)

    @property
    def hidden(self) -> int:
        return math.prod(self.hidden_shape)

    def engine_side(self, block: torch.Tensor) -> torch.Tensor:
        """One engine block as ``[kv, tokens, *hidden_shape]``: a strided view, no copy."""
        view = block.permute(self.order)
        return view if self.has_kv_dim else view.unsqueeze(0)

    def lmcache_side(self, chunk: torch.Tensor) -> torch.Tensor:
        """One layer of a ``KV_2LTD`` chunk, ``[kv, tokens, hidden]``, shaped like
        :meth:`engine_side` (splitting ``hidden`` is a view: it is contiguous)."""
        return chunk.view(self.kv, chunk.shape[1], *self.hidden_shape)


def _roles(spec: LayerSpec, block_size: int) -> tuple[int | None, int]:
    """The block dimensions holding K/V (None: no such dimension) and tokens.

    Declared ``dims`` decide. Without them: a leading 2 is K/V, and the first
    dimension after it with ``block_size`` entries is tokens. That is enough for
    a byte-exact round trip through LMCache; an engine adapter declares ``dims``
    so that the chunks also mean what LMCache's other users expect.
    """
    if spec.dims is not None:
        kv = spec.dims.find("K")
        return (None if kv < 0 else kv), spec.dims.index("T")
    shape = spec.block_shape
    kv_dim = 0 if len(shape) > 2 and shape[0] == 2 and block_size != 2 else None
    for i in range(0 if kv_dim is None else 1, len(shape)):
        if shape[i] == block_size:
            return kv_dim, i
    raise LayoutError(
        f"layer {spec.name!r}: no dimension of its blocks {shape} holds {block_size} tokens; "
        "declare the layout's dims"
    )


class BlockCopyConnector(GPUConnectorInterface):  # type: ignore[misc]
    """LMCache's copy step for KV in host memory: chunk ``i`` of a call is block
    ``slot_mapping[start] // block_size``, as vLLM's slot mapping says."""

    def __init__(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        self.block_size = layout.block_size
        self._layers = [
            (caches[spec.name].movedim(spec.block_dim, 0), ChunkView.of(spec, layout.block_size))
            for spec in layout.layers
        ]

    @property
    def chunk_view(self) -> ChunkView:
        return self._layers[0][1]

    def _block(self, start: int, end: int, slot_mapping: torch.Tensor) -> int:
        first = int(slot_mapping[start])
        if end - start != self.block_size or first % self.block_size:
            raise ValueError(f"chunk [{start}, {end}) is not one whole block (slot {first})")
        return first // self.block_size

    def _pairs(self, obj: MemoryObj, block: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(engine side, LMCache side) views per layer, shaped alike."""
        data = obj.tensor
        assert data is not None, "LMCache handed over a memory object without a tensor"
        return [
            (view.engine_side(blocks[block]), view.lmcache_side(data[:, layer]))
            for layer, (blocks, view) in enumerate(self._layers)
        ]

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        block = self._block(start, end, kwargs["slot_mapping"])
        for ours, theirs in self._pairs(memory_obj, block):
            theirs.copy_(ours)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        block = self._block(start, end, kwargs["slot_mapping"])
        for ours, theirs in self._pairs(memory_obj, block):
            ours.copy_(theirs)

    def batched_from_gpu(self, objs: Objs, starts: Ints, ends: Ints, **kw: Any) -> None:
        for chunk in zip(objs, starts, ends, strict=True):
            self.from_gpu(*chunk, **kw)

    def batched_to_gpu(self, objs: Objs, starts: Ints, ends: Ints, **kw: Any) -> None:
        for chunk in zip(objs, starts, ends, strict=True):
            self.to_gpu(*chunk, **kw)

    def get_shape(self, num_tokens: int) -> torch.Size:
        view = self.chunk_view
        return torch.Size([view.kv, len(self._layers), num_tokens, view.hidden])


def lmcache_kv_shape(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """LMCache's ``(layers, kv, chunk tokens, heads, head size)`` for ``layout``.

    LMCache keeps one format for all layers, so every layer must read the same.
    Only ``heads x head size`` reaches LMCache's chunks; undeclared hidden
    dimensions count as one head.
    """
    shapes = {
        (v.kv, v.hidden_shape)
        for v in (ChunkView.of(spec, layout.block_size) for spec in layout.layers)
    }
    dtypes = {spec.dtype for spec in layout.layers}
    if len(dtypes) != 1 or len(shapes) != 1:
        raise LayoutError(
            "lmcache needs every layer to have the same block shape and dtype; "
            f"got dtypes {sorted(dtypes)} and {len(shapes)} different shapes"
        )
    kv, hidden_shape = shapes.pop()
    heads, head_size = hidden_shape if len(hidden_shape) == 2 else (1, math.prod(hidden_shape))
    return (len(layout.layers), kv, layout.block_size, heads, head_size)
