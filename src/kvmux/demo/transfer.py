"""``kvmux demo --transfer-only``: a prefill -> decode KV hand-off between two OS processes.

A "prefill" process fills its KV memory, saves the blocks and publishes its
address; this process plays "decode": it asks how many leading blocks the
producer has, pulls them into its own (empty) KV memory, and checks every byte
against an independent recomputation of what prefill held. It does this for
each peer-to-peer backend that ships with kvmux (``shm`` on one host, ``tcp``
across hosts). No vLLM is needed, which is why it stays next to the real-engine
demo (:mod:`kvmux.demo.run`): it shows the transport alone, in seconds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

DEMO_BACKENDS = ("shm", "tcp")


def run_transfer(blocks: int, backends: Sequence[str] | None = None) -> int:
    """Hand ``blocks`` blocks (256 KiB each) over with every backend; 0 if every byte matched."""
    import torch

    from kvmux.registry import create_connector
    from kvmux.testing.peer import block_bytes, empty_caches, make_caches, make_layout, spawn_peer

    seed, layout = 7, "large"
    expected = block_bytes(make_caches(seed, blocks, layout), range(blocks))
    all_identical = True
    print(f"{'backend':<8} {'asked':>6} {'hit':>6} {'MiB':>8} {'load s':>8} {'GB/s':>7}  identical")
    for backend in backends or DEMO_BACKENDS:
        config = {"backend": backend, "capacity_bytes": 2 * expected.numel()}
        with spawn_peer(config, blocks, seed, layout) as prefill:
            caches = empty_caches(blocks, layout)
            with create_connector({"backend": backend}) as decode:
                decode.register(make_layout(caches), caches)
                hit = decode.lookup(prefill.keys, prefill.address)
                targets = list(range(blocks))[::-1]  # land anywhere: reversed on purpose
                start = time.perf_counter()
                result = decode.load(prefill.keys[:hit], targets[:hit], prefill.address).result()
                seconds = time.perf_counter() - start
            got = block_bytes(caches, targets)
            identical = result.ok and hit == blocks and torch.equal(got, expected)
            all_identical &= identical
            print(
                f"{backend:<8} {blocks:>6} {hit:>6} {result.nbytes / 2**20:>8.1f} "
                f"{seconds:>8.3f} {result.nbytes / seconds / 1e9:>7.2f}  "
                f"{'yes' if identical else 'NO'}"
            )
    print("every byte identical to what prefill held" if all_identical else "MISMATCH")
    return 0 if all_identical else 1
