"""``KvmuxConnector``: vLLM's ``KVConnectorBase_V1`` over any kvmux backend.

vLLM creates one instance per role: in the scheduler (deciding what moves,
``scheduler.py``) and in each worker (moving it, ``worker.py``). This class
only validates the config and routes each of vLLM's calls to its half.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvmux.adapters.vllm.config import split_extra_config
from kvmux.adapters.vllm.keys import default_namespace, model_info
from kvmux.adapters.vllm.metadata import KvmuxMetadata
from kvmux.adapters.vllm.scheduler import SchedulerSide
from kvmux.adapters.vllm.stats import KvmuxPromMetrics, KvmuxStats
from kvmux.adapters.vllm.tensor_parallel import rank_suffix
from kvmux.adapters.vllm.worker import WorkerSide

log = logging.getLogger("kvmux.vllm")


@dataclass
class KvmuxHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler once its KV memory is registered."""

    address: dict[str, Any] | None


class KvmuxConnector(KVConnectorBase_V1):
    """Selected with ``"kv_connector": "kvmux"``; the backend is ``kv_connector_extra_config``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        backend, options = split_extra_config(transfer.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(
                backend,
                options,
                engine_id=str(transfer.engine_id),
                namespace=options.namespace or default_namespace(vllm_config),
                block_size=block_size,
                can_load=bool(transfer.is_kv_consumer),
                can_save=bool(transfer.is_kv_producer),
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                kv_heads=_kv_heads(vllm_config),
            )
        else:
            self._worker = WorkerSide(
                backend,
                options,
                engine_id=str(transfer.engine_id),
                block_size=block_size,
                num_blocks=kv_cache_config.num_blocks,
                key_suffix=_tensor_parallel_suffix(vllm_config),
                model=model_info(
                    vllm_config, options.namespace, _tensor_parallel_rank(vllm_config)
                ),
            )

    @property
    def scheduler_side(self) -> SchedulerSide:
        assert self._scheduler is not None, "called on a worker-role connector"
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        assert self._worker is not None, "called on a scheduler-role connector"
        return self._worker

    # ----------------------------------------------------------- worker role

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KvmuxHandshake(self.worker_side.address())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, KvmuxMetadata)
        self.worker_side.wait_for_preempted(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmuxMetadata)
        self.worker_side.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing waits per layer."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Blocks are saved whole once the step has computed every layer (``wait_for_save``)."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmuxMetadata)
        self.worker_side.start_saves(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self.worker_side.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:  # vLLM asks the scheduler side too; its counters live in workers
            return None
        data = self._worker.stats_delta()
        return KvmuxStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvmuxStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KvmuxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # -------------------------------------------------------- scheduler role

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Every TP rank's address, by rank: a decode of any TP size reads each rank's heads."""
        addresses = [
            meta.address if isinstance(meta, KvmuxHandshake) else None
            for _, meta in sorted(metadata.items())
        ]
        if addresses:
            self.scheduler_side.set_worker_addresses(addresses)

    def on_new_request(self, request: Any) -> None:
        self.scheduler_side.new_request(request)

    def has_pending_push_work(self) -> bool:
        """Release and renew notices for publications ride the next step's metadata:
        an engine with nothing else to do must still take that step."""
        return self._scheduler is not None and self._scheduler.has_pending_notices()

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler_side.build_metadata(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.loads_finished(
            connector_output.finished_recving, set(connector_output.invalid_block_ids or ())
        )

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)


def _tensor_parallel_suffix(vllm_config: Any) -> str:
    size = vllm_config.parallel_config.tensor_parallel_size
    return rank_suffix(_tensor_parallel_rank(vllm_config), size)


def _kv_heads(vllm_config: Any) -> int | None:
    """All ranks' KV heads together (None when vLLM cannot say: no mapping between TP sizes)."""
    try:
        heads = vllm_config.model_config.get_total_num_kv_heads()
    except Exception:  # a model config without attention heads
        return None
    return heads if isinstance(heads, int) and heads > 0 else None


def _tensor_parallel_rank(vllm_config: Any) -> int:
    if vllm_config.parallel_config.tensor_parallel_size <= 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    rank: int = get_tensor_model_parallel_rank()
    return rank
