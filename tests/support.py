"""Helpers shared by the tests (import as ``from support import ...``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from kvmux.keys import BlockKey, chain_keys
from kvmux.layout import KVLayout


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
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
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
