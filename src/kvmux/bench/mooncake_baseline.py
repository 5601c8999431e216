"""Raw Mooncake Transfer Engine with no kvmux in the way: the baseline
``kvmux bench --backend mooncake`` sits beside.

Two engines in this process (as the benchmarked producer and consumer are),
P2P handshake, TCP (the transport kvmux's ``mooncake`` uses by default), the
same queue limit kvmux sets. What a save+load costs done by hand: one host copy
into the registered source buffer (the save), then one ``batch_transfer_sync_read``
of the shape's blocks, a range per block per layer, into scattered destination
blocks (the load). kvmux merges ranges contiguous on both sides; the baseline
does not, so it issues at least as many ranges as kvmux.
"""

from __future__ import annotations

import os
import time
from contextlib import AbstractContextManager
from typing import Any

import torch

from kvmux.bench.shapes import Shape
from kvmux.net.mooncake_engine import QUEUE_ENV, keep_past_exit


class RawMooncakeRead(AbstractContextManager["RawMooncakeRead"]):
    """Two initialised engines, registered buffers and the ranges of one batch READ."""

    def __init__(self, shape: Shape, max_queued: int = 8192) -> None:
        from mooncake.engine import TransferEngine

        os.environ.setdefault(QUEUE_ENV, str(max_queued))
        self._src_engine: Any = TransferEngine()
        self._dst_engine: Any = TransferEngine()
        for engine in (self._src_engine, self._dst_engine):
            if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                raise RuntimeError("raw Mooncake engine failed to initialise")
        self._peer = f"127.0.0.1:{self._src_engine.get_rpc_port()}"
        self._staged = torch.ones(shape.nbytes, dtype=torch.uint8)
        self._src = torch.zeros(shape.nbytes, dtype=torch.uint8)
        self._dst = torch.zeros(2 * shape.nbytes, dtype=torch.uint8)
        self._src_engine.register_memory(self._src.data_ptr(), self._src.numel())
        self._dst_engine.register_memory(self._dst.data_ptr(), self._dst.numel())
        src_addr, dst_addr, piece = shape.scattered_pieces(
            self._src.data_ptr(), self._dst.data_ptr()
        )
        n = len(src_addr)
        self._local: list[int] = dst_addr.tolist()
        self._remote: list[int] = src_addr.tolist()
        self._lengths = [piece] * n

    def save_load_seconds(self) -> tuple[float, float]:
        """(copy into the registered buffer, one batch READ of every block) in seconds."""
        start = time.perf_counter()
        self._src.copy_(self._staged)
        copied = time.perf_counter()
        rc = self._dst_engine.batch_transfer_sync_read(
            self._peer, self._local, self._remote, self._lengths
        )
        done = time.perf_counter()
        if rc != 0:
            raise RuntimeError(f"raw Mooncake batch read failed (rc={rc})")
        return copied - start, done - copied

    def __exit__(self, *exc: object) -> None:
        self._dst_engine.unregister_memory(self._dst.data_ptr())
        self._src_engine.unregister_memory(self._src.data_ptr())
        # Destroying an engine stalls every thread ~1 s (see kvmux.net.mooncake_engine).
        keep_past_exit(self._src_engine)
        keep_past_exit(self._dst_engine)
