"""What the hardware does with no kvmux in the way, on the same bytes."""

from __future__ import annotations

import ctypes
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ONE_THREAD_COPY_BYTES = 1 << 20
"""Up to this size the baseline copies in one thread (``memmove``), as the backends'
copy kernel does: torch splits a copy over its threads from 32 KiB on, and waking
them cost a one-block (256 KiB) baseline 300-600 µs in ``kvmux bench``, where the
copy itself takes ~12 µs; they then spun on the cores the backend's transfer,
timed next, needed."""


def memcpy_seconds(nbytes: int) -> float:
    """Seconds for a save+load's worth of plain copies: ``nbytes`` out, then back,
    between buffers already paged in (as a backend's pool and KV memory are)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    mid = torch.zeros_like(src)
    if nbytes <= ONE_THREAD_COPY_BYTES:
        a, b = src.data_ptr(), mid.data_ptr()
        ctypes.memmove(b, a, nbytes)
        start = time.perf_counter()
        ctypes.memmove(b, a, nbytes)
        ctypes.memmove(a, b, nbytes)
        return time.perf_counter() - start
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


_ECHO = """
import socket, sys
with socket.create_server(("127.0.0.1", 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)
"""
ROUND_TRIPS = 2000


def round_trip_seconds(trips: int = ROUND_TRIPS) -> float:
    """Median seconds of a 64-byte ping-pong over loopback TCP with a process that
    echoes it: the least one request and its reply between two processes cost on
    this machine (mostly waking the sleeping side), under any protocol."""
    echo = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    try:
        assert echo.stdout is not None
        port = int(echo.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ping, times = b"x" * 64, []
            for _ in range(trips + 100):
                start = time.perf_counter()
                sock.sendall(ping)
                got = 0
                while got < len(ping):
                    chunk = sock.recv(4096)
                    if not chunk:
                        raise ConnectionError("the echo process closed the connection")
                    got += len(chunk)
                times.append(time.perf_counter() - start)
        return statistics.median(times[100:])
    finally:
        echo.kill()  # by PID; it only echoes
        echo.wait()


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds every thread of process ``pid`` has run (Linux's per-thread
    ``schedstat``, in nanoseconds: the tick-counted ``stat`` is too coarse for a
    few hundred loads)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9
