"""The cpu pool: a hard capacity bound and least-recently-used eviction."""

from __future__ import annotations

import pytest
import torch

from kvmux.blocks import BlockCopier
from kvmux.errors import CapacityError, InvalidRequestError, LayoutError
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.registry import create_connector

from support import keys, make_caches


def _pool(layout: KVLayout, caches: dict[str, torch.Tensor], blocks: int):
    c = create_connector({"backend": "cpu", "capacity_bytes": blocks * layout.block_nbytes})
    c.register(layout, caches)
    return c


def test_capacity_is_never_exceeded_and_oldest_blocks_go_first(caches, layout) -> None:
    with _pool(layout, caches, 4) as pool:
        ks = keys(10)
        for i in range(10):
            assert pool.save([ks[i]], [i]).result().ok
            assert pool.stats()["blocks_stored"] <= 4
        assert pool.lookup(ks[6:]) == 4
        assert pool.lookup(ks[:6]) == 0
        assert pool.stats()["evictions"] == 6


def test_loading_a_block_protects_it_from_eviction(caches, layout) -> None:
    with _pool(layout, caches, 3) as pool:
        ks = keys(4)
        pool.save(ks[:3], [0, 1, 2]).result()
        assert pool.load([ks[0]], [10]).result().ok  # block 0 becomes most recent
        pool.save([ks[3]], [3]).result()
        assert pool.lookup([ks[0]]) == 1
        assert pool.lookup([ks[1]]) == 0


def test_batch_larger_than_pool_keeps_its_newest_blocks_intact(caches, layout) -> None:
    with _pool(layout, caches, 4) as pool:
        ks = keys(10)
        assert pool.save(ks, list(range(10))).result().ok
        expected = {n: t[6:10].clone() for n, t in caches.items()}
        result = pool.load(ks[6:], [20, 21, 22, 23]).result()
        assert result.ok
        for name, t in caches.items():
            assert torch.equal(t[20:24], expected[name])


def test_pool_smaller_than_one_block_is_refused_at_register(caches, layout) -> None:
    c = create_connector({"backend": "cpu", "capacity_bytes": layout.block_nbytes - 1})
    with pytest.raises(CapacityError, match="holds no block"):
        c.register(layout, caches)


def test_keys_and_block_ids_of_different_lengths_are_refused(caches, layout) -> None:
    with _pool(layout, caches, 4) as pool:
        with pytest.raises(InvalidRequestError, match="3 keys but 2 block ids"):
            pool.save(keys(3), [0, 1])
        with pytest.raises(InvalidRequestError, match="out of range"):
            pool.load(keys(1), [10_000])


def test_a_batch_with_one_key_that_is_not_a_block_key_is_refused(caches, layout) -> None:
    class TaggedKey(BlockKey):  # a subclass is a key, as isinstance says
        __slots__ = ()

    with _pool(layout, caches, 4) as pool:
        batch = keys(3)
        with pytest.raises(InvalidRequestError, match="keys must be BlockKey, got str"):
            pool.save([*batch[:2], "not-a-key"], [0, 1, 2])  # type: ignore[list-item]
        with pytest.raises(InvalidRequestError, match="got tuple"):
            pool.lookup([batch[0], tuple(batch[1])])  # type: ignore[list-item]
        tagged = TaggedKey(b"tagged", batch[0].namespace)
        assert pool.save([*batch, tagged], [0, 1, 2, 3]).result().ok
        assert pool.lookup([*batch, tagged]) == 4


def test_registering_caches_that_differ_from_the_layout_is_refused(layout) -> None:
    other = make_caches(dtype=torch.bfloat16)
    c = create_connector({"backend": "cpu"})
    with pytest.raises(LayoutError, match="bfloat16"):
        c.register(layout, other)


def test_a_save_whose_copy_fails_stores_none_of_its_keys(caches, layout, monkeypatch) -> None:
    # Slots are given to keys before the copy: a copy that raises must take them
    # back, or the pool would serve rows holding part of a copy under those keys.
    def broken_copy(*args, **kwargs):
        raise RuntimeError("copy thread refused the write")

    with _pool(layout, caches, 8) as pool:
        ks = keys(4)
        with monkeypatch.context() as patch:
            patch.setattr(BlockCopier, "copy_out", broken_copy)
            result = pool.save(ks, [0, 1, 2, 3]).result()
        assert not result.ok
        assert all("copy thread refused the write" in (o.reason or "") for _, o in result.not_ok)
        assert len(result.not_ok) == 4
        assert pool.lookup(ks) == 0
        assert pool.stats()["blocks_stored"] == 0
        assert pool.save(ks, [0, 1, 2, 3]).result().ok  # the same keys save cleanly later
        expected = {n: t[0:4].clone() for n, t in caches.items()}
        assert pool.load(ks, [10, 11, 12, 13]).result().ok
        for name, t in caches.items():
            assert torch.equal(t[10:14], expected[name])


def test_release_frees_the_slot(caches, layout) -> None:
    with _pool(layout, caches, 2) as pool:
        ks = keys(2)
        pool.save(ks, [0, 1]).result()
        pool.release([ks[0]])
        assert pool.lookup(ks[:1]) == 0
        assert pool.stats()["blocks_stored"] == 1
