"""The compatibility fingerprint: what a registered layout declares, compared by field."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from kvmux.compat import Compat, ModelInfo, difference
from kvmux.layout import KVLayout

from support import make_caches


def _layout(dtype: torch.dtype = torch.float16, model: ModelInfo | None = None) -> KVLayout:
    return KVLayout.from_caches(make_caches(4, dtype=dtype), block_size=16, model=model)


def test_a_layout_declares_its_kv_dtype_and_block_size_and_the_model_it_was_given() -> None:
    model = ModelInfo(name="/models/a", dtype="bfloat16", tp_size=2, tp_rank=1)
    assert Compat.of(_layout(model=model)) == Compat(
        model="/models/a",
        dtype="bfloat16",
        tp_size=2,
        tp_rank=1,
        kv_dtype="float16",
        block_size=16,
    )
    assert Compat.of(_layout()).model is None
    assert Compat.of(None) == Compat()


def test_the_model_is_not_part_of_the_layout_fingerprint() -> None:
    """Stores keyed by fingerprint (disk directories) keep their keys."""
    model = ModelInfo(name="/models/a", dtype="float16")
    assert _layout(model=model).fingerprint() == _layout().fingerprint()


def test_differences_are_reported_whose_kv_first_then_its_layout() -> None:
    a = Compat.of(_layout(torch.float16, ModelInfo(name="m", dtype="float16")))
    b = Compat.of(_layout(torch.bfloat16, ModelInfo(name="m", dtype="bfloat16")))
    diff = difference(a, b)
    assert diff is not None and diff.field == "dtype" and not diff.of_layout
    assert str(diff) == "dtype differs: the producer's is 'float16', the consumer's 'bfloat16'"
    layout_only = difference(Compat.of(_layout(torch.float16)), Compat.of(_layout(torch.bfloat16)))
    assert layout_only is not None and layout_only.field == "kv_dtype" and layout_only.of_layout
    assert difference(a, a) is None and difference(a, None) is None


def test_a_fingerprint_is_read_from_an_address_and_garbage_counts_as_none() -> None:
    compat = Compat(model="m", block_size=16)
    address = {"host": "h", "port": 1, "compat": compat.model_dump(exclude_none=True)}
    assert Compat.in_address(address) == compat
    for junk in (None, {}, {"compat": "x"}, {"compat": {"block_size": -1}}, {"compat": {"z": 1}}):
        assert Compat.in_address(junk) is None


def test_a_tensor_parallel_rank_must_lie_inside_its_group() -> None:
    with pytest.raises(ValidationError, match="tp_rank 2 is not below tp_size 2"):
        ModelInfo(name="m", dtype="float16", tp_size=2, tp_rank=2)
