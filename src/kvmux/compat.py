"""What two instances must agree on before one's blocks may fill the other's KV memory.

A block's bytes mean something only to an engine that runs the same model, in
the same dtype, sharded the same way, with KV memory of the same layout.
The layout's fingerprint (:meth:`kvmux.layout.KVLayout.fingerprint`) covers
the memory; :class:`ModelInfo`, which the engine adapter attaches to the
layout it registers, names the model. P2P peers exchange a :class:`Compat`
at their handshake and compare it field by field, so a refusal says *which*
field differs (``dtype differs: ...``) instead of that two hashes do. A field
one side leaves unset (a plain ``register`` without a model) is not compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from kvmux.layout import KVLayout

Name = Annotated[str, Field(min_length=1, max_length=512)]
DtypeName = Annotated[str, Field(min_length=1, max_length=256)]


class ModelInfo(BaseModel):
    """The model whose KV a layout holds, as the engine names it.

    ``name`` is what the operator calls the model (vLLM: the model path, or the
    adapter's ``namespace`` when one is set, since that declares two differently
    named copies to be one model); ``dtype`` is the dtype it computes in;
    ``tp_rank`` of ``tp_size`` is the tensor-parallel shard whose heads the
    memory holds. Connectors exchange blocks only between equal shards; the vLLM
    adapter maps heads between TP sizes above them (a decode rank reads foreign
    shards through connectors that declare those shards).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Name
    dtype: DtypeName
    tp_size: int = Field(1, ge=1)
    tp_rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _rank_in_group(self) -> Self:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is not below tp_size {self.tp_size}")
        return self


ENGINE_FIELDS = ("model", "dtype", "tp_size", "tp_rank")
"""Fields that say whose KV it is; a difference is an IncompatiblePeerError."""
LAYOUT_FIELDS = ("kv_dtype", "block_size")
"""Fields that say how the memory is laid out; a difference is a LayoutError."""


class Compat(BaseModel):
    """One side's compatibility fingerprint, as it crosses the wire at the handshake.

    The fields are compared in declaration order: whose KV it is first (the
    more telling difference when several differ), then its layout. The layout
    fingerprint and the protocol version travel beside it in the handshake.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Name | None = None
    dtype: DtypeName | None = None
    tp_size: Annotated[int, Field(ge=1)] | None = None
    tp_rank: Annotated[int, Field(ge=0)] | None = None
    kv_dtype: DtypeName | None = None
    """The KV tensors' dtypes, comma-separated in layer order, each once."""
    block_size: Annotated[int, Field(ge=1)] | None = None

    @classmethod
    def of(cls, layout: KVLayout | None) -> Compat:
        """What a registered ``layout`` declares (nothing before ``register``)."""
        if layout is None:
            return cls()
        model = layout.model
        return cls(
            model=model.name if model else None,
            dtype=model.dtype if model else None,
            tp_size=model.tp_size if model else None,
            tp_rank=model.tp_rank if model else None,
            kv_dtype=",".join(dict.fromkeys(layer.dtype for layer in layout.layers)),
            block_size=layout.block_size,
        )

    @classmethod
    def in_address(cls, address: Mapping[str, Any] | None) -> Compat | None:
        """The fingerprint a P2P connector put in its ``address()``, if any (an
        address comes from the network: anything malformed counts as absent)."""
        raw = address.get("compat") if isinstance(address, Mapping) else None
        if not isinstance(raw, Mapping):
            return None
        try:
            return cls.model_validate(raw)
        except ValidationError:
            return None


@dataclass(frozen=True)
class Difference:
    """The first field in which a producer's fingerprint differs from a consumer's."""

    field: str
    producer: object
    consumer: object

    @property
    def of_layout(self) -> bool:
        return self.field in LAYOUT_FIELDS

    def __str__(self) -> str:
        return (
            f"{self.field} differs: the producer's is {self.producer!r}, "
            f"the consumer's {self.consumer!r}"
        )


def difference(producer: Compat | None, consumer: Compat | None) -> Difference | None:
    """The first field set on both sides with different values, else None."""
    if producer is None or consumer is None:
        return None
    for name in Compat.model_fields:
        mine, theirs = getattr(producer, name), getattr(consumer, name)
        if mine is not None and theirs is not None and mine != theirs:
            return Difference(name, mine, theirs)
    return None
