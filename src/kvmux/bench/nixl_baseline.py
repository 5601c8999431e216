"""Raw NIXL with no kvmux in the way: the baseline ``kvmux bench --backend nixl`` sits beside.

Two agents in this process (as the benchmarked producer and consumer are), UCX,
progress threads off (as kvmux runs them). What a save+load costs done by hand:
one host copy into the registered source buffer (the save), then one READ of
the shape's blocks, a descriptor per block per layer, into scattered
destination blocks (the load) — the same descriptor count kvmux issues.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from kvmux.bench.shapes import Shape

_DEADLINE_S = 30.0


class RawNixlRead(AbstractContextManager["RawNixlRead"]):
    """Two registered agents and the descriptors of one READ of ``shape``."""

    def __init__(self, shape: Shape) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from kvmux.net.nixl_agent import quiet_nixl_logger, skip_ucx_ib_without_devices

        quiet_nixl_logger()
        skip_ucx_ib_without_devices()
        conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self._src_agent: Any = nixl_agent("kvmux-bench-src", conf)
        self._dst_agent: Any = nixl_agent("kvmux-bench-dst", conf)
        self.nbytes = shape.nbytes
        self._staged = torch.ones(shape.nbytes, dtype=torch.uint8)
        self._src = torch.zeros(shape.nbytes, dtype=torch.uint8)
        self._dst = torch.zeros(2 * shape.nbytes, dtype=torch.uint8)
        self._regs = [
            (self._src_agent, self._src_agent.register_memory([self._src])),
            (self._dst_agent, self._dst_agent.register_memory([self._dst])),
        ]
        self._remote = self._dst_agent.add_remote_agent(self._src_agent.get_agent_metadata())
        src_addr, dst_addr, piece = shape.scattered_pieces(
            self._src.data_ptr(), self._dst.data_ptr()
        )
        n = len(src_addr)
        lengths = np.full(n, piece, dtype=np.uint64)
        zeros = np.zeros(n, dtype=np.uint64)
        self._local = np.stack([dst_addr, lengths, zeros], axis=1)
        self._remote_descs = np.stack([src_addr, lengths, zeros], axis=1)

    def save_load_seconds(self) -> tuple[float, float]:
        """(copy into the registered buffer, one READ of every block) in seconds."""
        start = time.perf_counter()
        self._src.copy_(self._staged)
        copied = time.perf_counter()
        agent = self._dst_agent
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(self._local, "DRAM"),
            agent.get_xfer_descs(self._remote_descs, "DRAM"),
            self._remote,
            b"",
        )
        state = agent.transfer(handle)
        while state == "PROC":
            if time.perf_counter() - copied > _DEADLINE_S:
                raise TimeoutError("raw NIXL READ did not finish")
            self._src_agent.get_new_notifs()  # the source side's progress
            state = agent.check_xfer_state(handle)
        done = time.perf_counter()
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ failed ({state})")
        return copied - start, done - copied

    def __exit__(self, *exc: object) -> None:
        self._dst_agent.remove_remote_agent(self._remote)
        for agent, reg in self._regs:
            agent.deregister_memory(reg)
