"""The conformance suite on the uds Pipe, bridged to a Connector, plus framing checks."""

from __future__ import annotations

import socket
import struct
from typing import Any

import pytest
import torch
from kvmux_example import framing
from kvmux_example.uds import UdsPipeConfig, UnixSocketPipe

from kvmux.bridges import BufferBackend, PipeLookupBuffer
from kvmux.connector import Connector
from kvmux.errors import ProtocolError, TransferTimeout
from kvmux.testing.suite import ConnectorSuite


class TestUdsPipe(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self) -> Any:
        def make(**overrides: Any) -> Connector:
            config = UdsPipeConfig(timeout_s=5, **overrides)
            return Connector(
                BufferBackend(PipeLookupBuffer(UnixSocketPipe(config), config), config)
            )

        return make


@pytest.fixture
def pipes() -> Any:
    a, b = UnixSocketPipe(UdsPipeConfig()), UnixSocketPipe(UdsPipeConfig())
    b.connect(a.address())
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("dtype", framing.DTYPES)
def test_tensors_cross_unchanged(pipes: Any, dtype: torch.dtype) -> None:
    a, b = pipes
    sent = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    b.send_tensor(sent)
    got = a.recv_tensor(timeout=5)
    assert got is not None and got.dtype == dtype and got.equal(sent)


def test_none_and_empty_tensors_are_messages_too(pipes: Any) -> None:
    a, b = pipes
    a.send_tensor(None)
    a.send_tensor(torch.empty(0, 5))
    assert b.recv_tensor(timeout=5) is None
    empty = b.recv_tensor(timeout=5)
    assert empty is not None and empty.shape == (0, 5)


def test_receiving_with_nothing_sent_times_out(pipes: Any) -> None:
    with pytest.raises(TransferTimeout):
        pipes[0].recv_tensor(timeout=0.05)


def _raw_frame(head: bytes) -> UnixSocketPipe:
    """A pipe whose peer is a raw socket that sends ``head``."""
    pipe = UnixSocketPipe(UdsPipeConfig(max_frame_bytes=4096))
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(pipe.address()["path"])
    raw.sendall(head)
    return pipe


@pytest.mark.parametrize(
    "head, problem",
    [
        (struct.pack("<4sBBBBQ", b"EVIL", 1, 1, 0, 1, 4), "magic"),
        (struct.pack("<4sBBBBQ", b"KVUD", 9, 1, 0, 1, 4), "version"),
        (struct.pack("<4sBBBBQ", b"KVUD", 1, 7, 0, 1, 4), "kind"),
        (struct.pack("<4sBBBBQ", b"KVUD", 1, 1, 99, 1, 4), "dtype code"),
        (struct.pack("<4sBBBBQ", b"KVUD", 1, 1, 0, 40, 4), "dimensions"),
        (struct.pack("<4sBBBBQ", b"KVUD", 1, 1, 0, 1, 2**40), "max_frame_bytes"),
        (struct.pack("<4sBBBBQQ", b"KVUD", 1, 1, 0, 1, 4, 5), "does not hold"),
        (struct.pack("<4sBBBBQ", b"KVUD", 1, 0, 3, 0, 0), "None frame"),
    ],
)
def test_malformed_frames_are_refused_before_reading_a_payload(head: bytes, problem: str) -> None:
    pipe = _raw_frame(head)
    with pytest.raises(ProtocolError, match=problem):
        pipe.recv_tensor(timeout=5)
    pipe.close()
