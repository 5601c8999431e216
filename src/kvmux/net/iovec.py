"""Scatter/gather socket I/O over tables of addresses, for payloads of thousands of pieces.

``socket.sendmsg`` and ``recvmsg_into`` take one buffer object per piece. A
``tcp`` fetch of 4096 blocks of 16 KiB is 8192 pieces of KV memory (a piece
per layer per block), and making a ``memoryview`` for each cost 3-9 ms on
each side of every fetch, in Python, before the first byte moved: more than
a fifth of the fetch. Here a payload is an :class:`IoVecs`, an ``[n, 2]``
table of (address, length) rows that numpy computes for the whole batch at
once (:meth:`kvmux.addressing.BlockAddressing.ranges`), handed to libc's
``sendmsg``/``recvmsg`` as the ``iovec`` array it already is. ctypes releases
the GIL for the call, as the socket module does.

Used only on 64-bit Linux (:data:`SUPPORTED`), whose ``msghdr`` layout is the one
below; elsewhere callers keep their memoryviews. Errors come back as the socket
module raises them (``OSError`` subclasses by errno; ``BlockingIOError`` when the
kernel's ``SO_*TIMEO`` timeout expires), so :class:`~kvmux.net.frames.Channel`
treats both paths alike.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

SUPPORTED = sys.platform == "linux" and sys.maxsize > 2**32
"""Whether tables may be used here: 64-bit Linux, whose ``iovec`` and ``msghdr``
the table and ``_MsgHdr`` match (elsewhere payloads stay memoryviews)."""
IOV_MAX = 1024
"""Most rows one call takes (Linux's ``UIO_MAXIOV``)."""

MIN_BLOCKS = 16
"""Fewest blocks a payload goes as a table for: a table's dozen numpy calls cost a
one-block batch more than its few views (a one-block load from another process
took ~750 us with a table, ~460 with views)."""

Table = npt.NDArray[np.uint64]
"""``[n, 2]`` rows of (address, length): ``struct iovec``'s layout on 64-bit Linux."""


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


_libc = ctypes.CDLL(None, use_errno=True)  # the process's libc (on any platform)
_sendmsg = _libc.sendmsg
_sendmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int)
_sendmsg.restype = ctypes.c_ssize_t
_recvmsg = _libc.recvmsg
_recvmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MsgHdr), ctypes.c_int)
_recvmsg.restype = ctypes.c_ssize_t


def worth_a_table(blocks: int) -> bool:
    """Whether a payload of ``blocks`` blocks should go as a table rather than views."""
    return SUPPORTED and blocks >= MIN_BLOCKS


@dataclass(frozen=True)
class IoVecs:
    """A payload as (address, length) rows, sent or filled in row order.

    ``owner`` keeps the memory the addresses point into alive for as long as
    the table is (the tensors of a block's pieces)."""

    table: Table
    owner: object

    def __post_init__(self) -> None:
        """libc reads the table's memory as it lies: anything but C-ordered ``[n, 2]``
        uint64 rows would send or fill the wrong bytes."""
        table = self.table
        if table.dtype != np.uint64 or table.shape[1:] != (2,) or not table.flags.c_contiguous:
            raise ValueError(f"an iovec table is C-ordered [n, 2] uint64, not {table.dtype}")

    @property
    def nbytes(self) -> int:
        return int(self.table[:, 1].sum())


def send(sock: socket.socket, table: Table) -> int:
    """One ``sendmsg`` of the first :data:`IOV_MAX` rows of ``table`` (C-contiguous);
    the bytes sent."""
    return _call(_sendmsg, sock, table, socket.MSG_NOSIGNAL)


def recv(sock: socket.socket, table: Table) -> int:
    """One ``recvmsg`` with ``MSG_WAITALL`` into the first :data:`IOV_MAX` rows of
    ``table``: short only at a timeout, a signal or the end of the stream."""
    return _call(_recvmsg, sock, table, socket.MSG_WAITALL)


def advance(table: Table, nbytes: int) -> Table:
    """What is left of ``table`` once its first ``nbytes`` bytes moved (a new array
    where a row was cut: the caller's table is never changed)."""
    if nbytes == 0:
        return table
    ends = np.cumsum(table[:, 1])
    whole = int(np.searchsorted(ends, nbytes, side="right"))
    rest = table[whole:]
    done_in_row = nbytes - (int(ends[whole - 1]) if whole else 0)
    if done_in_row and len(rest):
        rest = rest.copy()
        rest[0, 0] += np.uint64(done_in_row)
        rest[0, 1] -= np.uint64(done_in_row)
    return rest


def _call(fn: Callable[..., int], sock: socket.socket, table: Table, flags: int) -> int:
    """``fn(fd, msghdr, flags)`` over the table's first rows, retried on EINTR."""
    rows = min(len(table), IOV_MAX)
    header = _MsgHdr(msg_iov=table.ctypes.data, msg_iovlen=rows)
    while True:
        done = int(fn(sock.fileno(), ctypes.byref(header), flags))
        if done >= 0:
            return done
        code = ctypes.get_errno()
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))
