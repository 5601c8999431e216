"""One NIXL agent per connector, with progress made on demand instead of by a spinning thread.

NIXL's Python agent can run a progress thread, but it polls with no delay:
every idle agent burns a whole core (on a 2-core machine two agents halve
everyone's speed). Turned off, someone else must make progress for the side
being read whenever it must answer (UCX's connection wire-up, and any
notification: a READ carrying one is not done until the reader's peer took it
in, which is why kvmux's READs carry none). kvmux knows when that can be: a
producer's slots are read only between a ``locate`` (which pins them) and the
consumer's ``unpin``. So :class:`NixlAgent` runs NIXL with its progress thread
off and its own *pump* thread that progresses the agent (by draining
notifications) only while :meth:`NixlAgent.hold` counts outstanding pins, every
``pump_interval_s``, and once a second otherwise (``on_tick`` runs after each
round: the producer expires leases there). The consumer makes its own progress
by polling its transfer with a short back-off.

Every call into NIXL goes through one lock: the agent is created without
NIXL's own thread synchronisation, and none of these calls blocks for long.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvmux.errors import KvmuxError, TransferError, TransferTimeout

log = logging.getLogger(__name__)

Descs = npt.NDArray[np.uint64]
"""``[N, 3]`` rows of (address, length, device id): a NIXL descriptor list."""

_IDLE_PUMP_S = 1.0
"""Progress cadence with no pin outstanding: drains stray notifications, costs nothing."""
_POLL_MAX_S = 2e-4
"""Longest sleep between two looks at a READ in flight: what a READ may wait past
its completion (a 64 MiB READ takes a few ms; a small one is done at once)."""


def mem_type(device: torch.device) -> str:
    """NIXL's memory type for tensors on ``device``."""
    if device.type == "cpu":
        return "DRAM"
    if device.type == "cuda":
        return "VRAM"
    raise TransferError(f"NIXL cannot register {device.type} memory")


def quiet_nixl_logger() -> None:
    """NIXL's Python logger prints INFO lines to *stdout*, which is others' channel
    (CLI output, a peer process's ready line): send it to stderr, warnings only."""
    import sys

    logger = logging.getLogger("nixl")
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if logger.level in (logging.NOTSET, logging.INFO):
        logger.setLevel(logging.WARNING)


def skip_ucx_ib_without_devices() -> None:
    """No InfiniBand device: keep UCX from loading its ``ib`` module at all.

    The module would load the system's libibverbs and with it the system's
    libnl, beside the copy the nixl wheel bundles; the two copies' destructors
    then crash every process that created a UCX backend, at exit (seen here
    with ``libibverbs1`` installed for Mooncake). Without a device the module
    has nothing to offer, and an explicit ``UCX_MODULES`` is left alone.
    """
    devices = Path("/sys/class/infiniband")
    if not (devices.is_dir() and any(devices.iterdir())):
        os.environ.setdefault("UCX_MODULES", "^ib")


class NixlAgent:
    """A NIXL agent with backends ``backends`` (options per backend), its memory
    registrations, the remote agents it knows, and its pump."""

    def __init__(
        self,
        backends: Sequence[str],
        options: Mapping[str, Mapping[str, str]],
        *,
        pump_interval_s: float,
        on_tick: Callable[[], None] = lambda: None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        quiet_nixl_logger()
        skip_ucx_ib_without_devices()
        self.name = f"kvmux-{os.getpid()}-{secrets.token_hex(8)}"
        conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
        self._lock = threading.RLock()
        self._agent: Any = nixl_agent(self.name, conf)
        available = self._agent.get_plugin_list()
        for backend in backends:
            if backend not in available:
                raise TransferError(f"NIXL plugin {backend!r} is not available ({available})")
            self._agent.create_backend(backend, dict(options.get(backend, {})))
        self._registered: list[Any] = []
        self._remote: set[str] = set()
        self._on_tick = on_tick
        self._pump_interval_s = pump_interval_s
        self._cond = threading.Condition()
        self._holds = 0
        self._closed = False
        self._pump = threading.Thread(target=self._pump_loop, name="kvmux-nixl-pump", daemon=True)
        self._pump.start()

    # ----------------------------------------------------------------- memory

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register whole tensors (contiguous, one device kind) for transfers."""
        with self._lock:
            descs = self._agent.get_reg_descs(list(tensors))
            if descs is None:
                raise TransferError("NIXL refused the tensors (not contiguous, mixed devices?)")
            self._registered.append(self._agent.register_memory(descs))

    def metadata(self) -> bytes:
        """What a peer passes to ``add_remote`` to read this agent's memory."""
        with self._lock:
            data: bytes = self._agent.get_agent_metadata()
        return data

    def add_remote(self, metadata: bytes) -> str:
        with self._lock:
            raw: bytes | str = self._agent.add_remote_agent(metadata)
            name = raw.decode() if isinstance(raw, bytes) else raw
            self._remote.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        with self._lock:
            if name in self._remote:
                self._remote.discard(name)
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(name)

    # --------------------------------------------------------------- transfers

    def read(
        self,
        remote: str,
        local: Descs,
        local_mem: str,
        remote_descs: Descs,
        *,
        deadline: float,
    ) -> None:
        """One READ of every ``remote_descs`` row into the ``local`` row beside it,
        with no notification (one would make the READ wait for the remote agent's
        progress). Returns once done; raises TransferError (NIXL reported an
        error) or TransferTimeout (not done by ``deadline``: the request is
        cancelled)."""
        handle: Any = None
        try:
            with self._lock:
                handle = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, local_mem),
                    self._agent.get_xfer_descs(remote_descs, "DRAM"),
                    remote,
                )
                state = self._agent.transfer(handle)
            delay = 0.0
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"NIXL READ from {remote} not done by the deadline")
                time.sleep(delay)  # 0 first: yields the GIL, then backs off
                delay = min(_POLL_MAX_S, max(2e-5, delay * 2))
                with self._lock:
                    state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL READ from {remote} failed ({state})")
        except KvmuxError:
            raise
        except Exception as exc:  # NIXL's own errors (a disconnected peer...) as ours
            raise TransferError(f"NIXL READ from {remote}: {type(exc).__name__}: {exc}") from None
        finally:
            if handle is not None:
                self._release(handle)

    def _release(self, handle: Any) -> None:
        """Free a request; one still in flight is cancelled by NIXL (or logged if it can't)."""
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
            except Exception as exc:  # NIXL could not cancel: it keeps the handle
                log.warning("kvmux nixl: could not release a transfer request: %s", exc)

    # -------------------------------------------------------------------- pump

    def hold(self) -> None:
        """Something may read this agent's memory now: progress it often."""
        with self._cond:
            self._holds += 1
            self._cond.notify()

    def unhold(self) -> None:
        with self._cond:
            self._holds = max(0, self._holds - 1)

    def _pump_loop(self) -> None:
        while True:
            with self._cond:
                if not self._closed and self._holds == 0:
                    self._cond.wait(_IDLE_PUMP_S)
                if self._closed:
                    return
                busy = self._holds > 0
            try:
                with self._lock:
                    notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
                for agent, messages in notifs.items():
                    log.debug("kvmux nixl: %d stray notification(s) from %s", len(messages), agent)
                self._on_tick()
            except Exception:
                log.exception("kvmux nixl: progress failed")
            if busy:
                time.sleep(self._pump_interval_s)

    # ------------------------------------------------------------------- close

    def close(self) -> None:
        """Stop the pump, forget remote agents, deregister memory. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._pump.join(timeout=5)
        with self._lock:
            for name in list(self._remote):
                self.remove_remote(name)
            for reg in self._registered:
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(reg)
            self._registered.clear()
