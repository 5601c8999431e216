"""Moving whole blocks between an engine's KV tensors and flat byte rows.

Every backend that stores or ships bytes goes through here; where the bytes
lie in KV memory comes from :mod:`kvmux.addressing`. A destination or source
is a 2-D ``uint8`` tensor of rows ``block_nbytes`` wide (a pool, a staging
buffer, a mapped file). A row holds the block's slice of every layer, in
layer order, each slice in C order.

Host memory takes a fast path. Blocks bound for (or coming from) consecutive
rows move with one vectorized gather or scatter per layer; isolated rows are
a few fixed-stride byte ranges each, copied with ``memmove`` from addresses
computed once. Per-block torch indexing would cost ~20 µs of view bookkeeping
per copy, most of the time for a 32 KiB block. Other memory (CUDA, strided
views) takes the torch path: one strided copy per layer per run of
consecutive blocks.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from kvmux.addressing import SMALL_BATCH, BlockAddressing, Ids, as_ids, index_runs, row_runs
from kvmux.layout import KVLayout

_VECTOR_MIN_RUN = 4
"""Below this many consecutive rows, per-range memmove beats a vectorized call's set-up."""


class BlockCopier:
    """Copies blocks of registered KV memory to and from flat byte rows."""

    def __init__(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        layout.check_caches(caches)
        self.layout = layout
        self.caches = caches
        """The engine's KV tensors, for backends that map or register them."""
        self.block_nbytes = layout.block_nbytes
        self.num_blocks = layout.num_blocks
        # (uint8 view of the layer, its block dim, byte offset in a row, bytes per block)
        self._layers: list[tuple[torch.Tensor, int, int, int]] = []
        offset = 0
        for spec in layout.layers:
            u8 = caches[spec.name].view(torch.uint8)
            self._layers.append((u8, spec.block_dim, offset, spec.block_nbytes))
            offset += spec.block_nbytes
        addressing = BlockAddressing.of(layout, caches) if layout.device == "cpu" else None
        self._host = addressing.layers if addressing is not None else None
        """Address arithmetic of every layer, or None unless all are contiguous host
        tensors (then the torch path is the safe one)."""
        self._pieces: tuple[tuple[int, int, int, int], ...] = ()
        """(address for block 0, bytes to the next block, offset in a row, bytes) of
        every piece, in row order: what ``_memmove`` walks, computed once."""
        if addressing is not None:
            self._pieces = tuple(
                (addressing.layers[p.layer].base + p.offset, p.step, p.row_offset, p.nbytes)
                for p in addressing.pieces
            )

    def copy_out(self, block_ids: Ids, dst: torch.Tensor, rows: Ids | None = None) -> None:
        """Copy blocks ``block_ids`` into ``dst[rows[i]]`` (rows default to 0..n-1)."""
        block_ids, rows = as_ids(block_ids), None if rows is None else as_ids(rows)
        self._check_rows(dst, block_ids, rows)
        if self._host is not None and _host_rows(dst):
            self._host_copy(block_ids, dst, rows, to_rows=True)
            return
        # In inference mode whatever the calling thread's: caches an engine made under
        # it are inference tensors, which a copy thread (outside it) may not write to.
        with torch.inference_mode():
            for block, row, n in index_runs(block_ids, rows):
                for u8, bdim, off, nbytes in self._layers:
                    src = u8.narrow(bdim, block, n).movedim(bdim, 0)
                    dst[row : row + n, off : off + nbytes].view(src.shape).copy_(src)

    def copy_in(self, block_ids: Ids, src: torch.Tensor, rows: Ids | None = None) -> None:
        """Copy ``src[rows[i]]`` into blocks ``block_ids`` (rows default to 0..n-1)."""
        block_ids, rows = as_ids(block_ids), None if rows is None else as_ids(rows)
        self._check_rows(src, block_ids, rows)
        if self._host is not None and _host_rows(src):
            self._host_copy(block_ids, src, rows, to_rows=False)
            return
        with torch.inference_mode():  # as in copy_out
            for block, row, n in index_runs(block_ids, rows):
                for u8, bdim, off, nbytes in self._layers:
                    dst = u8.narrow(bdim, block, n).movedim(bdim, 0)
                    dst.copy_(src[row : row + n, off : off + nbytes].view(dst.shape))

    def gather(self, block_ids: Ids) -> torch.Tensor:
        """A new contiguous ``[len(block_ids), block_nbytes]`` tensor holding the blocks."""
        out = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8)
        self.copy_out(block_ids, out)
        return out

    def contiguous_block(self, block: int) -> torch.Tensor | None:
        """The block's bytes as one flat view of the KV memory itself, if it is one
        contiguous range (single layer, block dimension first); else None.

        Lets a receiver write straight into KV memory without a staging copy.
        """
        if len(self._layers) != 1:
            return None
        u8, bdim, _, nbytes = self._layers[0]
        view = u8.select(bdim, block)
        return view.view(nbytes) if view.is_contiguous() else None

    def _host_copy(
        self,
        block_ids: Ids,
        rows_tensor: torch.Tensor,
        rows: Ids | None,
        *,
        to_rows: bool,
    ) -> None:
        """Runs of consecutive rows move with one vectorized call per layer (a
        gather for ``to_rows``, a numpy scatter otherwise: torch's scatter,
        ``index_copy_``, is several times slower); short runs use ``memmove``.
        Big batches are split across threads: these calls release the GIL, and a
        scatter runs on one core while memcpy itself uses every core. (Gathers
        are split too: one run in this thread would leave torch's OpenMP threads
        spinning on the cores the scatters of the next load need.)"""
        assert self._host is not None
        if len(block_ids) == 1:  # one block: its pieces, with no run finding
            row = 0 if rows is None else int(rows[0])
            self._memmove(block_ids, rows_tensor, row, to_rows=to_rows)
            return
        tasks: list[Callable[[], None]] = []
        for row, start, n in row_runs(rows, len(block_ids)):
            blocks = block_ids[start : start + n]
            if n < _VECTOR_MIN_RUN:
                tasks.append(partial(self._memmove, blocks, rows_tensor, row, to_rows=to_rows))
                continue
            idx = torch.as_tensor(np.asarray(blocks, dtype=np.int64))
            run = rows_tensor[row : row + n]
            for layer, (u8, _, off, nbytes) in zip(self._host, self._layers, strict=True):
                kv = u8.view(layer.pieces, -1, layer.piece_nbytes)
                flat = run[:, off : off + nbytes].view(n, layer.pieces, layer.piece_nbytes)
                flat = flat.transpose(0, 1)
                if to_rows:
                    tasks.append(partial(_gather, kv, idx, flat))
                else:
                    tasks.append(partial(_scatter, kv.numpy(), idx.numpy(), flat.numpy()))
        _run_split(tasks, len(block_ids) * self.block_nbytes)

    def _memmove(
        self, block_ids: Ids, rows_tensor: torch.Tensor, first_row: int, *, to_rows: bool
    ) -> None:
        row_stride = rows_tensor.stride(0)
        row_addr = rows_tensor.data_ptr() + first_row * row_stride
        move = ctypes.memmove
        for block in map(int, block_ids):  # ctypes takes Python ints only
            for start, step, row_offset, nbytes in self._pieces:
                kv, flat = start + block * step, row_addr + row_offset
                if to_rows:
                    move(flat, kv, nbytes)
                else:
                    move(kv, flat, nbytes)
            row_addr += row_stride

    def _check_rows(self, tensor: torch.Tensor, block_ids: Ids, rows: Ids | None) -> None:
        if tensor.dtype != torch.uint8 or tensor.dim() != 2:
            raise ValueError(
                f"rows must be a 2-D uint8 tensor, got {tensor.dtype} {tensor.dim()}-D"
            )
        if tensor.shape[1] != self.block_nbytes:
            raise ValueError(
                f"rows are {tensor.shape[1]} bytes wide, blocks are {self.block_nbytes}"
            )
        if not len(block_ids):
            return
        low, high = _bounds(block_ids)
        if low < 0 or high >= self.num_blocks:
            raise IndexError(f"block id out of range [0, {self.num_blocks})")
        low, high = (0, len(block_ids) - 1) if rows is None else _bounds(rows)
        if low < 0 or high >= tensor.shape[0]:
            raise IndexError(f"row out of range for {tensor.shape[0]} rows")


def _gather(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:, i] = src[:, idx[i]]``, as 8-byte words where both byte views allow
    it (each piece, its offset and every stride a multiple of 8): ``index_select``
    copies element by element, so 32 KiB pieces gather at about memcpy's speed as
    words and half of it as bytes.

    The word views are made here, in the thread that copies, never by the caller:
    vLLM calls in under ``torch.inference_mode``, which is per thread, and a view
    made there is an inference tensor that a copy thread may not write to."""
    if not any(x % 8 for v in (src, out) for x in (v.size(-1), v.data_ptr(), *v.stride()[:-1])):
        src, out = src.view(torch.int64), out.view(torch.int64)
    torch.index_select(src, 1, idx, out=out)


def _scatter(
    dst: np.ndarray[Any, Any], idx: np.ndarray[Any, Any], src: np.ndarray[Any, Any]
) -> None:
    dst[:, idx, :] = src


_PARALLEL_MIN_BYTES = 4 << 20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _run_split(tasks: list[Callable[[], None]], nbytes: int) -> None:
    """Run ``tasks`` in order, or split across threads when the batch is big enough
    for a thread hop to pay off."""
    if nbytes < _PARALLEL_MIN_BYTES or len(tasks) < 2:
        _run_all(tasks)
        return
    workers = min(torch.get_num_threads(), len(tasks))
    if workers < 2:
        _run_all(tasks)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="kvmux-copy")
    groups = [tasks[i::workers] for i in range(workers)]
    futures = [_pool.submit(_run_all, group) for group in groups[1:]]
    _run_all(groups[0])
    for fut in futures:
        fut.result()


def _run_all(tasks: list[Callable[[], None]]) -> None:
    for task in tasks:
        task()


def _bounds(values: Ids) -> tuple[int, int]:
    """(min, max) of a non-empty list or array, each at C speed (the builtins
    would iterate a numpy array element by element; a few elements cost less as a
    list than two numpy reductions)."""
    if isinstance(values, np.ndarray):
        if len(values) >= SMALL_BATCH:
            return int(values.min()), int(values.max())
        values = values.tolist()
    return min(values), max(values)


def _host_rows(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.stride(1) == 1
