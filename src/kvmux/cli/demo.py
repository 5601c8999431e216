"""``kvmux demo``: a prefill -> decode KV hand-off between two OS processes.

A "prefill" process fills its KV memory, saves the blocks and publishes its
address; this process plays "decode": it asks how many leading blocks the
producer has, pulls them into its own (empty) KV memory, and checks every byte
against an independent recomputation of what prefill held. It does this for
each peer-to-peer backend that ships with kvmux (``shm`` on one host, ``tcp``
across hosts). The vLLM adapter replaces this with real engines.
"""

from __future__ import annotations

import argparse
import time

DEMO_BACKENDS = ("shm", "tcp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--blocks", type=int, default=256, help="blocks to hand off (256 KiB each)")
    parser.add_argument(
        "--backend", action="append", choices=DEMO_BACKENDS, help="default: shm and tcp"
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from kvmux.registry import create_connector
    from kvmux.testing.peer import block_bytes, empty_caches, make_caches, make_layout, spawn_peer

    seed, layout = 7, "large"
    expected = block_bytes(make_caches(seed, args.blocks, layout), range(args.blocks))
    all_identical = True
    print(f"{'backend':<8} {'asked':>6} {'hit':>6} {'MiB':>8} {'load s':>8} {'GB/s':>7}  identical")
    for backend in args.backend or DEMO_BACKENDS:
        config = {"backend": backend, "capacity_bytes": 2 * expected.numel()}
        with spawn_peer(config, args.blocks, seed, layout) as prefill:
            caches = empty_caches(args.blocks, layout)
            with create_connector({"backend": backend}) as decode:
                decode.register(make_layout(caches), caches)
                hit = decode.lookup(prefill.keys, prefill.address)
                blocks = list(range(args.blocks))[::-1]  # land anywhere: reversed on purpose
                start = time.perf_counter()
                result = decode.load(prefill.keys[:hit], blocks[:hit], prefill.address).result()
                seconds = time.perf_counter() - start
            got = block_bytes(caches, blocks)
            identical = result.ok and hit == args.blocks and torch.equal(got, expected)
            all_identical &= identical
            print(
                f"{backend:<8} {args.blocks:>6} {hit:>6} {result.nbytes / 2**20:>8.1f} "
                f"{seconds:>8.3f} {result.nbytes / seconds / 1e9:>7.2f}  "
                f"{'yes' if identical else 'NO'}"
            )
    print("every byte identical to what prefill held" if all_identical else "MISMATCH")
    return 0 if all_identical else 1
