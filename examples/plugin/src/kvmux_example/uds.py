"""``uds``: a Pipe over a Unix-domain socket, the point-to-point plug-in level.

Each endpoint listens on its own socket file (``address()`` names it); the
other endpoint ``connect``s, and from then on both send and receive frames
(:mod:`kvmux_example.framing`). kvmux turns a pipe into a backend with
``PipeLookupBuffer`` + ``BufferBackend`` when a config names ``uds``, so
this file is all a transport author writes.
"""

from __future__ import annotations

import contextlib
import select
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import Field

from kvmux.config import BackendConfig
from kvmux.errors import (
    ClosedError,
    ConfigError,
    InvalidRequestError,
    TransferError,
    TransferTimeout,
)
from kvmux.pipe import Pipe
from kvmux_example import framing

MAX_SOCKET_PATH = 100
"""AF_UNIX paths are limited to about 108 bytes; stay clear of the edge."""


class UdsPipeConfig(BackendConfig):
    backend: str = "pipes:uds"
    path: Path | None = Field(
        None, description="directory for this endpoint's socket file; None: a new temp dir"
    )
    max_frame_bytes: int = Field(
        256 * 2**20, ge=1024, description="largest tensor accepted from the peer, in bytes"
    )


class UnixSocketPipe(Pipe):
    config_model = UdsPipeConfig
    config: UdsPipeConfig

    def __init__(self, config: UdsPipeConfig) -> None:
        super().__init__(config)
        self._own_dir = config.path is None
        directory = (
            Path(tempfile.mkdtemp(prefix="kvmux-uds-")) if config.path is None else config.path
        )
        self._path = directory / f"{uuid.uuid4().hex[:12]}.sock"
        if len(str(self._path)) > MAX_SOCKET_PATH:
            raise ConfigError("uds", [("path", "socket path too long for AF_UNIX", str(directory))])
        directory.mkdir(parents=True, exist_ok=True)
        self._listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self._path))
        self._listener.listen(1)
        self._sock: socket.socket | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="kvmux-uds-accept").start()

    # ------------------------------------------------------------------ Pipe API

    def address(self) -> dict[str, Any]:
        return {"path": str(self._path)}

    def connect(self, address: Mapping[str, Any]) -> None:
        path = address.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError(f"not a uds pipe address: {address!r}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.config.timeout_s)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise TransferError(f"cannot connect to uds pipe at {path}: {exc}") from None
        if not self._attach(sock):
            raise TransferError("this uds pipe already has a peer")

    @property
    def connected(self) -> bool:
        with self._cond:
            return self._sock is not None

    def send_tensor(self, tensor: torch.Tensor | None) -> None:
        head, payload = framing.encode(tensor)
        sock = self._peer(self.config.timeout_s)
        try:
            with self._send_lock:
                sock.sendall(head)
                if payload is not None and payload.numel():
                    sock.sendall(memoryview(payload.numpy()))
        except OSError as exc:
            raise TransferError(f"uds peer gone: {exc}") from None

    def recv_tensor(self, timeout: float | None = None) -> torch.Tensor | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        sock = self._peer(timeout)
        with self._recv_lock:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                readable = select.select([sock], [], [], left)[0]
            except (OSError, ValueError):  # closed under us by close()
                raise TransferError("uds pipe closed while receiving") from None
            if not readable:
                raise TransferTimeout(f"nothing from the uds peer within {timeout} s")
            # A frame has started: the rest must follow within the config's timeout.
            header = framing.parse_header(
                self._read(sock, framing.HEADER.size), self.config.max_frame_bytes
            )
            if header.kind == framing.KIND_NONE:
                return None
            shape = framing.parse_shape(header, self._read(sock, header.ndim * framing.DIM.size))
            return framing.decode(header, shape, self._read(sock, header.nbytes))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            sock, self._sock = self._sock, None
            self._cond.notify_all()
        if sock is not None:
            _shutdown(sock)
        self._stop_listening()
        if self._own_dir:
            shutil.rmtree(self._path.parent, ignore_errors=True)

    # ------------------------------------------------------------------ internals

    def _accept(self) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            sock, _ = listener.accept()
        except OSError:
            return  # closed: we connected out instead, or the pipe is closing
        sock.settimeout(self.config.timeout_s)
        self._attach(sock)

    def _attach(self, sock: socket.socket) -> bool:
        with self._cond:
            if self._closed or self._sock is not None:
                sock.close()
                return False
            self._sock = sock
            self._cond.notify_all()
        self._stop_listening()
        return True

    def _stop_listening(self) -> None:
        with self._cond:
            listener, self._listener = self._listener, None
        if listener is not None:
            _shutdown(listener)
            self._path.unlink(missing_ok=True)

    def _peer(self, timeout: float | None) -> socket.socket:
        with self._cond:
            self._cond.wait_for(lambda: self._sock is not None or self._closed, timeout)
            if self._closed:
                raise ClosedError("uds pipe is closed")
            if self._sock is None:
                raise TransferTimeout(f"no uds peer attached within {timeout} s")
            return self._sock

    def _read(self, sock: socket.socket, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            try:
                chunk = sock.recv_into(view[got:])
            except TimeoutError:
                raise TransferError("uds peer stalled in the middle of a frame") from None
            except OSError as exc:
                raise TransferError(f"uds peer gone: {exc}") from None
            if chunk == 0:
                raise TransferError("uds peer closed the pipe")
            got += chunk
        return buf


def _shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on ``sock``, then close it."""
    with contextlib.suppress(OSError):  # not connected, or already shut down
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
