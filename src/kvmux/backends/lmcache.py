"""``lmcache``: LMCache's engine as kvmux storage.

Blocks go through a real ``LMCacheEngine``: its storage manager decides where
they live (its own CPU tier, a local disk, an ``lm://`` server, a Mooncake
Store reached as ``mooncakestore://``), and its memory objects hold them in
LMCache's ``KV_2LTD`` format, converted from the engine's layout by
:mod:`kvmux.backends.lmcache_kv`. A kvmux key becomes one LMCache chunk
whose hash is derived from the key, so any process with the same layout and
namespace finds it, with no token ids and no ``PYTHONHASHSEED``.

LMCache is imported when a connector registers its KV memory, not before:
``import lmcache`` pulls in transformers and vLLM, seconds that ``kvmux list``
and config validation should not pay.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from pydantic import Field, field_validator, model_validator

from kvmux.backend import Address, Backend, Health
from kvmux.blocks import BlockCopier
from kvmux.bounded import Outstanding, bounded_call
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import NotRegisteredError, TransferError, TransferTimeout
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout
from kvmux.net.advertise import host_facing

log = logging.getLogger(__name__)

_SCHEMES = ("lm", "mooncakestore")

_MOONCAKE_DEFAULTS = {
    "mooncake_metadata_server": "P2PHANDSHAKE",
    "mooncake_protocol": "tcp",
    "mooncake_global_segment_size": str(256 * 2**20),
    "mooncake_local_buffer_size": str(64 * 2**20),
}
"""What a ``mooncakestore://`` remote needs besides the master (and the address
this client advertises: loopback with a loopback master, else this machine's
first non-loopback one), sized for a test box; ``extra_config`` overrides any
of them."""


class LmcacheConfig(BackendConfig):
    backend: str = "lmcache"
    local_cpu: bool = Field(True, description="keep blocks in LMCache's own host-memory tier")
    max_local_cpu_gb: float = Field(
        1.0, gt=0, description="LMCache's host memory (its allocator and CPU tier), in GB"
    )
    local_disk: Path | None = Field(
        None, description="directory for LMCache's local disk tier; None for no disk tier"
    )
    max_local_disk_gb: float = Field(4.0, gt=0, description="bound on the disk tier, in GB")
    remote_url: str | None = Field(
        None,
        description="shared remote tier: lm://HOST:PORT (an lmcache_server) or "
        "mooncakestore://HOST:PORT (a mooncake_master)",
    )
    namespace: str = Field(
        "kvmux", pattern=r"^[A-Za-z0-9._-]{1,40}$", description="keeps deployments apart"
    )
    telemetry: bool = Field(
        False, description="let LMCache send its anonymous usage reports (off: nothing leaves)"
    )
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="passed to LMCache's extra_config as is"
    )

    @field_validator("remote_url")
    @classmethod
    def _known_remote(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in _SCHEMES or not parts.hostname or parts.port is None:
            raise ValueError(f"{url!r}: expected lm://HOST:PORT or mooncakestore://HOST:PORT")
        return url

    @model_validator(mode="after")
    def _some_tier(self) -> LmcacheConfig:
        if not (self.local_cpu or self.local_disk or self.remote_url):
            raise ValueError("no tier left: enable local_cpu, or set local_disk or remote_url")
        return self

    def remote_host_port(self) -> tuple[str, int] | None:
        if self.remote_url is None:
            return None
        parts = urlsplit(self.remote_url)
        assert parts.hostname is not None and parts.port is not None  # validated
        return parts.hostname, parts.port


class LmcacheBackend(Backend):
    """Saves through ``LMCacheEngine.store`` and loads from its storage manager.

    A save ends when every key has reached the last tier configured (remote,
    else disk, else CPU), so another process can load it once the handle says
    ok; LMCache's own puts to disk and remote run in the background.
    """

    config_model = LmcacheConfig
    config: LmcacheConfig

    def __init__(self, config: LmcacheConfig) -> None:
        super().__init__(config)
        # Only an lmcache_server outlives this process: LMCache's disk tier forgets
        # its files when the engine closes (their index is in memory), and a
        # Mooncake Store value lives in the memory its writer's client lends.
        remote = config.remote_url or ""
        self.capabilities = Capabilities(persistent=remote.startswith("lm://"))
        reason = self._probe_remote()
        if reason is not None:
            raise TransferError(
                f"LMCache remote {config.remote_url} is unreachable ({reason}): "
                "start the server (lmcache_server / mooncake_master) or fix remote_url"
            )
        if config.local_disk is not None:
            config.local_disk.mkdir(parents=True, exist_ok=True)
        self._instance = f"kvmux-{uuid.uuid4().hex[:12]}"
        self._engine: Any = None
        self._retrieves = Outstanding()
        """Retrieves under way, abandoned ones included: ``close`` destroys the engine
        only once they ended."""

    # ------------------------------------------------------------------ set-up

    def register(self, blocks: BlockCopier) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        from kvmux.backends.lmcache_kv import BlockCopyConnector, lmcache_kv_shape

        layout, caches = blocks.layout, blocks.caches
        kv_shape = lmcache_kv_shape(layout)
        copy = BlockCopyConnector(layout, caches)
        if not self.config.telemetry:
            os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        dtype = caches[layout.layers[0].name].dtype
        metadata = LMCacheMetadata(
            model_name=f"{self.config.namespace}.{layout.fingerprint()[:16]}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=kv_shape,
            chunk_size=layout.block_size,
        )
        engine = LMCacheEngineBuilder.get_or_create(
            self._instance,
            LMCacheEngineConfig.from_dict(self._engine_config(layout)),
            metadata,
            copy,
            lambda *args: None,  # broadcasts serve tensor-parallel ranks: one rank here
            lambda *args: None,
        )
        engine.post_init()
        self._engine = engine

    def _engine_config(self, layout: KVLayout) -> dict[str, Any]:
        cfg = self.config
        out: dict[str, Any] = {
            "chunk_size": layout.block_size,
            "local_cpu": cfg.local_cpu,
            "max_local_cpu_size": cfg.max_local_cpu_gb,
            "save_unfull_chunk": False,
            "blocking_timeout_secs": max(1, math.ceil(cfg.timeout_s)),
            "remote_serde": "naive",
        }
        if cfg.local_disk is not None:
            out["local_disk"] = f"file://{cfg.local_disk.resolve()}/"
            out["max_local_disk_size"] = cfg.max_local_disk_gb
        extra = dict(cfg.extra_config)
        if cfg.remote_url is not None:
            out["remote_url"] = cfg.remote_url
            if cfg.remote_url.startswith("mooncakestore://"):
                host, port = cfg.remote_host_port() or ("", 0)
                # mooncake 0.3.13 ignores LMCache's master_server_address key
                # ("Failed to create client", then a crash); this one it reads.
                extra = {
                    **_MOONCAKE_DEFAULTS,
                    "mooncake_local_hostname": host_facing(host),
                    "mooncake_master_server_addr": f"{host}:{port}",
                    "transfer_timeout": max(1, math.ceil(cfg.timeout_s)),
                    **extra,
                }
        if extra:
            out["extra_config"] = extra
        return out

    # ------------------------------------------------------------------ keys

    def _lmc_keys(self, keys: list[BlockKey]) -> list[Any]:
        """LMCache keys, chunk ``i`` covering tokens ``[i * bs, (i + 1) * bs)``.

        The chunk hash is 128 bits of the kvmux key (namespace included): LMCache
        writes it in hex into its key strings, which allow any width.
        """
        engine = self._live_engine()
        bs = self.copier.layout.block_size
        hashes = [_chunk_hash(key) for key in keys]
        return [
            key
            for _, _, key in engine.token_database.process_tokens(
                hashes=hashes, offsets=[bs] * len(keys)
            )
        ]

    def _slot_mapping(self, block_ids: list[int]) -> torch.Tensor:
        bs = self.copier.layout.block_size
        blocks = torch.tensor(block_ids, dtype=torch.long).unsqueeze(1)
        return (blocks * bs + torch.arange(bs, dtype=torch.long)).reshape(-1)

    def _live_engine(self) -> Any:
        if self._engine is None:
            raise NotRegisteredError("lmcache: call register() with the KV tensors first")
        return self._engine

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        """0 before ``register``: LMCache's keys and engine need the layout. A vLLM
        scheduler reaches the registered connector of its worker instead."""
        engine = self._engine
        if engine is None:
            return 0
        bs = self.copier.layout.block_size
        tokens = engine.lookup(hashes=[_chunk_hash(k) for k in keys], offsets=[bs] * len(keys))
        return int(tokens) // bs

    # ------------------------------------------------------------------ save

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        engine = self._live_engine()
        bs = self.copier.layout.block_size
        engine.store(
            hashes=[_chunk_hash(k) for k in keys],
            offsets=[bs] * len(keys),
            slot_mapping=self._slot_mapping(block_ids).tolist(),
        )
        landed = self._wait_landed(self._lmc_keys(keys), time.monotonic() + self.config.timeout_s)
        return [OK if ok else failed(why) for ok, why in landed]

    def _final_tier(self) -> str:
        if self.config.remote_url is not None:
            return "RemoteBackend"
        if self.config.local_disk is not None:
            return "LocalDiskBackend"
        return "LocalCPUBackend"

    def _wait_landed(self, lmc_keys: list[Any], deadline: float) -> list[tuple[bool, str]]:
        """Whether the final tier holds each key (and why not), polling while
        LMCache is still writing it there, until ``deadline``. A key that no tier
        holds and none is writing was dropped (LMCache stores a prefix when short
        of memory; a put can fail): no use waiting for it. (Some remotes do not
        track their puts; the CPU tier holds the key meanwhile.)"""
        storage = self._live_engine().storage_manager
        name = self._final_tier()
        tier = storage.storage_backends[name]
        landed = [(False, "")] * len(lmc_keys)
        waiting = set(range(len(lmc_keys)))
        pause = 0.001
        while waiting:
            for i in list(waiting):
                # In that order: a put that ends between the two checks is then found.
                key = lmc_keys[i]
                writing = _writing(tier, key) or storage.contains(key) is not None
                if storage.contains(key, search_range=[name]) is not None:
                    landed[i] = (True, "")
                elif not writing:
                    landed[i] = (False, "LMCache dropped it (short of memory, or the put failed)")
                else:
                    continue
                waiting.discard(i)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        for i in waiting:
            landed[i] = (False, f"still being written after {self.config.timeout_s} s")
        return landed

    # ------------------------------------------------------------------ load

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        """Bounded by ``deadline``: LMCache's remote client waits on a cut link far
        longer. Past it every block is failed, since the abandoned retrieve may
        still write into them (:mod:`kvmux.bounded`); the engine recomputes them."""
        lmc_keys = self._lmc_keys(keys)
        try:
            return bounded_call(
                self._retrieves.track(lambda: self._retrieve(lmc_keys, block_ids)),
                deadline - time.monotonic(),
                "LMCache retrieve",
            )
        except TransferTimeout as exc:
            return [failed(str(exc))] * len(keys)

    def _retrieve(self, lmc_keys: list[Any], block_ids: list[int]) -> list[Outcome]:
        """Copy each key LMCache has into its block. LMCache maps keys to tiers by
        prefix, so after a gap the search starts again past the missing key."""
        engine = self._live_engine()
        storage = engine.storage_manager
        bs = self.copier.layout.block_size
        slots = self._slot_mapping(block_ids)
        outcomes: list[Outcome] = [MISSING] * len(lmc_keys)
        pending = [(key, i * bs, (i + 1) * bs) for i, key in enumerate(lmc_keys)]
        while pending:
            found = 0
            for tier, chunks in storage.get_block_mapping(pending).items():
                found += len(chunks)
                objs = storage.batched_get([key for key, _, _ in chunks], location=tier)
                try:
                    got = [(obj, s, e) for obj, (_, s, e) in zip(objs, chunks, strict=True) if obj]
                    engine.gpu_connector.batched_to_gpu(
                        [g[0] for g in got],
                        [g[1] for g in got],
                        [g[2] for g in got],
                        slot_mapping=slots,
                    )
                finally:
                    for obj in objs:
                        if obj is not None:
                            obj.ref_count_down()
                for obj, (_, start, _) in zip(objs, chunks, strict=True):
                    outcomes[start // bs] = (
                        OK if obj is not None else failed(f"LMCache's {tier} lost it while reading")
                    )
            pending = pending[found + 1 :]  # the one after the hits is missing everywhere
        if MISSING in outcomes:
            # LMCache answers "not found" for a remote it cannot reach: say which.
            reason = self._probe_remote()
            if reason is not None:
                down = failed(f"LMCache remote {self.config.remote_url} unreachable: {reason}")
                outcomes = [down if o == MISSING else o for o in outcomes]
        return outcomes

    # ------------------------------------------------------------------ misc

    def release(self, keys: list[BlockKey]) -> None:
        if self._engine is None:
            return
        storage = self._engine.storage_manager
        for key in self._lmc_keys(keys):
            storage.remove(key)

    def _probe_remote(self) -> str | None:
        """Why the remote tier does not answer (None: it does). LMCache itself
        would retry for a long time, or crash, on a server that is not there."""
        target = self.config.remote_host_port()
        if target is None:
            return None
        try:
            socket.create_connection(target, timeout=min(self.config.timeout_s, 2.0)).close()
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def health(self) -> Health:
        if self._engine is not None and not self._engine.is_healthy():
            return Health(False, "LMCache reports itself unhealthy")
        reason = self._probe_remote()
        if reason is not None:
            return Health(False, f"LMCache remote {self.config.remote_url}: {reason}")
        return Health(True)

    def close(self) -> None:
        if self._engine is not None:
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            self._engine = None  # no new retrieve starts (``_live_engine`` refuses)
            # A retrieve abandoned at its deadline may still be copying out of the
            # engine's memory objects: destroying the engine under it frees them.
            if not self._retrieves.wait_idle(self.config.timeout_s):
                log.warning(
                    "kvmux lmcache: %d retrieve(s) still running %s s after close; "
                    "LMCache's engine %s is left alive rather than freed under them",
                    self._retrieves.running,
                    self.config.timeout_s,
                    self._instance,
                )
                return
            # Bounded: a remote client on a cut link would hold the caller's exit.
            with contextlib.suppress(TransferTimeout):
                bounded_call(
                    lambda: LMCacheEngineBuilder.destroy(self._instance),
                    self.config.timeout_s,
                    "closing LMCache's engine",
                )


def _writing(tier: Any, key: Any) -> bool:
    """Whether an LMCache tier has a put of ``key`` under way (its CPU tier
    writes synchronously and does not track puts)."""
    try:
        return bool(tier.exists_in_put_tasks(key))
    except NotImplementedError:
        return False


def _chunk_hash(key: BlockKey) -> int:
    h = hashlib.blake2b(key.digest, digest_size=16, person=b"kvmux-lmcache")
    h.update(key.namespace.encode())
    return int.from_bytes(h.digest(), "big")
