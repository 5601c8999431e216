"""What the scheduler-side connector tells the worker-side one each engine step.

Plain dataclasses: vLLM carries them inside ``SchedulerOutput`` to the workers
(in-process, or through its own serialisation between its processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvmux.keys import BlockKey


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to move: ``keys[i]`` names engine block ``block_ids[i]``."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    source: dict[str, Any] | None = None
    """The producer's address (rank 0's, for a producer of several TP ranks)."""
    sources: tuple[dict[str, Any] | None, ...] | None = None
    """A load: every producer TP rank's address, by rank (None: only ``source`` is known)."""
    producer_tp_size: int | None = None
    """A load: the producer's TP size, when it is not this engine's (heads are mapped)."""
    publish: bool = False
    """The save that completes a P/D prefill: vLLM returns the request's params right
    after this step, so every save of the request must have ended by then."""
    lease: str | None = None
    """With ``publish``: the publication id the request's blocks are held under
    (``Connector.publish``); it travels to the consumer in the params."""


@dataclass(frozen=True)
class LeaseNotice:
    """A publication to renew or release: at the producer ``source`` (a consumer's
    notice), or this instance's own when ``source`` is None."""

    lease: str
    source: dict[str, Any] | None


@dataclass
class KvmuxMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    delay_freed: list[str] = field(default_factory=list)
    """Requests whose blocks vLLM keeps until the worker reports them finished sending."""
    preempted: list[str] = field(default_factory=list)
    """Requests whose blocks vLLM freed at preemption: their saves must end before reuse."""
    renew: list[LeaseNotice] = field(default_factory=list)
    """Publications a waiting request still needs (heartbeats)."""
    unpublish: list[LeaseNotice] = field(default_factory=list)
    """Publications no request needs any more: loaded, failed, aborted or rejected."""
