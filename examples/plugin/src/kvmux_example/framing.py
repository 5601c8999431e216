"""The wire format of the ``uds`` pipe: a fixed header, the shape, the raw bytes.

Nothing from the peer is unpickled or evaluated. A receiver validates every
header field (magic, version, dtype code, rank, byte count against the shape
and a size limit) before it allocates or reads a payload, so a confused or
hostile peer gets a ``ProtocolError``, not a giant allocation or garbage.

Frame: ``MAGIC(4) version(1) kind(1) dtype(1) ndim(1) nbytes(8)`` then
``ndim`` little-endian uint64 sizes, then ``nbytes`` bytes of data. Kind 0 is
a ``None`` message (no shape, no data), kind 1 a tensor.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from kvmux.errors import ProtocolError

MAGIC = b"KVUD"
VERSION = 1
HEADER = struct.Struct("<4sBBBBQ")
DIM = struct.Struct("<Q")
MAX_DIMS = 8
KIND_NONE, KIND_TENSOR = 0, 1

DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
)
"""Wire codes are indexes into this tuple; append only, never reorder."""


@dataclass(frozen=True)
class Header:
    kind: int
    dtype: torch.dtype
    ndim: int
    nbytes: int


def encode(tensor: torch.Tensor | None) -> tuple[bytes, torch.Tensor | None]:
    """The header-and-shape bytes of a frame and its payload (a flat uint8 CPU tensor)."""
    if tensor is None:
        return HEADER.pack(MAGIC, VERSION, KIND_NONE, 0, 0, 0), None
    if tensor.dtype not in DTYPES:
        raise ProtocolError(f"the uds pipe cannot send {tensor.dtype}")
    if tensor.dim() > MAX_DIMS:
        raise ProtocolError(f"the uds pipe sends at most {MAX_DIMS} dimensions")
    payload = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    head = HEADER.pack(
        MAGIC, VERSION, KIND_TENSOR, DTYPES.index(tensor.dtype), tensor.dim(), payload.numel()
    )
    return head + b"".join(DIM.pack(d) for d in tensor.shape), payload


def parse_header(data: bytes, max_bytes: int) -> Header:
    magic, version, kind, code, ndim, nbytes = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a kvmux uds frame (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"uds frame version {version}, expected {VERSION}")
    if kind == KIND_NONE:
        if code or ndim or nbytes:
            raise ProtocolError("a None frame carries no dtype, shape or data")
        return Header(kind, torch.uint8, 0, 0)
    if kind != KIND_TENSOR:
        raise ProtocolError(f"unknown uds frame kind {kind}")
    if code >= len(DTYPES):
        raise ProtocolError(f"unknown dtype code {code}")
    if ndim > MAX_DIMS:
        raise ProtocolError(f"{ndim} dimensions, at most {MAX_DIMS} allowed")
    if nbytes > max_bytes:
        raise ProtocolError(f"frame of {nbytes} bytes exceeds max_frame_bytes={max_bytes}")
    return Header(kind, DTYPES[code], ndim, nbytes)


def parse_shape(header: Header, data: bytes) -> tuple[int, ...]:
    shape = tuple(DIM.unpack_from(data, i * DIM.size)[0] for i in range(header.ndim))
    itemsize = torch.empty((), dtype=header.dtype).element_size()
    if math.prod(shape) * itemsize != header.nbytes:
        raise ProtocolError(f"shape {shape} of {header.dtype} does not hold {header.nbytes} bytes")
    return shape


def decode(header: Header, shape: tuple[int, ...], data: bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=header.dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(header.dtype).reshape(shape)
