"""Which KV heads a tensor-parallel rank holds, and where a consumer rank finds its own.

vLLM shards attention by KV head: with ``tp_size`` ranks and ``H`` KV heads
(``H`` divisible by ``tp_size``), rank ``r`` holds heads
``[r * H / tp_size, (r + 1) * H / tp_size)``, and its blocks carry only those.
Each rank saves under its own keys (``rank_suffix``), so a key names a head
range as well as tokens. A decode rank of another TP size than the prefill
takes, from every prefill rank whose heads overlap its own, the overlapping
slice (:func:`head_slices`). Heads replicated over ranks (``tp_size > H``)
are not mapped: a different TP size is then refused.
"""

from __future__ import annotations

from dataclasses import dataclass


def rank_suffix(rank: int, size: int) -> str:
    """What a rank appends to its keys' namespace: ``""`` for TP=1 (its keys are
    the unsharded model's), else ``/tp{rank}of{size}``."""
    return "" if size <= 1 else f"/tp{rank}of{size}"


@dataclass(frozen=True)
class HeadSlice:
    """``count`` heads from ``producer_rank``'s local head ``src`` on, into this rank's
    local head ``dst`` on."""

    producer_rank: int
    src: int
    dst: int
    count: int


def head_slices(
    total_heads: int, producer_size: int, consumer_size: int, consumer_rank: int
) -> list[HeadSlice]:
    """The slices a consumer rank loads, one per overlapping producer rank, in rank order.

    Raises ValueError when either TP size does not divide the heads (vLLM then
    replicates heads over ranks: no slice mapping)."""
    for name, size in (("prefill", producer_size), ("decode", consumer_size)):
        if size < 1 or total_heads % size:
            raise ValueError(
                f"{total_heads} KV heads are not divisible by the {name}'s TP size {size}"
            )
    if not 0 <= consumer_rank < consumer_size:
        raise ValueError(f"rank {consumer_rank} is not below TP size {consumer_size}")
    per_producer = total_heads // producer_size
    per_consumer = total_heads // consumer_size
    start, stop = consumer_rank * per_consumer, (consumer_rank + 1) * per_consumer
    slices = []
    for rank in range(start // per_producer, -(-stop // per_producer)):
        low, high = max(start, rank * per_producer), min(stop, (rank + 1) * per_producer)
        slices.append(HeadSlice(rank, low - rank * per_producer, low - start, high - low))
    return slices


def mapping_note(total_heads: int, producer_size: int, consumer_size: int) -> str:
    """How a consumer of one TP size reads a producer of another, for the log; raises
    ValueError as :func:`head_slices` when heads cannot be mapped."""
    ranks = [
        f"decode rank {r} <- "
        + ", ".join(
            f"prefill rank {s.producer_rank} heads [{s.src}, {s.src + s.count})"
            for s in head_slices(total_heads, producer_size, consumer_size, r)
        )
        for r in range(consumer_size)
    ]
    return (
        f"prefill TP={producer_size} -> decode TP={consumer_size} over {total_heads} KV heads: "
        + "; ".join(ranks)
    )
