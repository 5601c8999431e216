"""BlockAddressing: where a block's bytes lie, and the coalesced ranges of a transfer."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvmux.addressing import SMALL_BATCH, BlockAddressing, index_runs, row_ranges, row_runs
from kvmux.blocks import BlockCopier
from kvmux.layout import KVLayout

from support import make_caches


def _addressing(caches: dict[str, torch.Tensor], block_dim: int = 0) -> BlockAddressing:
    layout = KVLayout.from_caches(caches, 16, block_dim=block_dim)
    addressing = BlockAddressing.of(layout, caches)
    assert addressing is not None
    return addressing


def _read_like_a_transport(
    addressing: BlockAddressing, pool: torch.Tensor, blocks: list[int], rows: list[int]
) -> None:
    """Move pool rows into KV blocks range by range, as a zero-copy READ would."""
    runs = addressing.runs(blocks, rows, pool.data_ptr())
    for local, remote, nbytes in zip(
        runs.local.tolist(), runs.remote.tolist(), runs.nbytes.tolist(), strict=True
    ):
        ctypes.memmove(local, remote, nbytes)


def test_consecutive_blocks_into_consecutive_rows_merge_into_one_range() -> None:
    caches = make_caches(num_blocks=16, layers=1)
    addressing = _addressing(caches)
    runs = addressing.runs([3, 4, 5, 6], [10, 11, 12, 13], row_base=1 << 20)
    kv = caches["layer.0"]
    assert len(runs) == 1
    assert runs.local.tolist() == [kv[3].data_ptr()]
    assert runs.remote.tolist() == [(1 << 20) + 10 * addressing.block_nbytes]
    assert runs.nbytes.tolist() == [4 * addressing.block_nbytes]


def test_a_gap_on_either_side_starts_a_new_range() -> None:
    addressing = _addressing(make_caches(num_blocks=16, layers=1))
    # blocks 3,4 | 9 (gap in blocks) | 10 into row 7 (gap in rows)
    runs = addressing.runs([3, 4, 9, 10], [0, 1, 2, 7], row_base=0)
    n = addressing.block_nbytes
    assert runs.nbytes.tolist() == [2 * n, n, n]
    assert runs.remote.tolist() == [0, 2 * n, 7 * n]


def test_split_k_and_v_give_two_pieces_per_layer_that_never_merge() -> None:
    # vLLM's flash-attention layout: (2, num_blocks, block_size, heads, head_dim)
    caches = {f"l{i}": torch.randn(2, 8, 16, 2, 8) for i in range(2)}
    addressing = _addressing(caches, block_dim=1)
    assert len(addressing.pieces) == 4
    half = caches["l0"][0, 0].numel() * 4
    assert [p.row_offset for p in addressing.pieces] == [0, half, 2 * half, 3 * half]
    runs = addressing.runs([2, 3], [0, 1], row_base=0)
    assert len(runs) == 8  # 2 blocks x 2 layers x (K, V)
    assert runs.local.tolist()[:2] == [caches["l0"][0, 2].data_ptr(), caches["l0"][1, 2].data_ptr()]


@pytest.mark.parametrize(
    ("block_dim", "shape"),
    [(0, (12, 2, 16, 2, 8)), (1, (2, 12, 16, 2, 8)), (2, (3, 2, 12, 16, 8))],
    ids=["block-major", "kv-split", "two-outer-dims"],
)
def test_ranges_move_exactly_the_bytes_block_copier_copies(
    block_dim: int, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(1)
    caches = {f"l{i}": torch.randn(shape, generator=gen).half() for i in range(3)}
    layout = KVLayout.from_caches(caches, 16, block_dim=block_dim)
    pool = torch.randint(0, 256, (6, layout.block_nbytes), dtype=torch.uint8, generator=gen)
    blocks, rows = [0, 1, 2, 7, 11, 5], [0, 1, 2, 4, 3, 5]
    expected = {n: t.clone() for n, t in caches.items()}
    BlockCopier(layout, expected).copy_in(blocks, pool, rows)
    addressing = BlockAddressing.of(layout, caches)
    assert addressing is not None
    _read_like_a_transport(addressing, pool, blocks, rows)
    for name, tensor in caches.items():
        assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8))


@pytest.mark.parametrize(
    ("block_dim", "shape"),
    [(0, (12, 2, 16, 2, 8)), (1, (2, 12, 16, 2, 8))],
    ids=["block-major", "kv-split"],
)
def test_a_batchs_ranges_read_in_order_are_its_blocks_serialized(
    block_dim: int, shape: tuple[int, ...]
) -> None:
    """What a socket gather write of ``ranges(blocks)`` sends is ``copy_out`` of those
    blocks, row after row: the stream a tcp consumer scatters back."""
    gen = torch.Generator().manual_seed(2)
    caches = {f"l{i}": torch.randn(shape, generator=gen).half() for i in range(3)}
    layout = KVLayout.from_caches(caches, 16, block_dim=block_dim)
    addressing = BlockAddressing.of(layout, caches)
    assert addressing is not None
    blocks = [4, 5, 6, 0, 11, 3]
    expected = torch.empty((len(blocks), layout.block_nbytes), dtype=torch.uint8)
    BlockCopier(layout, caches).copy_out(blocks, expected)
    table = addressing.ranges(blocks)
    assert table.dtype == np.uint64 and table.shape[1] == 2
    sent = torch.empty(int(table[:, 1].sum()), dtype=torch.uint8)
    at = sent.data_ptr()
    for address, length in table.tolist():
        ctypes.memmove(at, address, length)
        at += length
    assert torch.equal(sent, expected.view(-1))


def test_consecutive_blocks_of_a_single_piece_layout_are_one_range() -> None:
    caches = make_caches(num_blocks=16, layers=1)
    addressing = _addressing(caches)
    n = addressing.block_nbytes
    kv = caches["layer.0"]
    assert addressing.ranges([3, 4, 5, 9]).tolist() == [
        [kv[3].data_ptr(), 3 * n],
        [kv[9].data_ptr(), n],
    ]
    assert addressing.ranges([]).shape == (0, 2)


def test_row_ranges_merge_consecutive_rows_and_keep_their_order() -> None:
    assert row_ranges(1000, [2, 3, 4, 0, 7], 10).tolist() == [[1020, 30], [1000, 10], [1070, 10]]
    assert row_ranges(1000, [], 10).shape == (0, 2)


def _reference_runs(
    addressing: BlockAddressing, blocks: list[int], rows: list[int], row_base: int
) -> list[tuple[int, int, int]]:
    """(local, remote, nbytes) of every piece of every block, neighbours contiguous on
    both sides merged: what ``runs`` must give, from ``pieces`` alone."""
    merged: list[tuple[int, int, int]] = []
    for block, row in zip(blocks, rows, strict=True):
        for piece in addressing.pieces:
            local = addressing.layers[piece.layer].base + piece.offset + block * piece.step
            remote = row_base + row * addressing.block_nbytes + piece.row_offset
            if merged and merged[-1][0] + merged[-1][2] == local:
                last = merged[-1]
                if last[1] + last[2] == remote:
                    merged[-1] = (last[0], last[1], last[2] + piece.nbytes)
                    continue
            merged.append((local, remote, piece.nbytes))
    return merged


@pytest.mark.parametrize("count", [1, 2, SMALL_BATCH - 1, SMALL_BATCH, 40])
@pytest.mark.parametrize("block_dim", [0, 1], ids=["block-major", "kv-split"])
def test_a_few_blocks_and_many_give_the_same_ranges(count: int, block_dim: int) -> None:
    """Below SMALL_BATCH blocks the ranges are walked in Python, above computed with
    numpy: both must be the reference's, runs of consecutive blocks and rows
    included."""
    shape = (64, 2, 16, 2, 8) if block_dim == 0 else (2, 64, 16, 2, 8)
    caches = {f"l{i}": torch.zeros(shape, dtype=torch.float16) for i in range(2)}
    addressing = _addressing(caches, block_dim)
    gen = torch.Generator().manual_seed(count)
    blocks = torch.randperm(64, generator=gen)[:count].tolist()
    blocks[: count // 2] = sorted(blocks[: count // 2])  # some runs of consecutive ids
    rows = list(range(100, 100 + count))
    for ids in (blocks, np.array(blocks, dtype=np.int64)):
        runs = addressing.runs(ids, rows, row_base=1 << 30)
        got = list(
            zip(runs.local.tolist(), runs.remote.tolist(), runs.nbytes.tolist(), strict=True)
        )
        assert got == _reference_runs(addressing, blocks, rows, 1 << 30)
        assert runs.device.tolist() == [0] * len(got)
        assert runs.local.dtype == runs.nbytes.dtype == np.uint64


def test_pieces_follow_layer_order_with_each_layer_at_its_row_offset() -> None:
    caches = make_caches(num_blocks=4, layers=3)
    addressing = _addressing(caches)
    per_layer = caches["layer.0"][0].numel() * 2
    assert [(p.layer, p.row_offset) for p in addressing.pieces] == [
        (0, 0),
        (1, per_layer),
        (2, 2 * per_layer),
    ]
    runs = addressing.runs([1, 2], [0, 1], row_base=0)
    assert len(runs) == 6  # the layers are separate tensors: nothing to merge
    assert runs.device.tolist() == [0] * 6


def test_strided_memory_has_no_addressing() -> None:
    caches = {"l0": torch.randn(8, 4, 16, 4)[:, :, :, :2]}
    layout = KVLayout.from_caches(caches, 16)
    assert BlockAddressing.of(layout, caches) is None


def test_an_empty_transfer_has_no_ranges() -> None:
    addressing = _addressing(make_caches(num_blocks=4))
    assert len(addressing.runs([], [], row_base=0)) == 0


def test_index_runs_split_where_block_or_row_stops_advancing_by_one() -> None:
    blocks, rows = [3, 4, 5, 9, 0, 1], [0, 1, 2, 7, 5, 4]
    assert list(index_runs(blocks, rows)) == [(3, 0, 3), (9, 7, 1), (0, 5, 1), (1, 4, 1)]
    assert list(index_runs(np.array([2, 3, 7]), None)) == [(2, 0, 2), (7, 2, 1)]
    with pytest.raises(ValueError, match="3 block ids but 2 rows"):
        list(index_runs([1, 2, 3], [0, 1]))


def test_row_runs_give_first_row_first_index_and_length() -> None:
    assert row_runs([4, 5, 6, 0, 9, 10], 6) == [(4, 0, 3), (0, 3, 1), (9, 4, 2)]
    assert row_runs(None, 5) == [(0, 0, 5)]
    assert row_runs([], 0) == []


@pytest.mark.parametrize("n", [1, 2, 5, SMALL_BATCH - 1, SMALL_BATCH, 40])
def test_row_runs_split_where_rows_stop_advancing_at_every_batch_size(n: int) -> None:
    rng = np.random.default_rng(n)
    for _ in range(50):
        rows = np.cumsum(rng.integers(1, 3, size=n)).astype(np.int64)
        rng.shuffle(rows[: n // 2])
        as_list = rows.tolist()
        # index_runs over blocks that always advance splits only where the rows stop
        expected = [(row, first, k) for first, row, k in index_runs(list(range(n)), as_list)]
        assert row_runs(as_list, n) == expected
        assert row_runs(rows, n) == expected
        assert all(type(v) is int for run in row_runs(rows, n) for v in run)
