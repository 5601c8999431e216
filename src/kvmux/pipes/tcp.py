"""``tcp`` pipe: a point-to-point channel of tensors over one TCP connection.

The endpoint listens from creation and takes exactly one peer: the first
that connects *and* opens with a valid ``pipe_hello`` (a port scanner or a
stray client is dropped, and a silent one does not hold up the real peer). Each tensor is one
frame: a validated header (dtype, shape, byte count, or ``no_tensor``) and
its raw bytes, sent from and received into tensor memory without a copy of
ours. Waiting for a frame to *start* honours the caller's timeout and leaves
the stream usable; once a frame has started, the rest must arrive within
``timeout_s`` or the pipe is broken (a half-read frame cannot be resumed).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import Field

from kvmux.config import BackendConfig
from kvmux.errors import (
    ClosedError,
    InvalidRequestError,
    KvmuxError,
    TransferError,
    TransferTimeout,
)
from kvmux.layout import dtype_name, torch_dtype
from kvmux.net.frames import Channel, Limits
from kvmux.net.memory import byte_view
from kvmux.net.messages import PIPE_PROTOCOL, NoTensor, PipeHello, TensorHeader, expect
from kvmux.pipe import Pipe

log = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 16 * 1024
"""A pipe header is a dtype and a shape, plus up to a page of alignment padding."""


class TcpPipeConfig(BackendConfig):
    backend: str = "pipes:tcp"
    host: str = Field("127.0.0.1", description="address the endpoint listens on")
    port: int = Field(0, ge=0, le=65535, description="listening port; 0 picks a free one")
    max_frame_bytes: int = Field(
        256 * 2**20, ge=2**16, description="largest tensor accepted from the peer, in bytes"
    )


class TcpPipe(Pipe):
    """Either end of a tensor pipe; see the module docstring."""

    config_model = TcpPipeConfig
    config: TcpPipeConfig

    def __init__(self, config: TcpPipeConfig) -> None:
        super().__init__(config)
        self._limits = Limits(_MAX_HEADER_BYTES, config.max_frame_bytes)
        self._cond = threading.Condition()
        self._channel: Channel | None = None
        self._closed = False
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._greeters: dict[threading.Thread, Channel] = {}
        self._listener: socket.socket | None = socket.create_server((config.host, config.port))
        host, port = self._listener.getsockname()[:2]
        self._address = {"host": host, "port": port}
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(self._listener,), name="kvmux-pipe-accept", daemon=True
        )
        self._acceptor.start()

    # ---------------------------------------------------------------- endpoints

    def address(self) -> dict[str, Any]:
        return dict(self._address)

    def connect(self, address: Mapping[str, Any]) -> None:
        try:
            endpoint = (str(address["host"]), int(address["port"]))
        except (KeyError, TypeError, ValueError):
            raise InvalidRequestError(f"not a tcp pipe address: {address!r}") from None
        deadline = time.monotonic() + self.config.timeout_s
        try:
            sock = socket.create_connection(endpoint, timeout=self.config.timeout_s)
        except OSError as exc:
            raise TransferError(f"cannot connect to pipe at {endpoint}: {exc}") from None
        chan = Channel(sock, PIPE_PROTOCOL, self._limits)
        try:
            chan.send(PipeHello(), deadline=deadline)
            expect(chan.recv(deadline), PipeHello)
        except BaseException:
            chan.close()
            raise
        if not self._attach(chan):
            raise TransferError("this pipe already has a peer")
        self._stop_listening()

    @property
    def connected(self) -> bool:
        with self._cond:
            return self._channel is not None and not self._channel.broken

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed: connected elsewhere, or the pipe is closing
            # Greet each caller on its own thread: a silent one must not hold up the peer.
            chan = Channel(sock, PIPE_PROTOCOL, self._limits)
            greeter = threading.Thread(
                target=self._greet, args=(chan,), name="kvmux-pipe-greet", daemon=True
            )
            with self._cond:
                self._greeters[greeter] = chan
            greeter.start()

    def _greet(self, chan: Channel) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        try:
            expect(chan.recv(deadline), PipeHello)
            chan.send(PipeHello(), deadline=deadline)
        except KvmuxError as exc:
            log.warning("tcp pipe: dropped a connection from %s: %s", chan.peer, exc)
            chan.close()
            return
        finally:
            with self._cond:
                self._greeters.pop(threading.current_thread(), None)
        if self._attach(chan):
            self._stop_listening()

    def _attach(self, chan: Channel) -> bool:
        with self._cond:
            if self._closed or self._channel is not None:
                chan.close()
                return False
            self._channel = chan
            self._cond.notify_all()
            return True

    def _stop_listening(self) -> None:
        with self._cond:
            listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
            listener.close()

    def _peer(self, deadline: float) -> Channel:
        """The attached channel, waiting for the peer until ``deadline``."""
        with self._cond:
            while self._channel is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no peer attached to the pipe at {self._address}")
                self._cond.wait(left)
            if self._closed:
                raise ClosedError("pipe is closed")
            assert self._channel is not None
            if self._channel.broken:
                raise TransferError("the pipe's peer is gone")
            return self._channel

    # ------------------------------------------------------------------ tensors

    def send_tensor(self, tensor: torch.Tensor | None) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        if tensor is None:
            msg: NoTensor | TensorHeader = NoTensor()
            payload: list[memoryview] = []
        else:
            data = tensor.detach().cpu().contiguous()
            nbytes = data.numel() * data.element_size()
            if nbytes + _MAX_HEADER_BYTES > self.config.max_frame_bytes:
                raise InvalidRequestError(
                    f"tensor of {nbytes} bytes exceeds max_frame_bytes="
                    f"{self.config.max_frame_bytes}"
                )
            msg = TensorHeader(dtype=dtype_name(data.dtype), shape=list(data.shape), nbytes=nbytes)
            payload = [byte_view(data)]
        chan = self._peer(deadline)
        if not self._send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout("another send kept the pipe busy past the timeout")
        try:
            chan.send(msg, payload, deadline=deadline)
        except TransferError as exc:
            chan.close()
            raise TransferError(f"pipe peer gone: {exc}") from None
        finally:
            self._send_lock.release()

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        """The next tensor; ``timeout`` None means ``config.timeout_s``."""
        wait = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        chan = self._peer(deadline)
        if not self._recv_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout("another receive kept the pipe busy past the timeout")
        try:
            msg = chan.recv(deadline, frame_timeout=self.config.timeout_s)
            if isinstance(msg, NoTensor):
                return None
            header = expect(msg, TensorHeader)
            out = torch.empty(header.shape, dtype=torch_dtype(header.dtype))
            chan.recv_into([byte_view(out)], time.monotonic() + self.config.timeout_s)
            return out
        except TransferTimeout:
            if not chan.broken:
                raise  # nothing of a frame was read: the pipe is still usable
            chan.close()
            raise TransferError("pipe peer stalled mid-tensor") from None
        except TransferError as exc:
            chan.close()
            raise TransferError(f"pipe peer gone: {exc}") from None
        finally:
            self._recv_lock.release()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            chan = self._channel
            greeters = dict(self._greeters)
            self._cond.notify_all()
        self._stop_listening()
        for channel in [chan, *greeters.values()]:
            if channel is not None:
                channel.close()
        self._acceptor.join(timeout=5)
        for greeter in greeters:
            greeter.join(timeout=5)
