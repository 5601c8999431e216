"""``mooncake-store``: Mooncake Store as a LookupBuffer (and, through
:class:`~kvmux.bridges.BufferBackend`, as a Connector: ``buffers:mooncake-store``).

Mooncake Store is a distributed key-value store for KV cache: a master
(``mooncake_master``) keeps the index; every client contributes a *global
segment* of its own memory where the values it writes live, and reads them
with the Transfer Engine. So the store is shared by every instance that names
the same master, with no peer address to pass around; but a value lives in its
writer's segment and disappears with the writer (the store is not persistent).

Why a LookupBuffer and not a Connector: the store already speaks keys and
whole values; the bridge adds the layout header and per-key outcomes.

Failure behaviour: creation probes the master over TCP first and fails at once
with a clear error, instead of TE's twenty reconnect attempts (about 90 s);
``health()`` asks the master (``batch_is_exist`` answers an error code when it
is gone, while the client's own ``health_check`` still says 0). One client per
process and connection settings is shared and kept until exit (closing one
stalls every Python thread ~2 s), so ``close`` only ends this buffer's use of
it. TE listens on ``0.0.0.0``.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field

from kvmux.backend import Health
from kvmux.bounded import bounded_call
from kvmux.buffer import LookupBuffer
from kvmux.config import BackendConfig
from kvmux.errors import ClosedError, TransferError
from kvmux.keys import BlockKey
from kvmux.net.advertise import host_facing
from kvmux.net.memory import byte_view
from kvmux.net.mooncake_engine import QUEUE_ENV, keep_past_exit

log = logging.getLogger(__name__)

_MISSING = -704
"""Mooncake's OBJECT_NOT_FOUND."""


class MooncakeStoreConfig(BackendConfig):
    backend: str = "buffers:mooncake-store"
    master_address: str = Field(
        "127.0.0.1:50051", pattern=r"^[^:\s]+:[0-9]{1,5}$", description="mooncake_master host:port"
    )
    local_hostname: str | None = Field(
        None,
        description="address this client's TE advertises (other clients read its values "
        "there); default: 127.0.0.1 with a loopback master (every client on its host), "
        "else this machine's first non-loopback IPv4 address",
    )
    metadata_server: str = Field(
        "P2PHANDSHAKE", description="TE metadata service; P2PHANDSHAKE needs none"
    )
    global_segment_bytes: int = Field(
        256 * 2**20, ge=2**20, description="memory this client lends the store (holds its values)"
    )
    local_buffer_bytes: int = Field(
        64 * 2**20, ge=2**20, description="client-side staging buffer for puts and gets"
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="TE transport")
    device_name: str = Field("", description="RDMA devices for TE; empty for tcp")
    key_prefix: str = Field(
        "kvmux/", description="prepended to every key: keeps deployments sharing a master apart"
    )
    max_queued_per_peer: int = Field(
        8192, ge=1, description="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, set before TE starts"
    )
    poll_interval_s: float = Field(
        0.002, gt=0, le=1, description="how often drop_select checks for a key not yet there"
    )


class MooncakeStoreBuffer(LookupBuffer):
    """A ``MooncakeDistributedStore`` client; keys are ``key_prefix + BlockKey.id``."""

    config_model = MooncakeStoreConfig
    config: MooncakeStoreConfig

    def __init__(self, config: MooncakeStoreConfig) -> None:
        super().__init__(config)

        host, port = config.master_address.rsplit(":", 1)
        self._master = (host, int(port))
        reason = self._probe_master(config.timeout_s)
        if reason is not None:
            raise TransferError(
                f"Mooncake master at {config.master_address} is unreachable ({reason}): "
                "start mooncake_master or fix master_address"
            )
        self._store: Any = _shared_client(config)
        self._placement = _in_own_segment(self._store)
        self._closed = False
        self._close_lock = threading.Lock()

    # ------------------------------------------------------------------ buffer

    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        self._check_open()
        data = tensor.detach().reshape(-1).view(torch.uint8).contiguous()
        rc = int(self._store.upsert(self._name(key), byte_view(data), self._placement))
        if rc != 0:
            raise TransferError(f"Mooncake store put of {key.id} failed (rc={rc})")

    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        self._check_open()
        name = self._name(key)
        deadline = time.monotonic() + timeout
        while True:
            size = int(self._store.get_size(name))
            if size >= 0:
                out = torch.empty(size, dtype=torch.uint8)
                got = int(self._store.get_into(name, out.data_ptr(), size)) if size else 0
                if got == size:
                    # force: our own read lease would otherwise refuse the removal (-706).
                    self._store.remove(name, True)
                    return out
                if got != _MISSING:  # removed between the two calls: wait for it again
                    raise TransferError(f"Mooncake store get of {key.id} failed (rc={got})")
            elif size != _MISSING:
                raise TransferError(f"Mooncake store lookup of {key.id} failed (rc={size})")
            if time.monotonic() >= deadline:
                return None
            time.sleep(self.config.poll_interval_s)

    def contains(self, key: BlockKey) -> bool:
        return self.count_leading([key]) == 1

    def count_leading(self, keys: Sequence[BlockKey]) -> int:
        """One master round trip for the whole prefix. An error code (master gone)
        counts as absent: a lookup then says "not here" and ``health`` says why."""
        self._check_open()
        if not keys:
            return 0
        found: list[int] = self._store.batch_is_exist([self._name(k) for k in keys])
        for i, code in enumerate(found):
            if code != 1:
                if code < 0:
                    log.warning("kvmux mooncake-store: existence check failed (rc=%s)", code)
                return i
        return len(keys)

    def health(self) -> Health:
        """Unhealthy when closed or when the master does not answer."""
        if self._closed:
            return Health(False, "closed")
        code = self._store.batch_is_exist([self.config.key_prefix + "health"])[0]
        if code < 0:
            return Health(False, f"Mooncake master {self.config.master_address} error rc={code}")
        return Health(True)

    def close(self) -> None:
        """Stop using the client. The process's client for this config stays mounted
        (see :func:`_shared_client`), so values written through it stay readable."""
        with self._close_lock:
            self._closed = True

    # --------------------------------------------------------------- internals

    def _name(self, key: BlockKey) -> str:
        return self.config.key_prefix + key.id

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("mooncake-store buffer is closed")

    def _probe_master(self, timeout_s: float) -> str | None:
        try:
            socket.create_connection(self._master, timeout=min(timeout_s, 2.0)).close()
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None


_clients: dict[tuple[Any, ...], Any] = {}
_clients_lock = threading.Lock()


def _shared_client(config: MooncakeStoreConfig) -> Any:
    """The process's store client for ``config``'s connection settings, set up once.

    Shared and kept until exit because closing (or destroying) a client stalls
    every Python thread for about two seconds (ten or more with the master
    gone): Mooncake's close waits for its ping thread while holding the GIL.
    A client is cheap to keep; its global segment is the memory it lends.
    """
    from mooncake.store import MooncakeDistributedStore

    key = (
        local_hostname(config),
        config.metadata_server,
        config.global_segment_bytes,
        config.local_buffer_bytes,
        config.protocol,
        config.device_name,
        config.master_address,
    )
    with _clients_lock:
        client = _clients.get(key)
        if client is not None:
            return client
        os.environ[QUEUE_ENV] = str(config.max_queued_per_peer)
        client = MooncakeDistributedStore()
        rc = bounded_call(
            lambda: int(client.setup(*key)),
            config.timeout_s,
            f"Mooncake store: connecting to the Mooncake master at {config.master_address}",
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake store client setup failed (rc={rc}, master {config.master_address})"
            )
        _clients[key] = client
        return client


def _in_own_segment(client: Any) -> Any:
    """Put options that place a value in its writer's own segment.

    Left to itself the master spreads values over every client's segment (a
    prefill's blocks landed in the decode's segment about half the time, seen
    with ``get_replica_desc``): then a value outlives its writer but dies with
    whichever reader held it, and where a read goes (this host or another) is
    chance. The writer's segment is what it lends memory for."""
    from mooncake.store import ReplicateConfig

    placement = ReplicateConfig()
    placement.preferred_segment = client.get_hostname()
    return placement


def local_hostname(config: MooncakeStoreConfig) -> str:
    """Where other clients reach this one's segment: see ``local_hostname``'s field."""
    return config.local_hostname or host_facing(config.master_address.rsplit(":", 1)[0])


def close_clients(master_address: str | None = None) -> int:
    """Close the process's shared clients (of one master, or all); returns how many.

    Call it before stopping a master this process started: a client whose master
    is gone can only be left behind, and its threads then delay the process's
    exit by 10-30 s. Buffers still open on a closed client fail their calls.
    """
    with _clients_lock:
        chosen = [k for k in _clients if master_address is None or k[-1] == master_address]
        clients = [_clients.pop(k) for k in chosen]
    for client in clients:
        client.close()
    return len(clients)


@atexit.register
def _leave_clients() -> None:
    """Unmount cleanly where the master still answers (so it forgets this process's
    values at once); leave clients whose master is gone, whose close would hang."""
    with _clients_lock:
        clients = list(_clients.items())
        _clients.clear()
    for key, client in clients:
        host, port = str(key[-1]).rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=0.5).close()
        except OSError:
            keep_past_exit(client)
        else:
            client.close()
