"""Loads from a prefill of another tensor-parallel size: whole foreign blocks, then head slices.

A prefill rank's block holds that rank's heads; a decode rank of another TP
size needs some of them, from one or several prefill ranks
(:mod:`kvmux.adapters.vllm.tensor_parallel`). Connectors move whole blocks of
the layout they registered, so for each prefill rank it reads from, the
decode rank keeps a second connector registered over a *staging* buffer laid
out as that rank's KV memory (its head count, declaring its TP shard, so a
P2P handshake compares exactly what it always does). A load goes into
staging blocks; once every part has ended, the wanted heads of each block that
arrived are copied into the engine's blocks, and the staging blocks are free
again. The copy costs one pass over the loaded bytes; the staging buffer has
as many blocks as the engine (allocated untouched: memory is used only where
loads land).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvmux.adapters.vllm.tensor_parallel import HeadSlice, head_slices, rank_suffix
from kvmux.compat import ModelInfo
from kvmux.config import BackendConfig
from kvmux.connector import Address, Connector
from kvmux.errors import LayoutError
from kvmux.handle import OK, Handle, Outcome, TransferResult, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.registry import create_connector
from kvmux.stats import is_level


def heads_dim(layout: KVLayout) -> int:
    """The tensor dimension that indexes KV heads; LayoutError when the layout does not say."""
    layer = layout.layers[0]
    if layer.dims is None or "H" not in layer.dims:
        raise LayoutError(
            "the KV layout does not declare which dimension holds heads: "
            "KV cannot be mapped between tensor-parallel sizes"
        )
    in_block = layer.dims.index("H")
    return in_block + 1 if in_block >= layer.block_dim else in_block


@dataclass
class _Stage:
    """One prefill rank's staging buffer and the connector registered over it."""

    connector: Connector
    caches: dict[str, torch.Tensor]
    free: list[int]


class StagedLoads:
    """Loads into this rank's blocks from prefill ranks of another TP size."""

    def __init__(
        self,
        backend: BackendConfig,
        layout: KVLayout,
        caches: Mapping[str, torch.Tensor],
        model: ModelInfo,
    ) -> None:
        self._backend = backend
        self._layout = layout
        self._caches = dict(caches)
        self._model = model
        self._heads_dim = heads_dim(layout)
        self._block_dim = layout.layers[0].block_dim
        self.total_heads = layout.layers[0].shape[self._heads_dim] * model.tp_size
        self._stages: dict[tuple[int, int], _Stage] = {}
        self._lock = threading.Lock()

    def load(
        self,
        keys: Sequence[BlockKey],
        block_ids: Sequence[int],
        producer_size: int,
        sources: Sequence[Address | None],
    ) -> Handle:
        """Fill ``block_ids`` with this rank's heads of the blocks ``keys`` names, taken
        from each overlapping prefill rank (``sources[rank]``: its address, or None for
        a shared store). Raises ValueError when the heads cannot be mapped, or what
        making a staging connector raised; nothing is left taken then."""
        slices = head_slices(
            self.total_heads, producer_size, self._model.tp_size, self._model.tp_rank
        )
        stages = [self._stage(producer_size, part.producer_rank) for part in slices]
        keys = tuple(keys)
        result: Future[TransferResult] = Future()
        parts: list[tuple[HeadSlice, _Stage, list[int], Handle]] = []
        for part, stage in zip(slices, stages, strict=True):
            staged = self._take(stage, len(block_ids))
            suffix = rank_suffix(part.producer_rank, producer_size)
            rank_keys = [BlockKey(k.digest, k.namespace + suffix) for k in keys]
            source = sources[part.producer_rank] if part.producer_rank < len(sources) else None
            try:
                handle = stage.connector.load(rank_keys, staged, source)
            except Exception as exc:  # a refusal up front fails this part's keys, as a handle would
                reason = failed(f"{type(exc).__name__}: {exc}")
                handle = Handle.completed(rank_keys, [reason] * len(rank_keys))
            parts.append((part, stage, staged, handle))
        remaining = [len(parts)]
        lock = threading.Lock()

        def one_ended(_: TransferResult) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            self._finish(keys, list(block_ids), parts, result)

        for *_, handle in parts:
            handle.add_done_callback(one_ended)
        return _StagedHandle(keys, result, [h for *_, h in parts])

    def _finish(
        self,
        keys: tuple[BlockKey, ...],
        block_ids: list[int],
        parts: list[tuple[HeadSlice, _Stage, list[int], Handle]],
        result: Future[TransferResult],
    ) -> None:
        """Every part ended: copy the heads of each block that arrived from all its
        ranks, then give the staging blocks back. Nothing is copied into a load that
        was cancelled meanwhile (its blocks are vLLM's again)."""
        outcomes: list[Outcome] = [OK] * len(keys)
        nbytes, seconds = 0, 0.0
        try:
            for *_, handle in parts:
                part_result = handle.result()
                nbytes += part_result.nbytes
                seconds = max(seconds, part_result.seconds)
                for i, outcome in enumerate(part_result.outcomes):
                    if outcomes[i].ok and not outcome.ok:
                        outcomes[i] = outcome
            if result.set_running_or_notify_cancel():
                try:
                    self._copy(block_ids, parts, outcomes)
                except Exception as exc:  # a copy that failed leaves those blocks unloaded
                    outcomes = [failed(f"head slice copy: {type(exc).__name__}: {exc}")] * len(keys)
                result.set_result(TransferResult(keys, tuple(outcomes), nbytes, seconds))
        finally:
            for _, stage, staged, _ in parts:
                with self._lock:
                    stage.free.extend(staged)

    def _copy(
        self,
        block_ids: list[int],
        parts: list[tuple[HeadSlice, _Stage, list[int], Handle]],
        outcomes: list[Outcome],
    ) -> None:
        bd, hd = self._block_dim, self._heads_dim - (self._heads_dim > self._block_dim)
        with torch.inference_mode():  # as BlockCopier's copies: caches may be inference tensors
            for part, stage, staged, _ in parts:
                for name, cache in self._caches.items():
                    src = stage.caches[name]
                    for i, block_id in enumerate(block_ids):
                        if outcomes[i].ok:
                            into = cache.select(bd, block_id).narrow(hd, part.dst, part.count)
                            into.copy_(src.select(bd, staged[i]).narrow(hd, part.src, part.count))

    def connector_for(self, producer_size: int, producer_rank: int) -> Connector | None:
        """The staging connector that reads from that prefill rank (for its lease
        notices), or None when this rank takes no heads from it."""
        try:
            slices = head_slices(
                self.total_heads, producer_size, self._model.tp_size, self._model.tp_rank
            )
        except ValueError:
            return None
        if all(s.producer_rank != producer_rank for s in slices):
            return None
        return self._stage(producer_size, producer_rank).connector

    def _stage(self, producer_size: int, producer_rank: int) -> _Stage:
        with self._lock:
            stage = self._stages.get((producer_size, producer_rank))
            if stage is not None:
                return stage
        heads = self.total_heads // producer_size
        caches = {}
        for name, cache in self._caches.items():
            shape = list(cache.shape)
            shape[self._heads_dim] = heads
            caches[name] = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        model = self._model.model_copy(update={"tp_size": producer_size, "tp_rank": producer_rank})
        first = self._layout.layers[0]
        layout = KVLayout.from_caches(
            caches, self._layout.block_size, first.block_dim, first.dims, model
        )
        connector = create_connector(_puller_config(self._backend))
        connector.register(layout, caches)
        stage = _Stage(connector, caches, list(range(layout.num_blocks)))
        with self._lock:
            if (producer_size, producer_rank) in self._stages:  # another thread won
                connector.close()
                return self._stages[(producer_size, producer_rank)]
            self._stages[(producer_size, producer_rank)] = stage
        return stage

    def _take(self, stage: _Stage, count: int) -> list[int]:
        """Staging blocks for one load. There are as many as engine blocks, and no more
        engine blocks than that are ever loading at once, so some are always free."""
        with self._lock:
            assert len(stage.free) >= count, f"{count} staging blocks wanted, {len(stage.free)}"
            taken, stage.free[:] = stage.free[:count], stage.free[count:]
            return taken

    def stats(self) -> dict[str, float]:
        """The staging connectors' counters added up (their loads are this rank's);
        their levels are left out: staging holds nothing between loads."""
        total: dict[str, float] = {}
        for stage in self._stages.values():
            for name, value in stage.connector.stats().items():
                if not is_level(name):
                    total[name] = total.get(name, 0) + value
        return total

    def close(self) -> None:
        for stage in self._stages.values():
            stage.connector.close()
        self._stages.clear()


def _puller_config(config: BackendConfig) -> BackendConfig:
    """A staging connector only pulls: the engine's own connector has the configured
    listening port, so this one takes any free port (0) rather than collide."""
    if getattr(config, "port", 0):
        return config.model_copy(update={"port": 0})
    return config


class _StagedHandle(Handle):
    """A staged load's handle: cancelling it also drops parts not yet started."""

    def __init__(
        self, keys: tuple[BlockKey, ...], future: Future[TransferResult], parts: list[Handle]
    ) -> None:
        super().__init__(keys, future)
        self._parts = parts

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            for part in self._parts:
                part.cancel()
        return cancelled
