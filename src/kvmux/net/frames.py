"""Framing: validated headers and raw payloads over one socket, every wait bounded.

A frame is ``MAGIC | header length (u32, big endian) | JSON header | payload``;
the header is a message of the channel's
:class:`~kvmux.net.messages.WireProtocol` and says how many payload bytes
follow. Headers are read through a small read-ahead buffer, and only as their
bytes arrive: a peer that announces a large header and stalls holds no more
memory than it has sent (an up-front buffer of the announced size let 200
stalled connections cost a server 200 MB). Payloads go straight between the
socket and their final memory with scatter/gather ``recvmsg_into``/``sendmsg``,
so a block crosses the socket without a copy of ours: given as memoryviews, or,
for thousands of pieces, as one table of addresses (:mod:`kvmux.net.iovec`).
Anything that is not a well-formed frame within the limits is a
:class:`~kvmux.errors.ProtocolError` and the channel is unusable afterwards.

A large payload starts at a page-aligned offset of the byte stream: the
sender pads the JSON header with spaces to get there. Both kernel copies
(into and out of the socket buffers) then keep the payload's alignment, and
on x86 loopback that alone moves a large frame about twice as fast.

Deadlines are ``time.monotonic()`` values; each socket call gets the time
left as its timeout, so a whole exchange (not each call) is bounded. The
socket stays in blocking mode with the kernel enforcing that timeout
(``SO_RCVTIMEO``/``SO_SNDTIMEO``) rather than Python's poll-then-read, so a
payload of any size is read with one ``MSG_WAITALL`` call per 1024 buffers
and sent with one ``sendmsg``, instead of a poll and a call per segment.
"""

from __future__ import annotations

import contextlib
import ctypes
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
from pydantic import ValidationError

from kvmux.errors import ProtocolError, TransferError, TransferTimeout
from kvmux.net import iovec
from kvmux.net.iovec import IoVecs
from kvmux.net.messages import Message, WireProtocol

MAGIC = b"KVMX"
PREFIX = struct.Struct("!4sI")
READ_AHEAD = 16 * 1024
"""Read-ahead of a channel whose peer is known (after the handshake)."""
_PAGE = 4096
ALIGN_MIN_PAYLOAD = 64 * 1024
"""Payloads at least this big start page-aligned in the stream (see above)."""
_TIMEVAL = struct.Struct("@ll")


@dataclass(frozen=True)
class Limits:
    """What one side accepts: a longer header or frame is rejected unread."""

    max_header_bytes: int
    max_frame_bytes: int


class Channel:
    """One framed connection. Not thread-safe: one sender and one receiver at a time."""

    def __init__(
        self,
        sock: socket.socket,
        protocol: WireProtocol,
        limits: Limits,
        *,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Headers are small writes; Nagle would hold them back for an ACK.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking: the kernel enforces each call's timeout
        self.sock = sock
        self.limits = limits
        self._protocol = protocol
        self._timeouts = {socket.SO_RCVTIMEO: -1.0, socket.SO_SNDTIMEO: -1.0}
        self._view = memoryview(bytearray(read_ahead))
        self._start = 0
        self._end = 0
        self.bytes_sent = 0
        """Bytes written to the socket so far: the stream offset of the next frame."""
        self.bytes_received = 0
        """Bytes read from the socket so far."""
        self.bytes_delivered = 0
        """Bytes ``recv_into`` has placed into callers' views so far; after a failure,
        the difference from before the call says how much of it arrived."""
        self.broken = False
        """Set by any failure that leaves the stream out of step; close it then."""
        self.peer = _describe(sock)
        """The other end, for messages."""

    def set_read_ahead(self, nbytes: int) -> None:
        """Resize the read-ahead buffer, keeping what it holds unread. A server starts
        a connection with a tiny one and grows it once the peer has joined."""
        pending = self._view[self._start : self._end]
        view = memoryview(bytearray(max(nbytes, len(pending))))
        view[: len(pending)] = pending
        self._view, self._start, self._end = view, 0, len(pending)

    # ---------------------------------------------------------------- sending

    def send(
        self, msg: Message, payload: Sequence[memoryview] | IoVecs = (), *, deadline: float
    ) -> None:
        """Send one frame: ``msg`` then the ``payload`` buffers (or ranges) back to back."""
        header = self._protocol.dump_json(msg)
        if msg.payload_nbytes() >= ALIGN_MIN_PAYLOAD:
            start = self.bytes_sent + PREFIX.size + len(header)
            header += b" " * (-start % _PAGE)  # JSON allows trailing whitespace
        if len(header) > self.limits.max_header_bytes:
            raise ProtocolError(
                f"{msg.__class__.__name__} header of {len(header)} bytes exceeds "
                f"max_header_bytes={self.limits.max_header_bytes}"
            )
        if isinstance(payload, IoVecs):
            nbytes = payload.nbytes
        else:
            nbytes = sum(view.nbytes for view in payload)
        if nbytes != msg.payload_nbytes():
            raise ValueError(f"payload of {nbytes} bytes, header says {msg.payload_nbytes()}")
        prefix = PREFIX.pack(MAGIC, len(header)) + header
        if isinstance(payload, IoVecs):
            self._send_table(prefix, payload, deadline)
        else:
            self._sendv([prefix, *payload], deadline)

    def _send_table(self, prefix: bytes, payload: IoVecs, deadline: float) -> None:
        head = np.frombuffer(prefix, dtype=np.uint8)  # alive until the last send
        table: iovec.Table = np.empty((len(payload.table) + 1, 2), dtype=np.uint64)
        table[0] = (head.ctypes.data, len(prefix))
        table[1:] = payload.table
        table = table[table[:, 1] > 0]
        while len(table):
            sent = self._io(partial(iovec.send, self.sock, table), socket.SO_SNDTIMEO, deadline)
            self.bytes_sent += sent
            table = iovec.advance(table, sent)

    def _sendv(self, buffers: list[bytes | memoryview], deadline: float) -> None:
        pending = [memoryview(b).cast("B") for b in buffers if len(b)]
        i = 0
        while i < len(pending):
            batch = pending[i : i + iovec.IOV_MAX]
            sent = self._io(partial(self.sock.sendmsg, batch), socket.SO_SNDTIMEO, deadline)
            self.bytes_sent += sent
            while sent:
                if sent >= len(pending[i]):
                    sent -= len(pending[i])
                    i += 1
                else:
                    pending[i] = pending[i][sent:]
                    sent = 0

    # -------------------------------------------------------------- receiving

    def recv(
        self,
        deadline: float | None,
        *,
        frame_timeout: float | None = None,
        max_header_bytes: int | None = None,
    ) -> Message:
        """The next frame's header (its payload must then be read with ``recv_into``).

        Waits for the frame to start until ``deadline`` (None: forever); a
        TransferTimeout then leaves the stream intact. Once it started, the
        rest must come by ``deadline`` or, if given, within ``frame_timeout``.
        ``max_header_bytes`` lowers the header limit for this frame (the
        handshake's, before the peer is known).
        """
        if self._start == self._end:
            self._fill(deadline, idle=True)
        if frame_timeout is not None:
            deadline = time.monotonic() + frame_timeout
        magic, header_len = PREFIX.unpack(self._read_exact(PREFIX.size, deadline))
        if magic != MAGIC:
            self.broken = True
            raise ProtocolError(f"garbage from {self.peer}: not a kvmux frame")
        limit = self.limits.max_header_bytes
        if max_header_bytes is not None:
            limit = min(limit, max_header_bytes)
        if header_len > limit:
            self.broken = True
            raise ProtocolError(
                f"{self.peer} sent a header of {header_len} bytes, over max_header_bytes={limit}"
            )
        raw = self._read_exact(header_len, deadline)
        try:
            msg: Message = self._protocol.validate_json(raw)
        except ValidationError as exc:
            self.broken = True
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ProtocolError(
                f"invalid message from {self.peer}: {where}: {first['msg']}"
            ) from None
        if header_len + msg.payload_nbytes() > self.limits.max_frame_bytes:
            self.broken = True
            raise ProtocolError(
                f"{self.peer} sent a frame of {header_len + msg.payload_nbytes()} bytes, over "
                f"max_frame_bytes={self.limits.max_frame_bytes}"
            )
        return msg

    def recv_into(self, views: Sequence[memoryview] | IoVecs, deadline: float | None) -> None:
        """Fill ``views`` (flat ``"B"`` memoryviews, or ranges) in order with the next
        payload bytes."""
        if isinstance(views, IoVecs):
            self._recv_table(views.table, deadline)
            return
        pending = [v for v in views if v.nbytes]
        i = 0
        while i < len(pending) and self._start < self._end:
            take = min(self._end - self._start, pending[i].nbytes)
            pending[i][:take] = self._view[self._start : self._start + take]
            self._start += take
            self.bytes_delivered += take
            pending[i] = pending[i][take:]
            if not pending[i].nbytes:
                i += 1
        while i < len(pending):
            batch = pending[i : i + iovec.IOV_MAX]
            got = self._io(partial(_recv_all, self.sock, batch), socket.SO_RCVTIMEO, deadline)
            self.bytes_received += got
            self.bytes_delivered += got
            while got:
                if got >= pending[i].nbytes:
                    got -= pending[i].nbytes
                    i += 1
                else:
                    pending[i] = pending[i][got:]
                    got = 0

    def _recv_table(self, table: iovec.Table, deadline: float | None) -> None:
        table = table[table[:, 1] > 0]
        buffered = self._end - self._start
        if buffered and len(table):
            ahead = np.frombuffer(self._view, dtype=np.uint8)[self._start : self._end]
            ends = np.cumsum(table[:, 1])
            take = min(buffered, int(ends[-1]))
            at = 0
            for address, length in table[: int(np.searchsorted(ends, take)) + 1].tolist():
                n = min(length, take - at)
                ctypes.memmove(address, ahead.ctypes.data + at, n)
                at += n
            self._start += take
            self.bytes_delivered += take
            table = iovec.advance(table, take)
        while len(table):
            got = self._io(partial(iovec.recv, self.sock, table), socket.SO_RCVTIMEO, deadline)
            self.bytes_received += got
            self.bytes_delivered += got
            table = iovec.advance(table, got)

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        """The next ``n`` bytes of the stream, gathered through the read-ahead buffer as
        they arrive: the memory held grows with what the peer sent, not with ``n``."""
        if self._end - self._start >= n:
            out = bytes(self._view[self._start : self._start + n])
            self._start += n
            return out
        gathered = bytearray()
        while True:
            take = min(self._end - self._start, n - len(gathered))
            gathered += self._view[self._start : self._start + take]
            self._start += take
            if len(gathered) == n:
                return bytes(gathered)
            self._fill(deadline, idle=False)

    def _fill(self, deadline: float | None, *, idle: bool) -> None:
        """Read ahead into the (empty) buffer; a failure leaves it empty."""
        read = partial(self.sock.recv_into, self._view)
        got = self._io(read, socket.SO_RCVTIMEO, deadline, idle=idle)
        self.bytes_received += got
        self._start, self._end = 0, got

    def _io(
        self, call: Callable[[], int], option: int, deadline: float | None, *, idle: bool = False
    ) -> int:
        """One socket call under the time left. An ``idle`` receive timeout (nothing
        of a frame read yet) keeps the stream usable; any other failure breaks it."""
        sending = option == socket.SO_SNDTIMEO
        try:
            self._timeout(option, deadline)
            done = call()
        except (TimeoutError, BlockingIOError):  # the deadline passed, or the kernel's timeout
            self.broken = self.broken or sending or not idle
            what = f"sending to {self.peer}" if sending else f"waiting for {self.peer}"
            raise TransferTimeout(f"{what} timed out") from None
        except OSError as exc:
            self.broken = True
            what = "sending to" if sending else "receiving from"
            raise TransferError(f"{what} {self.peer} failed: {exc}") from None
        if done == 0 and not sending:
            self.broken = True
            raise TransferError(f"{self.peer} closed the connection")
        return done

    def _timeout(self, option: int, deadline: float | None) -> None:
        """Set the kernel's timeout for the next call to the time left (a timeval of
        0 means none: a server waiting for its next request).

        Never shorter than the time left, and at most :func:`_late_s` longer: so a
        timeout that is still within that band is kept, and one call in tens of a
        busy connection sets it (to the middle of the band, so the next requests'
        fresh deadlines still fall in it). A ``setsockopt`` costs about as
        much as a small ``send``: setting both timeouts at every request added two
        system calls per side to a one-block load."""
        left = 0.0 if deadline is None else _left(deadline)
        kept = self._timeouts[option]
        if left == kept or (left and left <= kept <= left + _late_s(left)):
            return
        kept = left + _late_s(left) / 2 if left else 0.0
        sec, usec = divmod(max(1, int(kept * 1e6)) if kept else 0, 1_000_000)
        self.sock.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(sec, usec))
        self._timeouts[option] = kept

    # ------------------------------------------------------------------ closing

    def shutdown(self) -> None:
        """Wake any thread blocked on this channel (it then sees the peer gone)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.broken = True
        self.shutdown()
        self.sock.close()


def _describe(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "an unconnected peer"
    if isinstance(name, tuple):
        return f"{name[0]}:{name[1]}"
    return str(name) or "a local peer"


def _recv_all(sock: socket.socket, buffers: list[memoryview]) -> int:
    """Fill ``buffers`` in one call; short only at a timeout, EOF or signal."""
    nbytes: int = sock.recvmsg_into(buffers, 0, socket.MSG_WAITALL)[0]
    return nbytes


def _late_s(left: float) -> float:
    """How far past its deadline a socket call may end: 1% of the time it had, at
    most 20 ms (a 10 s transfer timeout ends within 10.02 s)."""
    return min(left / 100, 0.02)


def _left(deadline: float) -> float:
    """Seconds until ``deadline``; a TimeoutError (socket-style) if it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left
