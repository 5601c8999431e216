"""``kv_transfer_params``: what travels between a prefill and a decode instance.

vLLM's P/D convention (shared by its NixlConnector and the proxies written for
it): the proxy sends the prefill request with ``do_remote_decode: true``; the
prefill instance answers with params that the proxy passes, untouched, to the
decode request, which then finds ``do_remote_prefill: true``. kvmux fills the
standard fields wherever they mean something for it, so routers written for
NixlConnector read them unchanged, and puts what its consumer needs under
``kvmux``. Everything is validated: these params come from the network.

From NixlConnector's set, kvmux leaves out ``remote_blocks_expiry_time`` (a
time on the producer's own monotonic clock, meaningless to anyone else; kvmux
holds blocks for its ``lease_s``), ``transfer_mode`` (it selects
NixlConnector's own code path) and ``dcp_size``/``pp_size`` (kvmux keys
blocks per tensor-parallel rank only; pipeline parallelism is not supported).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmux.compat import Compat, difference
from kvmux.keys import BlockKey


class Published(BaseModel):
    """Where the decode instance finds the prompt's KV, and how to check it is the right KV."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str
    source: dict[str, Any] | None = Field(
        None, description="the producer connector's address(); None for shared stores"
    )
    sources: list[dict[str, Any] | None] | None = Field(
        None,
        max_length=1024,
        description="every producer tensor-parallel rank's address, by rank (each rank "
        "serves its own heads); None for TP=1, where ``source`` is the only one",
    )
    namespace: str
    block_size: int | None = Field(
        None, ge=1, description="the producer's tokens per block: kvmux keys are per block"
    )
    num_tokens: int = Field(ge=1, description="prompt tokens whose KV was published")
    last_key: str = Field(
        description="id of the key of the last published block: the consumer recomputes "
        "its keys from its own tokens and loads only if they end in the same key"
    )
    lease: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{32}$",
        description="the publication holding the blocks at the producer: the consumer "
        "renews it while it waits and releases it when done (Connector.renew/unpublish)",
    )
    lease_s: float | None = Field(
        None, gt=0, description="how long the producer holds them without a renewal"
    )


class TransferParams(BaseModel):
    """The ``kv_transfer_params`` object in requests and responses (vLLM's field names)."""

    model_config = ConfigDict(extra="allow")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list[int] | None = Field(
        None,
        description="the prefill engine's blocks that held the prompt's KV when it finished "
        "(as NixlConnector reports them); kvmux's consumer loads by key and never reads them, "
        "and the prefill engine reuses them once its saves have ended",
    )
    remote_request_id: str | None = Field(None, description="the request's id on the prefill")
    remote_num_tokens: int | None = Field(
        None, ge=0, description="prompt tokens whose KV the prefill published"
    )
    tp_size: int | None = Field(None, ge=1, description="the prefill's tensor-parallel size")
    kvmux: Published | None = None
    prompt_token_ids: list[int] | None = Field(
        None, description="the prompt as the prefill tokenised it; proxies may send it to decode"
    )

    @classmethod
    def parse(cls, raw: Any) -> TransferParams | None:
        """Params of a request, or None when absent; malformed params raise ValueError."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(raw).__name__}")
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ValueError(f"invalid kv_transfer_params: {exc}") from None


def published_key_matches(published: Published, keys: list[BlockKey]) -> bool:
    """Whether the consumer's own last key equals the producer's (same tokens, same model)."""
    return bool(keys) and keys[-1].id == published.last_key


def published_mismatch(
    published: Published,
    namespace: str,
    keys: list[BlockKey],
    own_address: Mapping[str, Any] | None,
    block_size: int | None = None,
) -> str | None:
    """Why the published KV is not this request's (None: it is), for one log line.

    Another model shows as another namespace; when both sides' P2P addresses carry
    their compatibility fingerprints, the field that differs is named instead of
    the two namespace hashes. A different block size is named first: kvmux keys
    chain over blocks of ``block_size`` tokens, so no key of one size names a block
    of another. The tensor-parallel shard is not compared here: the adapter maps
    heads between TP sizes (``tensor_parallel``)."""
    if block_size is not None and published.block_size not in (None, block_size):
        return (
            f"block_size differs: the prefill's is {published.block_size}, this decode's "
            f"{block_size}; kvmux exchanges KV only between equal block sizes"
        )
    if published.namespace == namespace:
        if published_key_matches(published, keys):
            return None
        return "its last block's key is not this prompt's: other tokens"
    diff = difference(
        _unsharded(Compat.in_address(published.source)), _unsharded(Compat.in_address(own_address))
    )
    if diff is not None:
        return f"another model: {diff}"
    return f"another model or request namespace: {published.namespace} vs {namespace}"


def _unsharded(compat: Compat | None) -> Compat | None:
    return compat.model_copy(update={"tp_size": None, "tp_rank": None}) if compat else None
