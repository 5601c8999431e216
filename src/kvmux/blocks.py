"""Moving whole blocks between an engine's KV tensors and flat byte rows.

Every backend that stores or ships bytes goes through here, so the one place
that knows how a layout maps to memory is this file. A destination or source
is a 2-D ``uint8`` tensor of rows ``block_nbytes`` wide (a pool, a staging
buffer, a mapped file); consecutive blocks that land in consecutive rows are
copied with one strided copy per layer, which keeps large batches near memcpy
speed (scatter via ``index_copy_`` is several times slower on CPU).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from kvmux.layout import KVLayout


class BlockCopier:
    """Copies blocks of registered KV memory to and from flat byte rows."""

    def __init__(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        layout.check_caches(caches)
        self.layout = layout
        self.block_nbytes = layout.block_nbytes
        # (uint8 view of the layer, its block dim, byte offset in a row, bytes per block)
        self._layers: list[tuple[torch.Tensor, int, int, int]] = []
        offset = 0
        for spec in layout.layers:
            u8 = caches[spec.name].view(torch.uint8)
            self._layers.append((u8, spec.block_dim, offset, spec.block_nbytes))
            offset += spec.block_nbytes

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def copy_out(
        self, block_ids: Sequence[int], dst: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Copy blocks ``block_ids`` into ``dst[rows[i]]`` (rows default to 0..n-1)."""
        for block, row, n in _runs(block_ids, rows):
            for u8, bdim, off, nbytes in self._layers:
                src = u8.narrow(bdim, block, n).movedim(bdim, 0)
                dst[row : row + n, off : off + nbytes].view(src.shape).copy_(src)

    def copy_in(
        self, block_ids: Sequence[int], src: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Copy ``src[rows[i]]`` into blocks ``block_ids`` (rows default to 0..n-1)."""
        for block, row, n in _runs(block_ids, rows):
            for u8, bdim, off, nbytes in self._layers:
                dst = u8.narrow(bdim, block, n).movedim(bdim, 0)
                dst.copy_(src[row : row + n, off : off + nbytes].view(dst.shape))

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
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


def _runs(
    block_ids: Sequence[int], rows: Sequence[int] | None
) -> Iterator[tuple[int, int, int]]:
    """Split into (first block, first row, length) runs where both advance by one."""
    if rows is None:
        rows = range(len(block_ids))
    if len(rows) != len(block_ids):
        raise ValueError(f"{len(block_ids)} block ids but {len(rows)} rows")
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while (
            j < n
            and block_ids[j] == block_ids[j - 1] + 1
            and rows[j] == rows[j - 1] + 1
        ):
            j += 1
        yield block_ids[i], rows[i], j - i
        i = j
