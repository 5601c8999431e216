"""The scheduler half of the adapter: decides which blocks move, never moves any.

It keys every request's blocks (``keys.py``), answers vLLM's "how many tokens
can you load?" (from the request's ``kv_transfer_params`` for P/D, from a
lookup for reuse), and each step tells the worker which blocks to load and
which newly computed blocks to save (``metadata.py``).

It also keeps P/D publications (:mod:`kvmux.publications`) honest at both
ends. A prefill publishes a request's blocks under a fresh lease whose id
travels in the params (and releases it itself if the request was aborted, so
the params go nowhere). A decode that accepts params (``new_request``)
renews that lease while the request waits and releases it once nothing will
load it any more: its load ended, the params were refused, or the request
finished first (aborted, or rejected before it reached the engine: vLLM's
``notify_kv_transfer_request_rejected`` submits it pre-aborted so that
``request_finished`` runs). Notices go to the worker, which owns the
connector, in the next step's metadata.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvmux.adapters.vllm import live
from kvmux.adapters.vllm.config import AdapterOptions
from kvmux.adapters.vllm.keys import RequestKeys, request_namespace
from kvmux.adapters.vllm.metadata import BlockTransfer, KvmuxMetadata, LeaseNotice
from kvmux.adapters.vllm.params import Published, TransferParams, published_mismatch
from kvmux.adapters.vllm.tensor_parallel import mapping_note
from kvmux.config import BackendConfig
from kvmux.connector import Connector
from kvmux.keys import BlockKey
from kvmux.publications import new_lease_id
from kvmux.registry import create_connector

log = logging.getLogger("kvmux.vllm")


@dataclass
class _Tracked:
    request: Any
    keys: RequestKeys
    publish: bool = False
    """The request asked for remote decode: publish its whole prompt when it finishes."""
    local_hit: int = 0
    """Leading full blocks vLLM found in its own prefix cache (this request did not save them)."""
    saved: int = 0
    """Full blocks, from the start, that are saved or were loaded through kvmux."""
    saves_planned: int = 0
    """Save batches sent to the worker so far."""
    published: bool = False
    loading: bool = False
    load_blocks: frozenset[int] = frozenset()
    load_failed: bool = False
    """A load of this request lost blocks: vLLM recomputes them; asking again would loop."""
    remote: tuple[Published, list[BlockKey], int] | None = None
    """The publication to load, this request's keys, the producer's TP size."""
    lease: str | None = None
    """The publication its prompt's blocks are held under (a P/D prefill)."""


@dataclass
class _Awaited:
    """A publication a decode request was given: renewed until it is released."""

    notices: list[LeaseNotice]
    """One per producer rank: each holds its own heads' blocks under the lease."""
    renew_every: float
    renew_at: float
    released: bool = False


RENEWALS_PER_LEASE = 3
"""A waiting consumer renews a publication this many times per lease: two renewals
may be lost or late before the producer lets go."""

PARAMS_DELIVERED = frozenset({"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED"})
"""Request statuses whose output carries the params to a consumer; any other end
(aborted, error) means no consumer will come for the published blocks."""


class SchedulerSide:
    def __init__(
        self,
        backend: BackendConfig,
        options: AdapterOptions,
        *,
        engine_id: str,
        namespace: str,
        block_size: int,
        can_load: bool,
        can_save: bool,
        tp_size: int = 1,
        kv_heads: int | None = None,
    ) -> None:
        self.backend = backend
        self.tp_size = tp_size
        self.kv_heads = kv_heads
        """The model's KV heads (all ranks'): whether another TP size's KV can be mapped."""
        self._mappings_logged: set[int] = set()
        self.options = options
        self.engine_id = engine_id
        self.namespace = namespace
        self.block_size = block_size
        self.can_load = can_load
        self.can_save = can_save
        self._tracked: dict[str, _Tracked] = {}
        self._awaited: dict[str, _Awaited] = {}
        self._next = KvmuxMetadata()
        self._kv_cache_manager: Any = None
        self._address: dict[str, Any] | None = None
        self._addresses: list[dict[str, Any] | None] = []
        self._own: Connector | None = None

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def set_worker_addresses(self, addresses: list[dict[str, Any] | None]) -> None:
        """Every worker's ``address()``, by TP rank (from vLLM's handshake metadata)."""
        self._addresses = list(addresses)
        self._address = self._addresses[0] if self._addresses else None

    # ------------------------------------------------------------ publications

    def new_request(self, request: Any) -> None:
        """A request arrived (vLLM's ``on_new_request``): a decode that was handed a
        publication starts renewing it now, however long the request then waits."""
        if self.can_load and request.request_id not in self._awaited:
            awaited = self._publication(request)
            if awaited is not None:
                self._awaited[request.request_id] = awaited

    def _publication(self, request: Any) -> _Awaited | None:
        try:
            params = TransferParams.parse(request.kv_transfer_params)
        except ValueError:
            return None  # matched_tokens says why, once
        published = params.kvmux if params is not None and params.do_remote_prefill else None
        if published is None or published.lease is None:
            return None
        every = (published.lease_s or self.options.lease_s) / RENEWALS_PER_LEASE
        sources = published.sources or [published.source]
        notices = [LeaseNotice(published.lease, source) for source in sources]
        return _Awaited(notices, every, time.monotonic() + every)

    def _release(self, req_id: str) -> None:
        """Nothing will load this request's publication any more: tell the producer."""
        awaited = self._awaited.get(req_id)
        if awaited is not None and not awaited.released:
            awaited.released = True
            self._next.unpublish.extend(awaited.notices)

    def _renewals(self, meta: KvmuxMetadata) -> None:
        now = time.monotonic()
        for awaited in self._awaited.values():
            if not awaited.released and now >= awaited.renew_at:
                meta.renew.extend(awaited.notices)
                awaited.renew_at = now + awaited.renew_every

    def has_pending_notices(self) -> bool:
        """Whether notices wait for the next step's metadata (the engine must step)."""
        return bool(self._next.unpublish or self._next.renew)

    # ------------------------------------------------------------------ loads

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        tracked = self._track(request)
        params = self._params(request)
        tracked.publish = bool(params and params.do_remote_decode and self.can_save)
        tracked.local_hit = num_computed // self.block_size
        tracked.remote = None
        if not self.can_load or tracked.load_failed:
            return 0, False
        if params is not None and params.do_remote_prefill:
            self.new_request(request)  # in case vLLM never called on_new_request
            count, load = self._remote_match(request, tracked, params, num_computed)
            if not load:
                self._release(request.request_id)
            return count, load
        return self._local_match(request, tracked, num_computed)

    def _remote_match(
        self, request: Any, tracked: _Tracked, params: TransferParams, num_computed: int
    ) -> tuple[int, bool]:
        published = params.kvmux
        if published is None:
            log.warning(
                "kvmux: request %s asks for a remote prefill but its kv_transfer_params "
                "carry no kvmux section (sent by another connector?); computing locally",
                request.request_id,
            )
            return 0, False
        if published.num_tokens > request.num_prompt_tokens:
            log.warning(
                "kvmux: request %s: the prefill published %d tokens, more than the "
                "%d-token prompt; computing locally",
                request.request_id,
                published.num_tokens,
                request.num_prompt_tokens,
            )
            return 0, False
        keys = tracked.keys.upto(request.prompt_token_ids, published.num_tokens)
        why = published_mismatch(
            published, tracked.keys.namespace, keys, self._worker_address(), self.block_size
        )
        if why is not None:
            log.warning(
                "kvmux: request %s: the prefill's KV is not this request's (%s); computing locally",
                request.request_id,
                why,
            )
            return 0, False
        why = self._tensor_parallel_mismatch(params.tp_size or 1)
        if why is not None:
            log.warning(
                "kvmux: request %s: the prefill's KV cannot be mapped to this decode (%s); "
                "computing locally",
                request.request_id,
                why,
            )
            return 0, False
        count = published.num_tokens - num_computed
        if count <= 0:
            return 0, False
        tracked.remote = (published, keys, params.tp_size or 1)
        return count, True

    def _tensor_parallel_mismatch(self, producer_size: int) -> str | None:
        """Why a prefill of ``producer_size`` TP ranks cannot fill this engine's heads
        (None: it can; a new mapping is logged once, naming which heads go where)."""
        if producer_size == self.tp_size:
            return None
        if self.kv_heads is None:
            return (
                f"tp_size differs: the prefill's is {producer_size}, this decode's "
                f"{self.tp_size}, and the model's KV head count is unknown here"
            )
        try:
            note = mapping_note(self.kv_heads, producer_size, self.tp_size)
        except ValueError as exc:
            return f"tp_size differs and heads cannot be sliced: {exc}"
        if producer_size not in self._mappings_logged:
            self._mappings_logged.add(producer_size)
            log.info("kvmux: mapping KV heads between TP sizes: %s", note)
        return None

    def _local_match(self, request: Any, tracked: _Tracked, num_computed: int) -> tuple[int, bool]:
        first = num_computed // self.block_size
        num_full = request.num_tokens // self.block_size
        if num_full <= first:
            return 0, False
        keys = tracked.keys.full(request.all_token_ids, num_full)[first:]
        hits = self._lookup(keys)
        return (hits * self.block_size, True) if hits else (0, False)

    def _lookup(self, keys: list[BlockKey]) -> int:
        worker = live.find(self.engine_id)
        source: dict[str, Any] | None = None
        if worker is not None:
            connector = worker.connector
        else:
            connector = self._own_connector()
            if connector.capabilities.p2p:  # ask the worker's own server
                source = self._address
        try:
            return connector.lookup(keys, source)
        except Exception as exc:  # a sick backend means a miss, not a dead scheduler
            log.warning(
                "kvmux: lookup failed (%s: %s); treating as a miss", type(exc).__name__, exc
            )
            return 0

    def _own_connector(self) -> Connector:
        """For workers in other processes: a connector of the same config, for lookups only.

        It sees stores every process can see (``disk``, remote stores) and asks
        a P2P backend's worker through its address; a process-local store
        (``cpu``) is invisible from here, which is said once in the log.
        """
        if self._own is None:
            self._own = create_connector(self.backend)
            caps = self._own.capabilities
            if not (caps.p2p or caps.persistent):
                log.warning(
                    "kvmux: vLLM runs the worker in another process, where backend %r keeps "
                    "its blocks out of the scheduler's sight: prefix reuse finds nothing. "
                    "Start vLLM with --distributed-executor-backend uni (one process per "
                    "engine) or use a shared backend (disk, tcp, shm)",
                    self.backend.backend,
                )
        return self._own

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        if num_external <= 0:
            return
        tracked = self._track(request)
        bs = self.block_size
        local_tokens = tracked.local_hit * bs
        first, last = tracked.local_hit, -(-(local_tokens + num_external) // bs)
        block_ids = blocks.get_block_ids()[0][first:last]
        transfer = BlockTransfer(request.request_id, (), tuple(block_ids))
        if tracked.remote is not None:
            published, all_keys, producer_size = tracked.remote
            transfer = dataclasses.replace(
                transfer,
                keys=tuple(all_keys[first:last]),
                source=published.source,
                sources=tuple(published.sources) if published.sources else None,
                producer_tp_size=producer_size if producer_size != self.tp_size else None,
            )
        else:
            keys = tracked.keys.full(request.all_token_ids, last)[first:last]
            transfer = dataclasses.replace(transfer, keys=tuple(keys))
        self._next.loads.append(transfer)
        tracked.saved = (local_tokens + num_external) // bs
        tracked.loading = True
        tracked.load_blocks = frozenset(block_ids)

    def loads_finished(self, req_ids: set[str] | None, invalid_block_ids: set[int]) -> None:
        for req_id in req_ids or ():
            self._release(req_id)  # loaded or failed: the producer's copy is not needed
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.loading = False
                if tracked.load_blocks & invalid_block_ids:
                    tracked.load_failed = True
                    tracked.saved = 0  # what vLLM recomputes is saved again

    # ------------------------------------------------------------------ saves

    def build_metadata(self, scheduler_output: Any) -> KvmuxMetadata:
        meta, self._next = self._next, KvmuxMetadata()
        meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        if self.backend.borrows_blocks:  # the worker gives their lent blocks back
            for req_id in meta.preempted:
                if (tracked := self._tracked.get(req_id)) is not None:
                    tracked.saved, tracked.published = 0, False
        if self.can_save:
            spec = scheduler_output.scheduled_spec_decode_tokens or {}
            for req_id, count in scheduler_output.num_scheduled_tokens.items():
                tracked = self._tracked.get(req_id)
                if tracked is not None:
                    computed = (
                        tracked.request.num_computed_tokens + count - len(spec.get(req_id, ()))
                    )
                    self._plan_saves(tracked, computed, meta)
        self._renewals(meta)
        return meta

    def _plan_saves(self, tracked: _Tracked, computed: int, meta: KvmuxMetadata) -> None:
        """Save the blocks this step fills; for a P/D prefill also its prefix-cache hits and
        partial last block, in the step that ends the prefill, so the whole prompt is
        published before vLLM returns the request's ``kv_transfer_params``."""
        request = tracked.request
        limit = request.num_tokens if self.options.save_generated else request.num_prompt_tokens
        full = min(computed, limit) // self.block_size
        start = max(tracked.saved, tracked.local_hit)
        todo: list[tuple[int, BlockKey]] = []
        publish = False
        if full > start:
            keys = tracked.keys.full(request.all_token_ids, full)
            todo = [(i, keys[i]) for i in range(start, full)]
            tracked.saved = full
        if tracked.publish and not tracked.published and computed >= request.num_prompt_tokens:
            n = request.num_prompt_tokens
            prompt = tracked.keys.upto(request.prompt_token_ids, n)
            todo += [(i, prompt[i]) for i in range(tracked.local_hit)]
            if n % self.block_size:
                todo.append((len(prompt) - 1, prompt[-1]))  # the partial last block
            tracked.published = publish = True
            tracked.lease = new_lease_id()
        if not todo:
            return
        block_ids = self._kv_cache_manager.get_block_ids(request.request_id)[0]
        meta.saves.append(
            BlockTransfer(
                request.request_id,
                tuple(key for _, key in todo),
                tuple(block_ids[i] for i, _ in todo),
                publish=publish,
                lease=tracked.lease if publish else None,
            )
        )
        tracked.saves_planned += 1

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if req_id not in self._awaited:  # a request vLLM finished before it arrived
            self.new_request(request)
        self._release(req_id)
        self._awaited.pop(req_id, None)
        tracked = self._tracked.pop(req_id, None)
        if tracked is None or tracked.loading:
            # vLLM itself keeps the blocks of a request whose load is in flight.
            return False, None
        params = None
        if tracked.published and tracked.lease is not None:
            if getattr(request.status, "name", None) in PARAMS_DELIVERED:
                params = self._params_for_decode(tracked, block_ids)
            else:  # aborted: no consumer will ever be given the params
                self._next.unpublish.append(LeaseNotice(tracked.lease, None))
        delay = not self._saves_ended(request.request_id, tracked)
        if delay:
            self._next.delay_freed.append(request.request_id)
        return delay, params

    def _saves_ended(self, req_id: str, tracked: _Tracked) -> bool:
        if not tracked.saves_planned:
            return True
        worker = live.find(self.engine_id)
        return worker is not None and worker.saves_ended(req_id, tracked.saves_planned)

    def _params_for_decode(self, tracked: _Tracked, block_ids: list[int]) -> dict[str, Any]:
        """The ``kv_transfer_params`` a proxy passes to the decode instance."""
        request = tracked.request
        n = request.num_prompt_tokens
        keys = tracked.keys.upto(request.prompt_token_ids, n)
        address = self._worker_address()
        host = address.get("host") if address else None
        port = address.get("port") if address else None
        params = TransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_host=host if isinstance(host, str) else None,
            remote_port=port if isinstance(port, int) else None,
            remote_block_ids=list(block_ids[: -(-n // self.block_size)]),
            remote_request_id=request.request_id,
            remote_num_tokens=n,
            tp_size=self.tp_size,
            kvmux=Published(
                backend=self.backend.backend,
                source=address,
                sources=self._rank_addresses(),
                namespace=tracked.keys.namespace,
                block_size=self.block_size,
                num_tokens=n,
                last_key=keys[-1].id,
                lease=tracked.lease,
                lease_s=self.options.lease_s,
            ),
            prompt_token_ids=list(request.prompt_token_ids),
        )
        return params.model_dump(mode="json")

    # ---------------------------------------------------------------- helpers

    def _worker_address(self) -> dict[str, Any] | None:
        """This engine's worker's ``address()``: from its handshake, or from the worker
        itself when it runs in this process."""
        if self._address is None and (worker := live.find(self.engine_id)) is not None:
            return worker.address()
        return self._address

    def _rank_addresses(self) -> list[dict[str, Any] | None] | None:
        """Every TP rank's address, for a decode to reach each rank's heads (None for
        one rank, or a shared store: no addresses)."""
        if len(self._addresses) > 1 and any(a is not None for a in self._addresses):
            return list(self._addresses)
        return None

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            namespace = request_namespace(self.namespace, request)
            tracked = _Tracked(request, RequestKeys(namespace, self.block_size))
            self._tracked[request.request_id] = tracked
        return tracked

    @staticmethod
    def _params(request: Any) -> TransferParams | None:
        try:
            return TransferParams.parse(request.kv_transfer_params)
        except ValueError as exc:
            log.warning("kvmux: request %s: %s; ignoring them", request.request_id, exc)
            return None

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
