"""Where each block's bytes lie in registered KV memory: the one address calculator.

A block's serialized form (a pool row, a frame, a file; :mod:`kvmux.layout`)
is every layer's slice of the block, in layer order, each in C order. In a
contiguous KV tensor that slice is a few fixed-stride byte ranges, the
block's *pieces*: one per layer when the block dimension comes first, one per
index of the dimensions before it otherwise (vLLM's ``(2, num_blocks, ...)``
keeps K and V apart: two pieces). Piece ``j`` of layer ``l`` for block ``b``
starts at ``base_l + j * num_blocks * nbytes_l + b * nbytes_l``.

Everything that addresses KV memory byte-wise asks :class:`BlockAddressing`:
the host copy path (:mod:`kvmux.blocks`), socket scatter reads
(:mod:`kvmux.net.kv_views`) and the descriptor lists of zero-copy READs
(``nixl``, ``mooncake``). The descriptor lists are coalesced here, once:
pieces contiguous on both sides (consecutive blocks landing in consecutive
rows of a single-piece layout, say) become one range, so a transport is handed
as few requests as the memory allows. :func:`index_runs` and
:func:`row_runs` find the runs of consecutive block ids and rows that the
copies themselves batch over.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvmux.layout import KVLayout

Ids = Sequence[int] | npt.NDArray[np.int64]
"""Block ids or rows: a list, or an int64 array (no conversion needed)."""

Addresses = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class LayerAddressing:
    """One layer's pieces: ``pieces`` ranges of ``piece_nbytes`` bytes per block, piece
    ``j`` of block ``b`` at ``base + j * piece_stride + b * block_stride``."""

    base: int
    """Address of the layer tensor's first byte."""
    pieces: int
    piece_stride: int
    block_stride: int
    piece_nbytes: int
    row_offset: int
    """Where the layer's slice starts in a block's serialized row."""
    device: int
    """Device index of the memory (0 for host memory)."""


@dataclass(frozen=True)
class Piece:
    """One byte range of every block: block ``b``'s is ``nbytes`` bytes at ``offset +
    b * step`` from the start of layer ``layer``'s tensor, and sits ``row_offset``
    bytes into the block's serialized row."""

    layer: int
    offset: int
    step: int
    nbytes: int
    row_offset: int


@dataclass(frozen=True)
class Runs:
    """Coalesced ranges of one transfer between KV memory and rows of a pool: range
    ``i`` is ``nbytes[i]`` bytes at ``local[i]`` (KV memory, on ``device[i]``) and at
    ``remote[i]`` (the pool)."""

    local: Addresses
    remote: Addresses
    nbytes: Addresses
    device: Addresses

    def __len__(self) -> int:
        return len(self.local)


class BlockAddressing:
    """Byte addresses of every block's pieces in one registered set of contiguous
    KV tensors (host or device memory). Build it with :meth:`of`."""

    def __init__(self, layout: KVLayout, layers: tuple[LayerAddressing, ...]) -> None:
        self.layers = layers
        self.block_nbytes = layout.block_nbytes
        self.num_blocks = layout.num_blocks
        self.pieces = tuple(
            Piece(
                layer=i,
                offset=j * la.piece_stride,
                step=la.block_stride,
                nbytes=la.piece_nbytes,
                row_offset=la.row_offset + j * la.piece_nbytes,
            )
            for i, la in enumerate(layers)
            for j in range(la.pieces)
        )
        """Every block's byte ranges, in serialized order."""
        # The same, as vectors for ``runs``.
        self._start = np.array(
            [layers[p.layer].base + p.offset for p in self.pieces], dtype=np.uint64
        )
        self._step = np.array([p.step for p in self.pieces], dtype=np.uint64)
        self._length = np.array([p.nbytes for p in self.pieces], dtype=np.uint64)
        self._row_offset = np.array([p.row_offset for p in self.pieces], dtype=np.uint64)
        self._device = np.array([layers[p.layer].device for p in self.pieces], dtype=np.uint64)
        self._piece_table = tuple(
            (
                layers[p.layer].base + p.offset,
                p.step,
                p.nbytes,
                layers[p.layer].device,
            )
            for p in self.pieces
        )
        """The same per piece, as Python ints, for ``_few_runs``."""
        self._row_offsets = [p.row_offset for p in self.pieces]

    @classmethod
    def of(cls, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> BlockAddressing | None:
        """The addressing of ``caches`` (as ``layout`` describes them), or None unless
        every layer is one contiguous tensor: strided memory has no fixed pieces."""
        layers = []
        row_offset = 0
        for spec in layout.layers:
            tensor = caches[spec.name]
            if not tensor.is_contiguous():
                return None
            pieces = math.prod(spec.shape[: spec.block_dim])
            piece_nbytes = spec.block_nbytes // pieces
            layers.append(
                LayerAddressing(
                    base=tensor.data_ptr(),
                    pieces=pieces,
                    piece_stride=layout.num_blocks * piece_nbytes,
                    block_stride=piece_nbytes,
                    piece_nbytes=piece_nbytes,
                    row_offset=row_offset,
                    device=max(tensor.get_device(), 0),
                )
            )
            row_offset += spec.block_nbytes
        return cls(layout, tuple(layers))

    def piece_starts(self) -> list[int]:
        """Where block 0's pieces start, in serialized order: with the layout (which
        fixes every piece's step) all a peer needs to address any block here."""
        return [int(start) for start in self._start]

    def ranges(self, blocks: Ids) -> Addresses:
        """``blocks`` in serialized form, one block after the other, as ``[n, 2]``
        rows of (address, length) in KV memory; ranges that continue one another
        (consecutive blocks of a single-piece layout) merged into one. What a
        socket scatter read or gather write of those blocks walks."""
        b = np.asarray(blocks, dtype=np.uint64)[:, None]
        start = (self._start + b * self._step).reshape(-1)
        length = np.broadcast_to(self._length, (len(b), len(self.pieces))).reshape(-1)
        return _merged(start, length)

    def runs(self, blocks: Ids, rows: Ids, row_base: int) -> Runs:
        """Every piece of ``blocks[i]`` paired with its place in row ``rows[i]`` of a
        pool of ``block_nbytes``-wide rows at address ``row_base``, block by block,
        ranges contiguous on both sides merged into one."""
        width = self.block_nbytes
        if len(blocks) < SMALL_BATCH:
            table = [(row_base + offset, width) for offset in self._row_offsets]
            return self._few_runs(blocks, rows, table)
        return self._runs(blocks, rows, np.uint64(row_base) + self._row_offset, np.uint64(width))

    def block_runs(self, blocks: Ids, remote_blocks: Ids, remote_starts: Sequence[int]) -> Runs:
        """:meth:`runs` between ``blocks`` here and ``remote_blocks`` of a peer's KV
        memory of the same layout whose pieces start at ``remote_starts`` (its
        :meth:`piece_starts`): a producer that lends its blocks serves from there."""
        if len(remote_starts) != len(self.pieces):
            raise ValueError(
                f"the peer's blocks have {len(remote_starts)} pieces, ours {len(self.pieces)}"
            )
        if len(blocks) < SMALL_BATCH:
            steps = self._step.tolist()
            return self._few_runs(
                blocks, remote_blocks, list(zip(remote_starts, steps, strict=True))
            )
        starts = np.asarray(remote_starts, dtype=np.uint64)
        return self._runs(blocks, remote_blocks, starts, self._step)

    def _runs(
        self, blocks: Ids, remote: Ids, remote_start: Addresses, remote_step: Addresses | np.uint64
    ) -> Runs:
        """Piece ``p`` of ``blocks[i]`` against ``remote_start[p] + remote[i] *
        remote_step[p]``, with numpy, merged where contiguous on both sides."""
        b = np.asarray(blocks, dtype=np.uint64)[:, None]
        r = np.asarray(remote, dtype=np.uint64)[:, None]
        local = (self._start + b * self._step).reshape(-1)
        there = (remote_start + r * remote_step).reshape(-1)
        length = np.broadcast_to(self._length, (len(b), len(self.pieces))).reshape(-1)
        device = np.broadcast_to(self._device, (len(b), len(self.pieces))).reshape(-1)
        # A new range starts wherever either side stops being contiguous.
        starts = np.ones(len(local), dtype=bool)
        ends = local[:-1] + length[:-1]
        starts[1:] = (local[1:] != ends) | (there[1:] != there[:-1] + length[:-1])
        first = np.flatnonzero(starts)
        if len(first) == len(local):
            return Runs(local, there, np.ascontiguousarray(length), np.ascontiguousarray(device))
        return Runs(local[first], there[first], np.add.reduceat(length, first), device[first])

    def _few_runs(self, blocks: Ids, remote: Ids, table: Sequence[tuple[int, int]]) -> Runs:
        """:meth:`_runs` of a few blocks, walked piece by piece in Python, ``table``
        giving each piece's remote (start, step): the vector version's dozen numpy
        calls cost a one-block READ ~35 µs of set-up, several times the walk."""
        local: list[int] = []
        remote_at: list[int] = []
        length: list[int] = []
        device: list[int] = []
        for block, row in zip(_ints(blocks), _ints(remote), strict=True):
            for (start, step, nbytes, dev), (rstart, rstep) in zip(
                self._piece_table, table, strict=True
            ):
                here, there = start + block * step, rstart + row * rstep
                if local and here == local[-1] + length[-1] and there == remote_at[-1] + length[-1]:
                    length[-1] += nbytes
                    continue
                local.append(here)
                remote_at.append(there)
                length.append(nbytes)
                device.append(dev)
        return Runs(*(np.array(v, dtype=np.uint64) for v in (local, remote_at, length, device)))


def as_ids(ids: Ids) -> Ids:
    """A batch's ids as one int64 array, made once where several steps index with
    them: each step that took the list made its own array or walked it (~0.1 ms
    apiece for 4096 ids). A few ids stay as given, cheaper to walk than numpy to
    set up."""
    if len(ids) < SMALL_BATCH or isinstance(ids, np.ndarray):
        return ids
    return np.fromiter(ids, np.int64, len(ids))


def _ints(ids: Ids) -> list[int]:
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def index_runs(block_ids: Ids, rows: Ids | None) -> Iterator[tuple[int, int, int]]:
    """(first block, first row, length) of each run where block id and row both
    advance by one (rows default to 0..n-1)."""
    block_ids = _ints(block_ids)
    rows = range(len(block_ids)) if rows is None else _ints(rows)
    if len(rows) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids but {len(rows)} rows")
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1 and rows[j] == rows[j - 1] + 1:
            j += 1
        yield block_ids[i], rows[i], j - i
        i = j


SMALL_BATCH = 16
"""Below this many rows, a Python walk beats numpy's per-call set-up (~1 µs a call,
several calls): a one-block batch is where a transfer's fixed cost shows."""


def row_runs(rows: Ids | None, n: int) -> list[tuple[int, int, int]]:
    """(first row, first index, length) of each run of consecutive rows among ``n``
    (rows default to 0..n-1), found with one numpy pass: a batch is thousands of
    rows, mostly in a few runs. A few rows are walked in Python instead (same
    runs)."""
    if rows is None or n == 0:
        return [(0, 0, n)] if n else []
    if len(rows) != n:
        raise ValueError(f"{n} block ids but {len(rows)} rows")
    if n < SMALL_BATCH:
        return _short_row_runs(_ints(rows))
    r = np.asarray(rows, dtype=np.int64)
    starts = np.flatnonzero(np.diff(r) != 1) + 1
    firsts = [0, *starts.tolist()]
    lengths = np.diff([*firsts, n]).tolist()
    return list(zip(r[firsts].tolist(), firsts, lengths, strict=True))


def _short_row_runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """:func:`row_runs` of a short list, walked in Python."""
    runs = []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((int(rows[start]), start, i - start))
            start = i
    return runs


def row_ranges(base: int, rows: Ids, width: int) -> Addresses:
    """Rows ``rows`` of a table of ``width``-byte rows at address ``base``, in that
    order, as ``[n, 2]`` rows of (address, length), consecutive rows merged."""
    start = np.uint64(base) + np.asarray(rows, dtype=np.uint64) * np.uint64(width)
    return _merged(start, np.full(len(start), width, dtype=np.uint64))


def _merged(start: Addresses, length: Addresses) -> Addresses:
    """``[n, 2]`` (address, length) rows of the ranges given, in order, each merged
    into the one before where it starts at that one's end."""
    keep = np.ones(len(start), dtype=bool)
    keep[1:] = start[1:] != start[:-1] + length[:-1]
    first = np.flatnonzero(keep)
    table = np.empty((len(first), 2), dtype=np.uint64)
    table[:, 0] = start[first]
    table[:, 1] = np.add.reduceat(length, first) if len(first) else length
    return table
