"""Payloads as (address, length) tables: libc scatter/gather under the framing layer."""

from __future__ import annotations

import ctypes
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvmux.errors import TransferError, TransferTimeout
from kvmux.net import iovec
from kvmux.net.frames import MAGIC, PREFIX, Channel, Limits
from kvmux.net.iovec import IOV_MAX, IoVecs
from kvmux.net.messages import PEER_PROTOCOL, Blocks, LookupReply

LIMITS = Limits(max_header_bytes=64 * 1024, max_frame_bytes=64 * 1024 * 1024)


def soon(seconds: float = 5.0) -> float:
    return time.monotonic() + seconds


@pytest.fixture
def pair() -> Iterator[tuple[Channel, Channel]]:
    a, b = socket.socketpair()
    left, right = Channel(a, PEER_PROTOCOL, LIMITS), Channel(b, PEER_PROTOCOL, LIMITS)
    yield left, right
    left.close()
    right.close()


def scattered(tensor: torch.Tensor, sizes: list[int], seed: int) -> IoVecs:
    """Ranges of ``tensor`` of the given sizes, laid out in a shuffled order (with a
    gap after each), listed in an order that is not the memory's."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(sizes), generator=gen).tolist()
    starts = [0] * len(sizes)
    at = 0
    for i in order:
        starts[i] = at
        at += sizes[i] + 3
    assert at <= tensor.numel()
    base = tensor.data_ptr()
    table = np.array([[base + s, n] for s, n in zip(starts, sizes, strict=True)], dtype=np.uint64)
    return IoVecs(table, tensor)


def gathered(ranges: IoVecs) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in ranges.table.tolist())


def random_sizes(count: int, total: int, seed: int) -> list[int]:
    gen = np.random.default_rng(seed)
    cuts = np.sort(gen.choice(np.arange(1, total), count - 1, replace=False))
    return np.diff([0, *cuts.tolist(), total]).tolist()


def test_thousands_of_scattered_ranges_arrive_byte_exact_in_ranges_cut_elsewhere(
    pair: tuple[Channel, Channel],
) -> None:
    """More ranges than one system call takes, on both sides, cut at other places:
    the bytes arrive in order, and each side's counters say how many moved."""
    left, right = pair
    total = 3 * 2**20
    source = torch.randint(0, 256, (2 * total,), dtype=torch.uint8)
    sink = torch.zeros(2 * total, dtype=torch.uint8)
    out = scattered(source, random_sizes(3 * IOV_MAX + 5, total, 1), 1)
    into = scattered(sink, random_sizes(2 * IOV_MAX + 7, total, 2), 2)
    sender = threading.Thread(
        target=left.send,
        args=(Blocks(first=0, count=1, nbytes=total), out),
        kwargs={"deadline": soon()},
    )
    sender.start()
    msg = right.recv(soon())
    assert msg == Blocks(first=0, count=1, nbytes=total)
    right.recv_into(into, soon())
    sender.join()
    assert gathered(into) == gathered(out)
    assert right.bytes_delivered == total
    assert left.bytes_sent == right.bytes_received


def test_payload_bytes_already_read_ahead_land_in_the_first_ranges(
    pair: tuple[Channel, Channel],
) -> None:
    """A small frame's payload comes in with its header into the read-ahead buffer;
    the ranges get it from there, and the next frame is still read in step."""
    left, right = pair
    source = torch.arange(300, dtype=torch.uint8)
    sink = torch.zeros(400, dtype=torch.uint8)
    out = IoVecs(np.array([[source.data_ptr(), 300]], dtype=np.uint64), source)
    into = scattered(sink, [7, 1, 150, 142], 3)
    left.send(Blocks(first=0, count=1, nbytes=300), out, deadline=soon())
    left.send(LookupReply(count=2), deadline=soon())
    assert right.recv(soon()) == Blocks(first=0, count=1, nbytes=300)
    right.recv_into(into, soon())
    assert gathered(into) == bytes(range(256)) + bytes(range(44))
    assert right.recv(soon()) == LookupReply(count=2)


HALF = 16 * 1024
"""Half of a frame's payload: small enough that no alignment padding precedes it."""


def _send_half(chan: Channel) -> Blocks:
    """A frame's prefix and header announcing ``2 * HALF`` bytes, and ``HALF`` of them."""
    header = Blocks(first=0, count=1, nbytes=2 * HALF)
    encoded = PEER_PROTOCOL.dump_json(header)
    chan.sock.sendall(PREFIX.pack(MAGIC, len(encoded)) + encoded + b"\1" * HALF)
    return header


def test_a_sender_that_stalls_mid_payload_times_out_a_range_read_at_its_deadline(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    sink = torch.zeros(8 * HALF, dtype=torch.uint8)
    header = _send_half(left)
    assert right.recv(soon()) == header
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        right.recv_into(scattered(sink, random_sizes(64, 2 * HALF, 4), 4), start + 0.3)
    elapsed = time.monotonic() - start
    assert 0.25 < elapsed < 1.0, elapsed
    assert right.broken
    assert right.bytes_delivered == HALF


def test_a_sender_that_closes_mid_payload_fails_a_range_read(
    pair: tuple[Channel, Channel],
) -> None:
    left, right = pair
    sink = torch.zeros(8 * HALF, dtype=torch.uint8)
    header = _send_half(left)
    left.sock.shutdown(socket.SHUT_WR)
    assert right.recv(soon()) == header
    with pytest.raises(TransferError, match="closed the connection"):
        right.recv_into(scattered(sink, random_sizes(64, 2 * HALF, 5), 5), soon())
    assert right.broken
    assert right.bytes_delivered == HALF


def test_advance_skips_whole_rows_and_cuts_the_next_without_changing_the_callers() -> None:
    table = np.array([[100, 10], [200, 20], [300, 30]], dtype=np.uint64)
    assert iovec.advance(table, 0) is table
    assert iovec.advance(table, 10).tolist() == [[200, 20], [300, 30]]
    assert iovec.advance(table, 15).tolist() == [[205, 15], [300, 30]]
    assert iovec.advance(table, 60).tolist() == []
    assert table.tolist() == [[100, 10], [200, 20], [300, 30]]
