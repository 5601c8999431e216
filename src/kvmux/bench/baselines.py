"""What the hardware does with no kvmux in the way, on the same bytes."""

from __future__ import annotations

import socket
import threading
import time

import torch


def memcpy_seconds(nbytes: int) -> float:
    """Seconds for a save+load's worth of plain copies: ``nbytes`` out, then back,
    between buffers already paged in (as a backend's pool and KV memory are)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    mid = torch.zeros_like(src)
    mid.copy_(src)
    start = time.perf_counter()
    mid.copy_(src)
    src.copy_(mid)
    return time.perf_counter() - start


def socket_seconds(nbytes: int) -> float:
    """Seconds to move ``nbytes`` once over a plain loopback TCP connection."""
    payload = torch.ones(nbytes, dtype=torch.uint8).numpy().data
    sink = torch.zeros(nbytes, dtype=torch.uint8).numpy().data
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(payload)

        sender = threading.Thread(target=send)
        sender.start()
        with socket.create_connection(("127.0.0.1", port)) as client:
            start = time.perf_counter()
            got = 0
            while got < nbytes:
                n = client.recv_into(sink[got:])
                if n == 0:
                    raise ConnectionError("sender closed early")
                got += n
            elapsed = time.perf_counter() - start
        sender.join()
    return elapsed
