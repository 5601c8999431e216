"""One Mooncake Transfer Engine per process, shared by its connectors; every wait bounded.

The Transfer Engine (TE) moves bytes between memory registered on both sides;
in ``P2PHANDSHAKE`` mode there is no metadata server: a peer is named
``"host:rpc_port"`` and the two engines exchange segment descriptors on first
contact. Four traps shape this wrapper:

* TE's TCP transport queues at most a few hundred transfers per peer by
  default; a batch of thousands of small blocks fails with "queue-full" and
  leaves the engine broken afterwards. The limit is read from the
  environment (``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``) when the engine
  initialises, so it is set here, before ``initialize`` (process-wide: the
  first engine's value holds); a read of more ranges than that is split into
  TE calls of at most that many.
* A batch read has no timeout of its own; against a frozen peer it can wait
  for a long time. kvmux promises an answer within ``timeout_s``, so the call
  runs in a worker thread and the caller stops waiting at the deadline. The
  abandoned call may still complete later and write into the destination
  blocks; those keys were reported failed, so their blocks hold no promised
  bytes, but an engine that reuses them at once could see late writes from a
  peer that wakes up (a frozen one, or a cut link that comes back: measured,
  the abandoned reads then completed with rc 0).
* While a read waits for bytes, TE's synchronous call polls the batch's status
  in a loop without sleeping: it keeps a whole core busy, and it goes on after
  the deadline (there is no call to cancel it) until the bytes come or TE's own
  timeout passes. On a small machine the abandoned pollers starve the engine
  that is recomputing the failed blocks (measured on 2 cores, a link cut
  under vLLM P/D: two abandoned calls used 9.9 CPU-seconds in 8.7 s, and a
  recompute of 0.07 s took 0.54 s, on a loaded box about 9 s). So an
  abandoned call's thread is moved to ``SCHED_IDLE`` at the deadline: it runs
  only on a core nothing else wants.
* Destroying a Transfer Engine stalls every Python thread for about a second
  (its destructor holds the GIL). So one engine per (host, protocol, devices)
  serves every connector of a process, created on first use and kept until
  exit; a connector only registers and unregisters its own memory on it.

Security note: TE's RPC and data listeners bind ``0.0.0.0`` whatever hostname
is given (observed with 0.3.13). Registered memory is readable by any host
that can reach the port and knows an address; run it on a trusted network or
firewall the port. kvmux only hands out pool addresses through its own
authenticated, validated control channel.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import threading
from concurrent.futures import Future
from typing import Any

import torch

from kvmux.errors import TransferError, TransferTimeout

log = logging.getLogger(__name__)

QUEUE_ENV = "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"

_engines: dict[tuple[str, str, str], tuple[Any, int]] = {}
"""(host, protocol, devices) -> (the process's TransferEngine, its RPC port)."""
_engines_lock = threading.Lock()
_registrations: dict[tuple[int, int], list[int]] = {}
"""(engine id, address) -> [bytes, handles holding it]: TE refuses a second registration
of the same memory (rc -7), yet two connectors of a process may register the same KV."""


def keep_past_exit(obj: object) -> None:
    """Never run ``obj``'s destructor: the OS reclaims its memory at exit.

    Mooncake's destructors stop every Python thread while they wait for their
    helper threads (about a second for an engine, 10-15 s for a store client
    whose master is gone); at interpreter exit that only delays the exit.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


@atexit.register
def _keep_engines() -> None:
    with _engines_lock:
        for engine, _ in _engines.values():
            keep_past_exit(engine)


def shared_engine(host: str, protocol: str, device_name: str, max_queued: int) -> tuple[Any, int]:
    """The process's engine for these settings, initialised on first use."""
    from mooncake.engine import TransferEngine

    key = (host, protocol, device_name)
    with _engines_lock:
        found = _engines.get(key)
        if found is not None:
            if os.environ.get(QUEUE_ENV) != str(max_queued):
                log.warning(
                    "kvmux mooncake: %s=%s already applies to the shared engine; %s ignored",
                    QUEUE_ENV,
                    os.environ.get(QUEUE_ENV),
                    max_queued,
                )
            return found
        os.environ[QUEUE_ENV] = str(max_queued)
        engine = TransferEngine()
        rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"Mooncake Transfer Engine failed to initialise (rc={rc}, protocol "
                f"{protocol!r}, devices {device_name!r})"
            )
        _engines[key] = found = (engine, int(engine.get_rpc_port()))
        return found


def yield_cpu(thread_id: int) -> None:
    """Let the thread ``thread_id`` (a native id) run only when a core is idle: an
    abandoned TE call that busy-polls must not take the CPU from the engine. A
    thread that has ended meanwhile is left alone (ESRCH)."""
    with contextlib.suppress(ProcessLookupError):
        os.sched_setscheduler(thread_id, os.SCHED_IDLE, os.sched_param(0))


class MooncakeEngine:
    """One connector's handle on the shared engine: its registrations and bounded reads."""

    def __init__(self, host: str, protocol: str, device_name: str, max_queued: int) -> None:
        self._engine, self.port = shared_engine(host, protocol, device_name, max_queued)
        self.host = host
        self.max_batch = min(max_queued, int(os.environ.get(QUEUE_ENV, max_queued)))
        """Ranges per TE batch call: more than the queue holds fail and break the engine."""
        self._lock = threading.Lock()
        self._registered: list[int] = []
        self._closed = False

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register whole tensors: a remote peer may read them, a local read may fill them."""
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise TransferError("Mooncake registers only contiguous tensors")
            ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            key = (id(self._engine), ptr)
            with _engines_lock:
                held = _registrations.get(key)
                if held is not None and held[0] == nbytes:
                    held[1] += 1
                else:
                    rc = self._engine.register_memory(ptr, nbytes)
                    if rc != 0:
                        raise TransferError(
                            f"Mooncake refused to register {nbytes} bytes at {ptr:#x} (rc={rc}; "
                            "-7: overlaps memory registered in this process)"
                        )
                    _registrations[key] = [nbytes, 1]
            with self._lock:
                self._registered.append(ptr)

    def read(
        self,
        peer: str,
        local: list[int],
        remote: list[int],
        lengths: list[int],
        *,
        timeout_s: float,
        keep: object = None,
    ) -> None:
        """One batch READ of ``remote[i]`` (the peer's memory) into ``local[i]``, both
        ``lengths[i]`` bytes, in TE calls of at most ``max_batch`` ranges. Returns once
        done; raises TransferError if TE reports a failure, TransferTimeout if it has
        not answered within ``timeout_s``.

        ``keep`` (what owns the ``local`` memory, e.g. the KV tensors) is held until TE
        returns, past the deadline too: TE knows the ranges only as addresses, and an
        abandoned read that completes late must write into live memory, never into
        memory freed (and reused by the allocator) meanwhile."""
        if timeout_s <= 0:
            raise TransferTimeout(f"no time left to read from {peer}")
        done: Future[int] = Future()
        abandoned = threading.Event()
        caller: list[int] = []

        def call(owner: object) -> None:  # the thread holds ``owner`` while TE may write
            caller.append(threading.get_native_id())
            try:
                rc, step = 0, self.max_batch
                for i in range(0, len(local), step):
                    rc = int(
                        self._engine.batch_transfer_sync_read(
                            peer, local[i : i + step], remote[i : i + step], lengths[i : i + step]
                        )
                    )
                    if rc != 0 or abandoned.is_set():  # no later chunks after the deadline
                        break
                done.set_result(rc)
            except BaseException as exc:  # TE's own errors travel to the waiting caller
                done.set_exception(exc)

        # A fresh daemon thread per read: one stuck on a frozen peer blocks nobody else.
        threading.Thread(target=call, args=(keep,), name="kvmux-mooncake-read", daemon=True).start()
        try:
            rc = done.result(timeout=timeout_s)
        except TimeoutError:
            abandoned.set()
            if caller and not done.done():
                yield_cpu(caller[0])
            raise TransferTimeout(
                f"Mooncake read of {len(local)} ranges from {peer} not done in {timeout_s:.1f} s"
            ) from None
        except Exception as exc:
            raise TransferError(f"Mooncake read from {peer}: {type(exc).__name__}: {exc}") from None
        if rc != 0:
            raise TransferError(
                f"Mooncake read of {len(local)} ranges from {peer} failed (rc={rc})"
            )

    def close(self) -> None:
        """Unregister this handle's memory (the shared engine stays). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            registered, self._registered = self._registered, []
        for ptr in registered:
            key = (id(self._engine), ptr)
            with _engines_lock:
                held = _registrations.get(key)
                if held is None:
                    continue
                held[1] -= 1
                if held[1] > 0:
                    continue
                del _registrations[key]
                rc = self._engine.unregister_memory(ptr)
            if rc != 0:
                log.warning("kvmux mooncake: unregister_memory(%#x) returned %s", ptr, rc)
