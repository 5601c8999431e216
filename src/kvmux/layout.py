"""KVLayout: the shape of the KV memory a connector reads and writes.

Built from the per-layer tensors an engine hands over. Two instances exchange
blocks only when their fingerprints match, so a layout mismatch is refused at
handshake instead of decoding garbage. The number of blocks is not part of the
fingerprint: a producer and a consumer usually have pools of different sizes.
Nor is the model the engine declares (``model``): it is compared by field at
the handshake (:mod:`kvmux.compat`), so a refusal can say what differs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from functools import cached_property

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmux.compat import ModelInfo
from kvmux.errors import LayoutError


class LayerSpec(BaseModel):
    """One layer's KV tensor: full shape, dtype name and which dimension indexes blocks.

    ``dims`` optionally says what the block's dimensions mean. Moving bytes never
    needs it; converting them into another system's own format does (LMCache
    stores ``[K/V, layer, token, head x dim]``), and only the engine knows.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    shape: tuple[int, ...] = Field(min_length=2)
    dtype: str
    block_dim: int = Field(0, ge=0)
    dims: str | None = Field(
        None,
        pattern=r"^[KTHD]+$",
        description="what each dimension of one block holds, one letter each: K (key or "
        "value), T (token), H (head), D (within a head); e.g. 'KTHD'. None: not declared",
    )

    @model_validator(mode="after")
    def _block_dim_in_range(self) -> LayerSpec:
        if self.block_dim >= len(self.shape) - 1:
            raise ValueError(
                f"block_dim {self.block_dim} must index a dimension before the last "
                f"of shape {self.shape}"
            )
        if self.dims is not None and len(self.dims) != len(self.shape) - 1:
            raise ValueError(
                f"dims {self.dims!r} names {len(self.dims)} dimensions, "
                f"a block of shape {self.block_shape} has {len(self.shape) - 1}"
            )
        if self.dims is not None and (
            "T" not in self.dims or len(set(self.dims)) != len(self.dims)
        ):
            raise ValueError(
                f"dims {self.dims!r}: each letter at most once, and T (tokens) present"
            )
        return self

    @property
    def num_blocks(self) -> int:
        return self.shape[self.block_dim]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of this layer (the tensor with ``block_dim`` removed)."""
        return self.shape[: self.block_dim] + self.shape[self.block_dim + 1 :]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize


class KVLayout(BaseModel):
    """All layers of an engine's KV cache, as one connector sees it.

    A *block* is the same block index in every layer; its serialized form (on
    disk, on the wire, in a pool slot) is the layers' block slices laid end to
    end in layer order, ``block_nbytes`` bytes in all.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[LayerSpec, ...] = Field(min_length=1)
    block_size: int = Field(ge=1, description="tokens per block")
    device: str = "cpu"
    model: ModelInfo | None = Field(
        None,
        description="the model whose KV this is, as the engine names it (checked against a "
        "peer's at the handshake; not part of the fingerprint). None: not declared",
    )

    @model_validator(mode="after")
    def _same_block_count(self) -> KVLayout:
        counts = {layer.num_blocks for layer in self.layers}
        if len(counts) != 1:
            raise ValueError(f"layers disagree on the number of blocks: {sorted(counts)}")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        return self

    @classmethod
    def from_caches(
        cls,
        caches: Mapping[str, torch.Tensor],
        block_size: int,
        block_dim: int = 0,
        dims: str | None = None,
        model: ModelInfo | None = None,
    ) -> KVLayout:
        if not caches:
            raise LayoutError("no KV tensors given")
        devices = {t.device.type for t in caches.values()}
        if len(devices) != 1:
            raise LayoutError(f"KV tensors live on several devices: {sorted(devices)}")
        layers = tuple(
            LayerSpec(
                name=name,
                shape=tuple(t.shape),
                dtype=dtype_name(t.dtype),
                block_dim=block_dim,
                dims=dims,
            )
            for name, t in caches.items()
        )
        return cls(layers=layers, block_size=block_size, device=devices.pop(), model=model)

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks

    @property
    def block_nbytes(self) -> int:
        return sum(layer.block_nbytes for layer in self.layers)

    @cached_property
    def _fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        h.update(str(self.block_size).encode())
        for layer in self.layers:
            h.update(f"|{layer.name}|{layer.block_shape}|{layer.dtype}".encode())
            if layer.dims is not None:  # undeclared dims keep the fingerprints they had
                h.update(f"|{layer.dims}".encode())
        return h.hexdigest()

    def fingerprint(self) -> str:
        """Stable hash of everything two peers must agree on (not the block count)."""
        return self._fingerprint

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutError naming the first difference if blocks can't be exchanged."""
        if self.fingerprint() == other.fingerprint():
            return
        if self.block_size != other.block_size:
            raise LayoutError(f"block_size differs: {self.block_size} vs {other.block_size}")
        if len(self.layers) != len(other.layers):
            raise LayoutError(f"layer count differs: {len(self.layers)} vs {len(other.layers)}")
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            for field in ("name", "block_shape", "dtype", "dims"):
                a, b = getattr(mine, field), getattr(theirs, field)
                if a != b:
                    raise LayoutError(f"layer {mine.name!r}: {field} differs: {a} vs {b}")
        raise LayoutError("layouts differ")  # pragma: no cover - fingerprint covers the fields

    def check_caches(self, caches: Mapping[str, torch.Tensor]) -> None:
        """Raise LayoutError if ``caches`` is not exactly the memory this layout describes."""
        if list(caches) != [layer.name for layer in self.layers]:
            raise LayoutError(
                f"KV tensors {list(caches)} do not match layout layers "
                f"{[layer.name for layer in self.layers]}"
            )
        for layer in self.layers:
            t = caches[layer.name]
            if tuple(t.shape) != layer.shape or dtype_name(t.dtype) != layer.dtype:
                raise LayoutError(
                    f"layer {layer.name!r}: tensor is {tuple(t.shape)} {dtype_name(t.dtype)}, "
                    f"layout says {layer.shape} {layer.dtype}"
                )
            if t.stride(-1) != 1:
                raise LayoutError(f"layer {layer.name!r}: last dimension must be contiguous")
            if t.device.type != self.device:
                raise LayoutError(
                    f"layer {layer.name!r}: tensor on {t.device.type}, layout says {self.device}"
                )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"unknown torch dtype {name!r}")
    return dtype
