"""vLLM's real Scheduler and kvmux's adapter, with a fake model runner (no forward pass).

The style of vLLM's ``tests/v1/kv_connector/unit``: every scheduling and
connector decision is vLLM's and kvmux's own; only the model is replaced by a
function that writes, for each computed token, KV values determined by the
token id, its position and the KV head. Loaded KV can therefore be checked
exactly, head by head, and a block that was never computed or loaded holds zeros.

With ``tp_size`` above 1 the engine has that many worker-role connectors, each
holding its rank's share of the heads, and their outputs are merged by vLLM's
own ``KVOutputAggregator``, as its executors do.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvmux.adapters.vllm.connector import KvmuxConnector

BLOCK = 16
HEADS, WIDTH = 2, 4
EOS = 1
_ids = itertools.count()


def kv_value(token: int, position: int, head: int = 0) -> float:
    """What the fake model writes for a token at a position in KV head ``head`` (of
    all ranks' heads; exact in float32)."""
    return float(token * 4096 + position) + head / 4


def next_token(token: int, position: int) -> int:
    return 3 + (token * 31 + position * 7) % 200


class FakeEngine:
    """One engine: a real Scheduler and a worker-role KvmuxConnector on small CPU tensors."""

    def __init__(
        self,
        model_dir: Path,
        extra_config: dict[str, Any],
        *,
        role: str = "kv_both",
        policy: str = "recompute",
        num_blocks: int = 64,
        max_batched: int = 64,
        layers: int = 2,
        dtype: str = "float32",
        tp_size: int = 1,
        block_size: int = BLOCK,
    ) -> None:
        load_general_plugins()  # what every vLLM process does: kvmux's entry point registers it
        self.config = VllmConfig(
            model_config=ModelConfig(model=str(model_dir), dtype=dtype, max_model_len=1024),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=max_batched,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
                async_scheduling=False,  # the fake model samples in the step it computes
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="kvmux",
                kv_role=role,
                kv_connector_extra_config=extra_config,
                kv_load_failure_policy=policy,
            ),
        )
        names = [f"layer{i}" for i in range(layers)]
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    names,
                    FullAttentionSpec(
                        block_size=block_size,
                        num_kv_heads=HEADS // tp_size,
                        head_size=WIDTH,
                        dtype=torch.float32,
                    ),
                )
            ],
        )
        self.config.cache_config.num_gpu_blocks = num_blocks
        self.block_size = block_size
        self.tp_size = tp_size
        # vLLM's CPU layout: (blocks, kv heads, block size, 2 * head size), blocks first.
        self.rank_caches: list[dict[str, torch.Tensor]] = []
        self.workers: list[KvmuxConnector] = []
        for rank in range(tp_size):
            shape = (num_blocks, HEADS // tp_size, block_size, 2 * WIDTH)
            self.rank_caches.append({n: torch.zeros(shape) for n in names})
            with mock.patch(
                "kvmux.adapters.vllm.connector._tensor_parallel_rank", return_value=rank
            ):
                worker = KvmuxConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
            worker.register_kv_caches(self.rank_caches[rank])
            self.workers.append(worker)
        self.caches, self.worker = self.rank_caches[0], self.workers[0]
        handshakes = {
            rank: worker.get_handshake_metadata() for rank, worker in enumerate(self.workers)
        }
        self._aggregator = KVOutputAggregator(expected_finished_count=tp_size)
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            log_stats=True,
        )
        connector = self.scheduler.get_kv_connector()
        assert connector is not None
        connector.set_xfer_handshake_metadata(handshakes)  # as EngineCore does at start
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.num_blocks = num_blocks
        self.outputs: dict[str, list[Any]] = {}
        self.kv_errors: list[str] = []
        self.preempted: set[str] = set()
        self.free_at_start = self.free_blocks()

    # ------------------------------------------------------------ requests

    def add(
        self, prompt: list[int], max_tokens: int = 4, params: dict[str, Any] | None = None
    ) -> str:
        req_id = f"r{next(_ids)}"
        sp = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params} if params is not None else None,
        )
        sp.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._hasher,
        )
        self.scheduler.add_request(request)
        return req_id

    def reject(self, params: dict[str, Any]) -> str:
        """What vLLM does for a request its API server refused before the engine saw
        it (``AsyncLLM.notify_kv_transfer_request_rejected``): a one-token request
        carrying the params is added and aborted at once (``EngineCore.add_request``
        with ``abort_immediately``), so the connector's ``request_finished`` runs."""
        req_id = f"r{next(_ids)}"
        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": dict(params)})
        sp.update_from_generation_config({}, EOS)
        request = Request(
            request_id=req_id,
            prompt_token_ids=[0],
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self._hasher,
            abort_immediately=True,
        )
        self.scheduler.add_request(request)
        self.abort(req_id)
        return req_id

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def status(self, req_id: str) -> RequestStatus | None:
        request = self.scheduler.requests.get(req_id)
        return request.status if request is not None else None

    # --------------------------------------------------------------- steps

    def step(self) -> Any:
        out = self.scheduler.schedule()
        self.preempted |= set(out.preempted_req_ids or ())
        meta = out.kv_connector_metadata
        for worker in self.workers:
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
        sampled: list[list[int]] = []
        req_ids = list(out.num_scheduled_tokens)
        for req_id in req_ids:
            sampled.append(self._compute(req_id, out.num_scheduled_tokens[req_id]))
        runner_outs: list[ModelRunnerOutput | None] = []
        for worker in self.workers:
            worker.start_load_kv(None)
            worker.wait_for_save()
            sending, recving = worker.get_finished(out.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=sending,
                finished_recving=recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
            )
            worker.clear_connector_metadata()
            runner_outs.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=sampled,
                    kv_connector_output=kv_out,
                )
            )
        runner_out = self._aggregator.aggregate(runner_outs)
        assert runner_out is not None
        engine_outs = self.scheduler.update_from_output(out, runner_out)
        for outs in engine_outs.values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
        return out

    def _compute(self, req_id: str, count: int) -> list[int]:
        request = self.scheduler.requests[req_id]
        tokens = request.all_token_ids
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
        start = request.num_computed_tokens - count  # schedule() already advanced it
        self._check_kv(req_id, tokens, block_ids, start)
        bs, local = self.block_size, HEADS // self.tp_size
        for pos in range(start, start + count):
            block, offset = block_ids[pos // bs], pos % bs
            for rank, caches in enumerate(self.rank_caches):
                for cache in caches.values():
                    for h in range(local):
                        cache[block, h, offset, :] = kv_value(tokens[pos], pos, rank * local + h)
        end = start + count
        if end < request.num_tokens:
            return []  # a chunk of a longer prefill samples nothing
        return [next_token(tokens[end - 1], end - 1)]

    def _check_kv(self, req_id: str, tokens: Any, block_ids: list[int], upto: int) -> None:
        """The fake model *reads* its KV: every position before ``upto`` must hold what
        computing that token there writes, whether computed here or loaded by kvmux,
        in every head of every rank."""
        bs, local = self.block_size, HEADS // self.tp_size
        for index in range(-(-upto // bs)):
            n = min(bs, upto - index * bs)
            for rank, caches in enumerate(self.rank_caches):
                for h in range(local):
                    want = expected_block(list(tokens), index, rank * local + h, bs)[:n]
                    for name, cache in caches.items():
                        got = cache[block_ids[index], h, :n, :]
                        if not torch.equal(got, want[:, None].expand_as(got)):
                            self.kv_errors.append(
                                f"{req_id} block {index} ({name}, rank {rank} head {h}) "
                                "holds wrong KV"
                            )
                            return

    def run(self, timeout_s: float = 20.0, until: Iterable[str] | None = None) -> None:
        """Step until every request is done and every delayed block is freed (or ``until``'s
        requests finished); idle steps sleep a little, as an engine polling transfers would."""
        wanted = set(until or ())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if wanted:
                if all(self.finished(r) for r in wanted):
                    return
            elif not self.scheduler.has_requests():
                return
            if not self.step().num_scheduled_tokens:
                time.sleep(0.002)
        raise AssertionError(f"engine still busy after {timeout_s} s")

    def finished(self, req_id: str) -> bool:
        return any(o.finished for o in self.outputs.get(req_id, []))

    def result(self, req_id: str) -> Any:
        return next(o for o in self.outputs[req_id] if o.finished)

    def tokens(self, req_id: str) -> list[int]:
        return [t for o in self.outputs.get(req_id, []) for t in o.new_token_ids]

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def block_values(
        self, block_id: int, layer: str = "layer0", rank: int = 0, head: int = 0
    ) -> torch.Tensor:
        """One (local) head's first value per token of a block, on one rank."""
        return self.rank_caches[rank][layer][block_id, head, :, 0]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


def expected_block(
    tokens: list[int], index: int, head: int = 0, block_size: int = BLOCK
) -> torch.Tensor:
    """The KV a block must hold in KV head ``head`` once computed (or loaded) for ``tokens``."""
    chunk = tokens[index * block_size : (index + 1) * block_size]
    return torch.tensor([kv_value(t, index * block_size + i, head) for i, t in enumerate(chunk)])


@contextlib.contextmanager
def producer_and_consumer(
    model_dir: Path, extra_config: dict[str, Any]
) -> Iterator[tuple[FakeEngine, FakeEngine]]:
    """A ``kv_producer`` and a ``kv_consumer`` engine on one backend config; both closed after."""
    made: list[FakeEngine] = []
    try:
        made.append(FakeEngine(model_dir, extra_config, role="kv_producer"))
        made.append(FakeEngine(model_dir, extra_config, role="kv_consumer"))
        yield made[0], made[1]
    finally:
        for engine in made:
            engine.close()
