"""Helpers shared by the tests (import as ``from support import ...``)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest
import torch

from kvmux.keys import BlockKey, chain_keys
from kvmux.layout import KVLayout
from kvmux.testing.lifetime import die_with_parent


def make_caches(
    num_blocks: int = 32, layers: int = 2, dtype: torch.dtype = torch.float16, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"layer.{i}": torch.randn(num_blocks, 2, 16, 2, 32, generator=gen).to(dtype)
        for i in range(layers)
    }


@pytest.fixture
def caches() -> dict[str, torch.Tensor]:
    return make_caches()


@pytest.fixture
def layout(caches: dict[str, torch.Tensor]) -> KVLayout:
    return KVLayout.from_caches(caches, block_size=16)


def keys(n: int, namespace: str = "test") -> list[BlockKey]:
    return chain_keys(list(range(n * 16)), 16, namespace)


FakeDist = Callable[..., Path]


@pytest.fixture
def fake_dist(tmp_path: Path) -> FakeDist:
    """Write an installed-looking distribution (dist-info + modules) into one
    directory; put it on PYTHONPATH of a subprocess to 'install' it."""
    site = tmp_path / "site"
    site.mkdir()

    def make(
        name: str,
        entry_points: Mapping[str, Mapping[str, str]],
        modules: Mapping[str, str] | None = None,
        version: str = "1.0",
    ) -> Path:
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines += [f"{ep} = {value}" for ep, value in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for rel, source in (modules or {}).items():
            path = site / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
        return site

    return make


def run_python(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if pythonpath is not None:  # in front of the caller's own (a worktree's src, say)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def kvmux_cli(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run_python(
        f"import sys; from kvmux.cli.main import main; sys.exit(main({json.dumps(list(args))}))",
        pythonpath,
    )


# ------------------------------------------------------- peer-to-peer backends

P2P_TIMEOUT_S = 3.0
"""``timeout_s`` of the P2P connectors under test: short, so failures show fast."""
P2P_GRACE_S = 5.0
"""How long past its own timeout a handle may take before the test calls it a hang."""


def wait_until(condition: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def free_port() -> int:
    """A loopback TCP port nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------- Mooncake Store

MOONCAKE_MASTER = Path(os.environ.get("VIRTUAL_ENV", ".venv")) / "bin" / "mooncake_master"


@contextlib.contextmanager
def run_master() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A private ``mooncake_master`` on free loopback ports, stopped by PID.

    Yields ``("127.0.0.1:PORT", process)``. Its defaults listen on 0.0.0.0,
    hence the explicit addresses (shared/NOTES.md).
    """
    binary = str(MOONCAKE_MASTER) if MOONCAKE_MASTER.exists() else None
    binary = binary or shutil.which("mooncake_master")
    if binary is None:
        pytest.skip("mooncake_master is not installed")
    port, metrics = free_port(), free_port()
    argv = [
        binary,
        "--rpc_address=127.0.0.1",
        f"--rpc_port={port}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
    ]
    with listening_process(argv, port, "mooncake_master", 20) as proc:
        yield f"127.0.0.1:{port}", proc


# ------------------------------------------------------------- LMCache server


@contextlib.contextmanager
def run_lmcache_server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A private ``lmcache_server`` (CPU storage) on a free loopback port, stopped
    by PID. Yields ``("lm://127.0.0.1:PORT", process)``."""
    port = free_port()
    argv = [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"]
    with listening_process(argv, port, "lmcache_server", 120) as proc:
        yield f"lm://127.0.0.1:{port}", proc


@contextlib.contextmanager
def listening_process(
    argv: list[str], port: int, what: str, start_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``argv`` until it listens on 127.0.0.1:``port``; SIGTERM (then SIGKILL)
    it by PID at the end, if it still runs, and with this process if it dies first."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
    )
    try:
        deadline = time.monotonic() + start_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert proc.poll() is None, f"{what} exited"
                assert time.monotonic() < deadline, f"{what} did not listen in {start_s} s"
                time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.contextmanager
def small_tmpfs(where: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` KiB mounted at a new directory under ``where`` (a disk
    that really fills up: writes fail with ENOSPC), unmounted afterwards. Needs root
    and a kernel that lets this process mount; the test is skipped, saying which,
    where it cannot."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount_point = where / f"tmpfs-{size_kib}k"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill_up(directory: Path) -> None:
    """Write a file into ``directory`` until its filesystem refuses another page."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
