"""Layouts and block copies: the one place that maps blocks to memory."""

from __future__ import annotations

import hashlib
import threading

import pytest
import torch

from kvmux.blocks import BlockCopier
from kvmux.errors import LayoutError
from kvmux.layout import KVLayout

from support import make_caches


def test_block_dim_one_layout_round_trips_like_vllm_kv_caches() -> None:
    # vLLM's flash-attention layout: (2, num_blocks, block_size, heads, head_dim)
    caches = {f"l{i}": torch.randn(2, 10, 16, 2, 8, dtype=torch.bfloat16) for i in range(3)}
    layout = KVLayout.from_caches(caches, block_size=16, block_dim=1)
    copier = BlockCopier(layout, caches)
    rows = copier.gather([7, 2, 3])
    assert rows.shape == (3, layout.block_nbytes)
    expected = caches["l0"][:, 7].contiguous().view(torch.uint8).flatten()
    assert torch.equal(rows[0, : expected.numel()], expected)
    before = {n: t.clone() for n, t in caches.items()}
    copier.copy_in([0, 1, 9], rows)
    for name, t in caches.items():
        for dst, src in ((0, 7), (1, 2), (9, 3)):
            assert torch.equal(t[:, dst], before[name][:, src])
        assert torch.equal(t[:, 4:9], before[name][:, 4:9])


def test_scattered_rows_and_runs_copy_the_right_blocks() -> None:
    caches = make_caches(num_blocks=16)
    layout = KVLayout.from_caches(caches, 16)
    copier = BlockCopier(layout, caches)
    pool = torch.zeros(8, layout.block_nbytes, dtype=torch.uint8)
    blocks, rows = [3, 4, 5, 9, 0, 1], [0, 1, 2, 7, 5, 4]
    copier.copy_out(blocks, pool, rows)
    for b, r in zip(blocks, rows, strict=True):
        assert torch.equal(pool[r], copier.gather([b])[0])


def test_contiguous_block_view_only_for_single_layer_block_major() -> None:
    one = {"l0": torch.randn(4, 2, 16, 2, 8)}
    copier = BlockCopier(KVLayout.from_caches(one, 16), one)
    view = copier.contiguous_block(2)
    assert view is not None and view.data_ptr() == one["l0"][2].data_ptr()
    two = make_caches(num_blocks=4)
    assert BlockCopier(KVLayout.from_caches(two, 16), two).contiguous_block(2) is None


def test_caches_not_matching_layout_are_refused() -> None:
    caches = make_caches(num_blocks=8)
    layout = KVLayout.from_caches(caches, 16)
    wrong_dtype = {n: t.float() for n, t in caches.items()}
    with pytest.raises(LayoutError, match="float32"):
        BlockCopier(layout, wrong_dtype)
    wrong_shape = {n: t[:, :, :8].contiguous() for n, t in caches.items()}
    with pytest.raises(LayoutError, match="layout says"):
        BlockCopier(layout, wrong_shape)
    with pytest.raises(LayoutError, match="do not match"):
        BlockCopier(layout, {"other": caches["layer.0"]})


def test_fingerprint_ignores_block_count_but_not_shape_or_dtype() -> None:
    a = KVLayout.from_caches(make_caches(num_blocks=8), 16)
    b = KVLayout.from_caches(make_caches(num_blocks=64), 16)
    assert a.fingerprint() == b.fingerprint()
    a.check_compatible(b)
    c = KVLayout.from_caches(make_caches(num_blocks=8, dtype=torch.bfloat16), 16)
    with pytest.raises(LayoutError, match="dtype differs"):
        a.check_compatible(c)
    d = KVLayout.from_caches(make_caches(num_blocks=8), 32)
    with pytest.raises(LayoutError, match="block_size differs"):
        a.check_compatible(d)


def test_declared_dims_join_the_fingerprint_and_undeclared_ones_change_nothing() -> None:
    caches = make_caches(num_blocks=8)  # blocks of [2, 16 tokens, 2 heads, 32]
    plain = KVLayout.from_caches(caches, 16)
    declared = KVLayout.from_caches(caches, 16, dims="KTHD")
    assert plain.layers[0].dims is None
    # Undeclared: the fingerprint of before dims existed, so disk stores stay readable.
    before = hashlib.blake2b(b"16", digest_size=16)
    for layer in plain.layers:
        before.update(f"|{layer.name}|{layer.block_shape}|{layer.dtype}".encode())
    assert plain.fingerprint() == before.hexdigest()
    assert declared.fingerprint() != plain.fingerprint()
    with pytest.raises(LayoutError, match="dims differs"):
        declared.check_compatible(plain)
    with pytest.raises(ValueError, match="names 3 dimensions"):
        KVLayout.from_caches(caches, 16, dims="KTH")
    with pytest.raises(ValueError, match="each letter at most once"):
        KVLayout.from_caches(caches, 16, dims="KTHH")


def test_layers_with_different_block_counts_are_invalid() -> None:
    with pytest.raises(ValueError, match="disagree"):
        KVLayout.from_caches({"a": torch.zeros(4, 8, 2), "b": torch.zeros(5, 8, 2)}, 8)


@pytest.mark.parametrize("block_dim", [0, 1])
@pytest.mark.parametrize("rows_kind", ["in-order", "runs", "scattered"])
@pytest.mark.parametrize(
    "tokens_heads_dim",
    [(8, 2, 4), (3, 1, 3)],
    ids=["pieces-of-whole-words", "pieces-of-18-bytes"],
)
def test_fast_host_path_matches_plain_indexing(
    block_dim: int, rows_kind: str, tokens_heads_dim: tuple[int, int, int]
) -> None:
    gen = torch.Generator().manual_seed(block_dim)
    shape = (40, 2, *tokens_heads_dim) if block_dim == 0 else (2, 40, *tokens_heads_dim)
    caches = {f"l{i}": torch.randn(shape, generator=gen).to(torch.bfloat16) for i in range(3)}
    layout = KVLayout.from_caches(caches, tokens_heads_dim[0], block_dim=block_dim)
    copier = BlockCopier(layout, caches)
    blocks = torch.randperm(40, generator=gen)[:20].tolist()
    rows = {
        "in-order": None,
        "runs": list(range(10, 20)) + list(range(0, 10)),
        "scattered": torch.randperm(30, generator=gen)[:20].tolist(),
    }[rows_kind]
    dst = torch.zeros(30, layout.block_nbytes, dtype=torch.uint8)
    copier.copy_out(blocks, dst, rows)

    def expected(block: int) -> torch.Tensor:
        parts = [
            t.select(block_dim, block).contiguous().view(torch.uint8).flatten()
            for t in caches.values()
        ]
        return torch.cat(parts)

    for i, b in enumerate(blocks):
        assert torch.equal(dst[i if rows is None else rows[i]], expected(b))

    before = {n: t.clone() for n, t in caches.items()}
    targets = [b for b in range(40) if b not in blocks][:20]
    copier.copy_in(targets, dst, rows)
    for name, t in caches.items():
        for src, tgt in zip(blocks, targets, strict=True):
            assert torch.equal(t.select(block_dim, tgt), before[name].select(block_dim, src))
        for untouched in set(range(40)) - set(targets):
            assert torch.equal(
                t.select(block_dim, untouched), before[name].select(block_dim, untouched)
            )


@pytest.mark.parametrize("block_dim", [0, 1])
def test_a_batch_split_over_threads_copies_caches_made_in_inference_mode(
    block_dim: int,
) -> None:
    # vLLM allocates its KV caches and runs the connector under torch.inference_mode,
    # a thread-local mode: the copy threads run outside it, so a view made for them
    # in the calling thread (an inference tensor) can no longer be written to.
    # 8 blocks of 1 MiB: big enough for the copy to be split over threads.
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(block_dim)
        shape = (16, 2, 16, 8, 128) if block_dim == 0 else (2, 16, 16, 8, 128)
        caches = {f"l{i}": torch.randn(shape, generator=gen) for i in range(4)}
        layout = KVLayout.from_caches(caches, 16, block_dim=block_dim)
        copier = BlockCopier(layout, caches)
        pool = torch.zeros(12, layout.block_nbytes, dtype=torch.uint8)
        blocks, rows = list(range(3, 11)), list(range(2, 10))
        copier.copy_out(blocks, pool, rows)
        for block, row in zip(blocks, rows, strict=True):
            expected = torch.cat(
                [t.select(block_dim, block).reshape(-1).view(torch.uint8) for t in caches.values()]
            )
            assert torch.equal(pool[row], expected)
        before = {n: t.clone() for n, t in caches.items()}
        copier.copy_in([0, 1, 2, 11, 12, 13, 14, 15], pool, rows)
        for name, t in caches.items():
            for src, dst in zip(blocks, [0, 1, 2, 11, 12, 13, 14, 15], strict=True):
                assert torch.equal(t.select(block_dim, dst), before[name].select(block_dim, src))


@pytest.mark.parametrize("contiguous", [True, False], ids=["host-path", "torch-path"])
def test_caches_made_in_inference_mode_are_copied_by_a_thread_outside_it(
    contiguous: bool,
) -> None:
    # An engine may allocate its caches under torch.inference_mode (inference
    # tensors) while our loads run on lane threads, outside the mode. Strided
    # caches take the torch path, which writes through torch views.
    with torch.inference_mode():
        gen = torch.Generator().manual_seed(3)
        shape = (2, 16, 16, 8 if contiguous else 16, 64)
        made = {f"l{i}": torch.randn(shape, generator=gen) for i in range(2)}
        caches = made if contiguous else {n: t[:, :, :, ::2] for n, t in made.items()}
        layout = KVLayout.from_caches(caches, 16, block_dim=1)
        copier = BlockCopier(layout, caches)
    assert all(t.is_inference() for t in caches.values())
    rows = torch.zeros(8, layout.block_nbytes, dtype=torch.uint8)
    before = {n: t.clone() for n, t in caches.items()}
    errors: list[BaseException] = []

    def copy_both_ways() -> None:
        try:
            copier.copy_out([3, 4, 5, 6, 9], rows)
            copier.copy_in([10, 11, 12, 13, 0], rows)
        except BaseException as exc:  # reported by the main thread's assertion
            errors.append(exc)

    thread = threading.Thread(target=copy_both_ways)
    thread.start()
    thread.join(timeout=30)
    assert not errors, errors
    for name, t in caches.items():
        for src, dst in zip([3, 4, 5, 6, 9], [10, 11, 12, 13, 0], strict=True):
            assert torch.equal(t[:, dst], before[name][:, src])
