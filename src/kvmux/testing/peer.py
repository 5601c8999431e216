"""A producer in its own OS process, for tests that need a real second process.

Run as::

    python -m kvmux.testing.peer --config JSON --blocks N --seed S [--layout small]

It builds a connector from ``--config`` through the registry, registers KV
memory filled deterministically from ``--seed``, saves its first N blocks
under ``make_keys(N)``, prints ONE JSON line ``{"address": ..., "keys":
[...]}`` and serves until its stdin closes or it gets SIGTERM, then closes
the connector cleanly. Block ``i`` holds the same bytes for a given seed and
layout whatever N is, so a test can check any peer's blocks with
``make_caches(seed, ...)`` and swap one peer for another.

:func:`spawn_peer` runs it from a test and always stops it by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvmux.keys import BlockKey, chain_keys
from kvmux.layout import KVLayout
from kvmux.registry import create_connector
from kvmux.testing.lifetime import stopped

BLOCK_SIZE = 16
"""Tokens per block of every peer layout."""

NAMESPACE = "kvmux-peer"

LAYOUTS: dict[str, tuple[int, torch.dtype, tuple[int, ...]]] = {
    "small": (2, torch.float16, (2, 16, 4, 32)),
    "other": (2, torch.bfloat16, (2, 16, 4, 32)),
    "large": (1, torch.float16, (2, 16, 32, 128)),
    "eight_layers": (8, torch.bfloat16, (2, 16, 8, 64)),
}
"""name -> (layers, dtype, block shape). ``small``: 16 KiB blocks in two layers
(consumers stage them); ``other``: the same shapes in another dtype (a layout
mismatch with ``small``); ``large``: 256 KiB single-layer blocks (received
straight into KV memory); ``eight_layers``: 256 KiB blocks of eight 32 KiB
layers, the block of ``kvmux bench``'s one-block shape."""


def make_caches(seed: int, num_blocks: int, layout: str = "small") -> dict[str, torch.Tensor]:
    """KV tensors of ``layout`` whose block ``i`` holds random bytes drawn from
    ``(seed, i)`` alone (random bytes, not numbers: nothing can round them)."""
    layers, dtype, block_shape = LAYOUTS[layout]
    caches = {
        f"layer.{n}": torch.empty((num_blocks, *block_shape), dtype=dtype) for n in range(layers)
    }
    for block in range(num_blocks):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + block) % 2**63)
        for cache in caches.values():
            dst = cache[block].view(torch.uint8)
            dst.copy_(torch.randint(0, 256, dst.shape, generator=gen, dtype=torch.uint8))
    return caches


def empty_caches(num_blocks: int, layout: str = "small") -> dict[str, torch.Tensor]:
    """Zeroed KV tensors of ``layout``: a consumer's memory before a load."""
    layers, dtype, block_shape = LAYOUTS[layout]
    return {
        f"layer.{n}": torch.zeros((num_blocks, *block_shape), dtype=dtype) for n in range(layers)
    }


def make_layout(caches: Mapping[str, torch.Tensor]) -> KVLayout:
    return KVLayout.from_caches(caches, BLOCK_SIZE)


def block_bytes(caches: Mapping[str, torch.Tensor], blocks: Sequence[int]) -> torch.Tensor:
    """``[len(blocks), block_nbytes]`` copies of the blocks' bytes, layers end to end,
    read with plain indexing (independent of the code under test)."""
    index = torch.tensor(list(blocks), dtype=torch.long)
    return torch.cat(
        [cache.view(torch.uint8)[index].reshape(len(index), -1) for cache in caches.values()],
        dim=1,
    )


def make_keys(n: int) -> list[BlockKey]:
    """The keys a peer saves its blocks ``0..n-1`` under."""
    return chain_keys(list(range(n * BLOCK_SIZE)), BLOCK_SIZE, NAMESPACE)


# ------------------------------------------------------------------ the process


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmux.testing.peer", description=__doc__)
    parser.add_argument("--config", required=True, help="connector config as JSON")
    parser.add_argument("--blocks", type=int, required=True, help="blocks to save")
    parser.add_argument("--seed", type=int, required=True, help="seed of the KV bytes")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="small")
    args = parser.parse_args(argv)
    if args.blocks < 1:
        parser.error("--blocks must be at least 1")

    signal.signal(signal.SIGTERM, _exit_on_signal)
    caches = make_caches(args.seed, args.blocks, args.layout)
    keys = make_keys(args.blocks)
    connector = create_connector(json.loads(args.config))
    try:
        connector.register(make_layout(caches), caches)
        result = connector.save(keys, list(range(args.blocks))).saved(60)
        if not result.ok:
            print(f"peer: save failed: {result.not_ok[:3]}", file=sys.stderr, flush=True)
            return 1
        line = {"address": connector.address(), "keys": [key.id for key in keys]}
        print(json.dumps(line), flush=True)
        sys.stdin.buffer.read()  # serve until whoever started us closes our stdin
    finally:
        connector.close()
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)  # unwinds through main's finally: the connector closes cleanly


# ------------------------------------------------------------------- for tests


@dataclass(frozen=True)
class PeerProcess:
    """A running peer: its PID, the address to pass as ``source`` and its keys."""

    pid: int
    address: dict[str, Any]
    keys: list[BlockKey]
    process: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL: the peer dies without closing anything."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stopped(self) -> contextlib.AbstractContextManager[None]:
        """Frozen (SIGSTOP) for a ``with`` block: see :func:`kvmux.testing.lifetime.stopped`."""
        return stopped(self.pid)


@contextlib.contextmanager
def spawn_peer(
    config: Mapping[str, Any],
    blocks: int,
    seed: int,
    layout: str = "small",
    *,
    ready_timeout_s: float = 60.0,
    prefix: Sequence[str] = (),
) -> Iterator[PeerProcess]:
    """Run a peer process for the ``with`` block; it is stopped by PID on exit
    (stdin closed, then SIGKILL if it has not gone within 5 s). ``prefix`` runs it
    through a command that execs it, e.g. in another network namespace
    (:meth:`kvmux.testing.netns.Host.command`)."""
    cmd = [
        sys.executable,
        "-m",
        "kvmux.testing.peer",
        "--config",
        json.dumps(dict(config)),
        "--blocks",
        str(blocks),
        "--seed",
        str(seed),
        "--layout",
        layout,
    ]
    proc = subprocess.Popen([*prefix, *cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        ready = json.loads(read_line(proc, ready_timeout_s))
        yield PeerProcess(
            proc.pid, ready["address"], [BlockKey.from_id(k) for k in ready["keys"]], proc
        )
    finally:
        _stop(proc)


def read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """The next line ``proc`` prints (without its newline), within ``timeout_s``;
    what it printed after that line is dropped (it prints one and then waits)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise TimeoutError(f"process {proc.pid} printed no line within {timeout_s} s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"process {proc.pid} exited ({proc.wait()}) before a line")
            data += chunk
    return data.split(b"\n", 1)[0]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None and proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as exc:  # SIGTERM or a usage error, after main's clean-up
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    sys.stdout.flush()
    sys.stderr.flush()
    # The connector is closed by now; skipping the interpreter's teardown saves
    # about a second of torch clean-up per peer, which adds up across a test run.
    os._exit(status)
