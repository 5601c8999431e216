"""Byte views of tensors, so sockets read and write tensor memory in place.

``torch.Tensor`` does not export the buffer protocol; going through numpy
would add a dependency, and copying into ``bytes`` would cost a memcpy per
block. A ctypes array laid over the tensor's memory gives a ``memoryview``
that ``sendmsg``/``recvmsg_into`` accept, at about a microsecond per view.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable, flat ``memoryview`` of a contiguous CPU tensor's bytes.

    The view keeps ``tensor`` alive, so the memory cannot be freed under a
    socket that is still reading into it.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._kvmux_owner = tensor  # type: ignore[attr-defined]  # keeps the memory alive
    return memoryview(array).cast("B")
