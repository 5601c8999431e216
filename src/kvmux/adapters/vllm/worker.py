"""The worker half of the adapter: moves blocks in and out of this worker's KV memory.

Loads are asynchronous: started after the step's forward, polled in
``get_finished``, so a request waiting for remote KV never blocks the engine.
Saves start at the end of the step that computed the blocks; vLLM keeps a
finished request's blocks (delayed free) until every save of it has ended, or,
for a consumer that never comes, until the lease ends and the backend has been
told to release them. A P/D prefill's saved blocks are then published (held by
the backend for the consumer); the scheduler's renew and release notices for
publications are passed to the backend as they come, never waited on.

With a backend that borrows blocks (``save_mode: borrow``) a save copies
nothing and ends only once the backend gives the blocks back; the worker gives
back itself what no consumer will ask for: a finished request's unpublished
keys, and everything of a preempted request (vLLM reuses its blocks at once).

Each tensor-parallel rank has its own WorkerSide, holding its own heads under
its own keys. A load from a prefill of the same TP size reads the prefill rank
of this rank's number; from another TP size, the head slices of every prefill
rank that holds some of this rank's heads (``staging``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvmux.adapters.vllm import live
from kvmux.adapters.vllm.config import AdapterOptions
from kvmux.adapters.vllm.metadata import BlockTransfer, KvmuxMetadata, LeaseNotice
from kvmux.adapters.vllm.save_failures import SaveFailureLog
from kvmux.adapters.vllm.staging import StagedLoads
from kvmux.adapters.vllm.stats import worker_rank, worker_report
from kvmux.compat import Compat, ModelInfo
from kvmux.config import BackendConfig
from kvmux.connector import Address, Connector
from kvmux.errors import LayoutError
from kvmux.handle import Handle, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.registry import create_connector

log = logging.getLogger("kvmux.vllm")


@dataclass
class _Load:
    transfer: BlockTransfer
    handle: Handle


@dataclass
class _Saves:
    handles: list[Handle] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    lease_ends: float | None = None
    released: bool = False
    lease: str | None = None
    """The request's publication, if its blocks were published."""
    published: int = 0
    """How many of ``keys`` the publication holds (those saved before it)."""

    def done(self) -> bool:
        return all(h.poll() for h in self.handles)


class WorkerSide:
    def __init__(
        self,
        backend: BackendConfig,
        options: AdapterOptions,
        *,
        engine_id: str,
        block_size: int,
        num_blocks: int,
        key_suffix: str = "",
        model: ModelInfo | None = None,
    ) -> None:
        self.options = options
        self.engine_id = engine_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.key_suffix = key_suffix
        self.model = model
        """Declared on the registered layout: P2P peers compare it at the handshake."""
        self.connector: Connector = create_connector(backend)
        self._staged: StagedLoads | None = None
        """Loads from a prefill of another TP size (made at ``register``, when heads map)."""
        self._save_failures = SaveFailureLog(backend.backend)
        self._loads: dict[str, _Load] = {}
        self._saves: dict[str, _Saves] = {}
        self._delay_freed: set[str] = set()
        self._finished: set[str] = set()
        self._load_errors: set[int] = set()
        self._reported: dict[str, float] = {}
        self._adapter_counts: dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        views, block_dim, dims = self._described(kv_caches)
        layout = KVLayout.from_caches(views, self.block_size, block_dim, dims, self.model)
        self.connector.register(layout, views)
        tp_size = self.model.tp_size if self.model is not None else 1
        if self.model is not None and layout.layers[0].dims is not None:
            self._staged = StagedLoads(self.connector.config, layout, views, self.model)
        if tp_size == 1:  # the scheduler may ask the only worker directly (``live``)
            live.publish(self.engine_id, self)

    def _described(
        self, kv_caches: Mapping[str, torch.Tensor]
    ) -> tuple[Mapping[str, torch.Tensor], int, str | None]:
        """The KV tensors as kvmux sees them: the block dimension and, for the
        layouts known here, what each block dimension holds (a backend that
        converts to its own format needs it: LMCache's).

        vLLM's CPU backend keeps ``[blocks, heads, block_size, 2 x head_size]``
        and reads it as ``[blocks, heads, 2 x block_size, head_size]``, keys
        first: the same memory viewed as ``[blocks, heads, K/V, tokens, head_size]``.
        Its GPU backends keep ``[K/V, blocks, tokens, heads, head_size]``.
        """
        shape = tuple(next(iter(kv_caches.values())).shape)
        bs, nb = self.block_size, self.num_blocks
        if len(shape) == 4 and shape[0] == nb and shape[2] == bs and shape[3] % 2 == 0:
            heads, head_size = shape[1], shape[3] // 2
            try:
                views = {n: t.view(nb, heads, 2, bs, head_size) for n, t in kv_caches.items()}
            except RuntimeError:  # strides that admit no such view: move bytes only
                return kv_caches, 0, None
            return views, 0, "HKTD"
        if len(shape) == 5 and shape[0] == 2 and shape[1] == nb and shape[2] == bs:
            return kv_caches, 1, "KTHD"
        for dim in (0, 1):
            if dim < len(shape) and shape[dim] == nb:
                return kv_caches, dim, None
        raise LayoutError(f"cannot find the block dimension ({nb} blocks) in KV shape {shape}")

    def address(self) -> dict[str, Any] | None:
        return self.connector.address()

    # ---------------------------------------------------------------- per step

    def start_loads(self, meta: KvmuxMetadata) -> None:
        for transfer in meta.loads:
            self._loads[transfer.req_id] = _Load(transfer, self._start_load(transfer))
        self._notify(meta.renew, "renew", "lease_renewals_sent")
        self._notify(meta.unpublish, "unpublish", "lease_releases_sent")

    def _start_load(self, transfer: BlockTransfer) -> Handle:
        """From the prefill rank of this rank's number, or, for a prefill of another TP
        size, the head slices of every prefill rank holding some of this rank's heads."""
        rank = self.model.tp_rank if self.model is not None else 0
        size = self.model.tp_size if self.model is not None else 1
        producer_size = transfer.producer_tp_size or size
        sources = transfer.sources or (transfer.source,)
        if producer_size == size:
            source = sources[rank] if rank < len(sources) else transfer.source
            return self.connector.load(self._keys(transfer.keys), transfer.block_ids, source)
        keys = list(transfer.keys)
        if self._staged is None:
            reason = failed(
                f"the prefill runs TP={producer_size}, this decode TP={size}, and the KV "
                "layout does not say which dimension holds heads"
            )
            return Handle.completed(keys, [reason] * len(keys))
        try:
            return self._staged.load(keys, transfer.block_ids, producer_size, sources)
        except Exception as exc:  # heads that do not map, a staging connector that failed
            reason = failed(f"mapping prefill TP={producer_size} to TP={size}: {exc}")
            return Handle.completed(keys, [reason] * len(keys))

    def _notify(
        self, notices: list[LeaseNotice], method: Literal["renew", "unpublish"], counter: str
    ) -> None:
        """One call per producer rank this rank reads from; the backend sends in the
        background. A backend that refuses is logged: the leases then end at their own
        time."""
        by_source: dict[str, tuple[Address | None, list[str]]] = {}
        for notice in notices:
            where = json.dumps(notice.source, sort_keys=True)
            by_source.setdefault(where, (notice.source, []))[1].append(notice.lease)
        for source, leases in by_source.values():
            connector = self._connector_to(source)
            if connector is None:
                continue
            send: Callable[[Sequence[str], Address | None], None] = getattr(connector, method)
            try:
                send(leases, source)
            except Exception as exc:  # a backend's bug must not end the engine's step
                log.warning(
                    "kvmux: %s of %d publication(s) failed (%s: %s); they end at their lease",
                    counter,
                    len(leases),
                    type(exc).__name__,
                    exc,
                )
                continue
            self._count(counter, len(leases))

    def _connector_to(self, source: Address | None) -> Connector | None:
        """The connector that speaks to the producer rank at ``source``: this rank's own
        for a producer of its TP shard (or one that declares none), the staging one for
        a rank of another TP size it takes heads from; None for a rank it reads nothing
        from (that rank's own consumer rank tells it)."""
        compat = Compat.in_address(source)
        if compat is None or compat.tp_size is None or self.model is None:
            return self.connector
        rank = compat.tp_rank or 0
        if compat.tp_size == self.model.tp_size:
            return self.connector if rank == self.model.tp_rank else None
        if self._staged is None:
            return None
        return self._staged.connector_for(compat.tp_size, rank)

    def wait_for_preempted(self, meta: KvmuxMetadata) -> None:
        """Saves reading a preempted request's blocks must end before vLLM reuses them.
        Lent blocks are given back first: the request is recomputed and saved again."""
        for req_id in meta.preempted:
            saves = self._saves.get(req_id)
            if saves is None:
                continue
            if self._borrows:
                if saves.lease is not None:
                    self.connector.unpublish([saves.lease])
                self.connector.release(saves.keys)
            for handle in saves.handles:
                handle.wait(self.connector.config.timeout_s)
            if self._borrows:
                self._saves.pop(req_id, None)

    @property
    def _borrows(self) -> bool:
        return self.connector.capabilities.borrows_blocks

    def start_saves(self, meta: KvmuxMetadata) -> None:
        for transfer in meta.saves:
            keys = self._keys(transfer.keys)
            saves = self._saves.setdefault(transfer.req_id, _Saves())
            handle = self.connector.save(keys, transfer.block_ids)
            self._save_failures.watch(transfer.req_id, handle)
            saves.handles.append(handle)
            saves.keys.extend(keys)
            if transfer.publish:
                self._wait_published(saves)
                if transfer.lease is not None:
                    self._publish(transfer.req_id, saves, transfer.lease)
        now = time.monotonic()
        for req_id in meta.delay_freed:
            self._delay_freed.add(req_id)
            saves = self._saves.setdefault(req_id, _Saves())
            saves.lease_ends = now + self.options.lease_s
            if self._borrows and len(saves.keys) > saves.published:
                # Lent blocks no consumer was given: back to vLLM now.
                self.connector.release(saves.keys[saves.published :])

    def _wait_published(self, saves: _Saves) -> None:
        """vLLM hands the request's params to the decode side right after this step, so
        every save of the request must have ended: a decode may ask for the blocks at once.

        Not for a backend that borrows blocks: its saves end only once a consumer is
        done with them, which no consumer can be before it has the params (their
        outcome is known at once, and a failed one leaves the keys for the consumer
        to miss and recompute).
        """
        if self._borrows:
            return
        for handle in saves.handles:
            handle.wait(self.connector.config.timeout_s)

    def _publish(self, req_id: str, saves: _Saves, lease: str) -> None:
        """Hold every block saved for the request for its consumer (``lease_s``)."""
        saves.lease, saves.published = lease, len(saves.keys)
        try:
            self.connector.publish(saves.keys, lease, self.options.lease_s)
        except Exception as exc:  # the consumer may still find the blocks, or recompute
            log.warning(
                "kvmux: request %s: publishing its blocks failed (%s: %s); newer saves "
                "may evict them before the consumer pulls",
                req_id,
                type(exc).__name__,
                exc,
            )

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose delayed blocks vLLM may free, requests whose loads ended)."""
        self._finished |= finished_req_ids
        for req_id in finished_req_ids & self._loads.keys():
            # Aborted while its load waits its turn: it need not run at all, and vLLM
            # frees the blocks now. A load already moving bytes ends by its deadline.
            self._loads[req_id].handle.cancel()
        recving = {req_id for req_id, load in self._loads.items() if load.handle.poll()}
        for req_id in recving:
            self._finish_load(self._loads.pop(req_id))
        sending = {r for r in self._delay_freed & self._finished if self._release_if_due(r)}
        for req_id in sending:
            self._delay_freed.discard(req_id)
            self._saves.pop(req_id, None)
        for req_id in self._finished - self._delay_freed - self._loads.keys():
            saves = self._saves.get(req_id)
            if saves is None or saves.done():
                self._saves.pop(req_id, None)
                self._finished.discard(req_id)
        return sending, recving

    def _finish_load(self, load: _Load) -> None:
        if load.transfer.req_id in self._finished:
            return  # aborted meanwhile: nothing will read these blocks
        result = load.handle.result()
        bad = [
            block_id
            for block_id, outcome in zip(load.transfer.block_ids, result.outcomes, strict=True)
            if not outcome.ok
        ]
        if bad:
            first = next(o for o in result.outcomes if not o.ok)
            log.warning(
                "kvmux: request %s: %d of %d blocks did not load (%s: %s); vLLM's "
                "kv_load_failure_policy decides what happens next",
                load.transfer.req_id,
                len(bad),
                len(result.outcomes),
                first.status,
                first.reason,
            )
            self._load_errors.update(bad)
            self._count("load_error_blocks", len(bad))

    def _release_if_due(self, req_id: str) -> bool:
        saves = self._saves.get(req_id)
        if saves is None or saves.done():
            return True
        if saves.lease_ends is not None and time.monotonic() >= saves.lease_ends:
            if not saves.released:
                log.warning(
                    "kvmux: request %s: lease of %.0f s ended before its blocks were "
                    "pulled; releasing them",
                    req_id,
                    self.options.lease_s,
                )
                self.connector.release(saves.keys)
                saves.released = True
                self._count("lease_expired_requests")
            return saves.done()
        return False

    def saves_ended(self, req_id: str, scheduled: int) -> bool:
        """Whether all ``scheduled`` save batches of a request have started and ended."""
        saves = self._saves.get(req_id)
        started = len(saves.handles) if saves else 0
        return started == scheduled and (saves is None or saves.done())

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, float]:
        """The backend's counters plus the adapter's own (load errors, expired leases)."""
        own = self.connector.stats()
        staged = self._staged.stats() if self._staged is not None else {}
        for name, value in staged.items():
            own[name] = own.get(name, 0) + value
        return {**own, **self._adapter_counts}

    def stats_delta(self) -> dict[str, Any]:
        """What changed since the last call (``stats.worker_report``): vLLM merges reports."""
        now = self.stats()
        changed = worker_report(now, self._reported, worker_rank())
        self._reported = now
        return changed

    def _count(self, name: str, n: int = 1) -> None:
        self._adapter_counts[name] = self._adapter_counts.get(name, 0) + n

    def _keys(self, keys: tuple[BlockKey, ...]) -> list[BlockKey]:
        """Tensor-parallel ranks hold different heads: each saves under its own keys."""
        if not self.key_suffix:
            return list(keys)
        return [BlockKey(k.digest, k.namespace + self.key_suffix) for k in keys]

    def close(self) -> None:
        for load in self._loads.values():
            load.handle.wait(self.connector.config.timeout_s)
        for saves in self._saves.values() if not self._borrows else ():  # closing returns them
            for handle in saves.handles:
                handle.wait(self.connector.config.timeout_s)
        live.withdraw(self.engine_id, self)
        if self._staged is not None:
            self._staged.close()
        self.connector.close()
