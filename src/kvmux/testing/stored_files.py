"""Reaching a ``file_backed`` backend's stored blocks from a test, to damage them.

The suite knows nothing of a backend's file format. It finds a block where
the capability promises it is: its bytes, as they are, in some file under a
directory named in the backend's config. So it looks for a run of the
block's own bytes in those files and flips one bit inside it, which is what
a failing disk does, without knowing names, headers or checksums.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from kvmux.connector import Connector

NEEDLE_BYTES = 64
"""How much of a block is searched for: random KV bytes make 64 unique in practice."""


def config_dirs(config: BaseModel) -> list[Path]:
    """Every existing directory a config names, nested backend configs included."""
    found: list[Path] = []

    def walk(value: Any) -> None:
        if isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, PurePath) and Path(value).is_dir():
            found.append(Path(value))

    walk(config)
    return found


@dataclass(frozen=True)
class StoredCopy:
    """Where one stored copy of a block's bytes starts: ``path`` at ``offset``."""

    path: Path
    offset: int


@dataclass(frozen=True)
class StoredFiles:
    """The files of one ``file_backed`` store."""

    dirs: tuple[Path, ...]

    @classmethod
    def of(cls, connector: Connector) -> StoredFiles:
        dirs = config_dirs(connector.config)
        if not dirs:
            pytest.fail(
                f"{type(connector.backend).__name__} declares file_backed, but its config names "
                "no existing directory where its blocks' files could be"
            )
        return cls(tuple(dirs))

    def _files(self) -> Iterator[Path]:
        for root in self.dirs:
            yield from (p for p in sorted(root.rglob("*")) if p.is_file())

    def copies(self, block: torch.Tensor) -> list[StoredCopy]:
        """Every place a stored block (a ``[block_nbytes]`` uint8 row) starts; fails the
        test if there is none, as the capability promises there is."""
        needle = block[:NEEDLE_BYTES].numpy().tobytes()
        hits = []
        for path in self._files():
            data = path.read_bytes()
            at = data.find(needle)
            while at >= 0:
                hits.append(StoredCopy(path, at))
                at = data.find(needle, at + 1)
        if not hits:
            pytest.fail(
                f"the backend declares file_backed, but no file under "
                f"{', '.join(map(str, self.dirs))} holds the bytes of a block it saved"
            )
        return hits

    def flip_a_bit(self, block: torch.Tensor) -> None:
        """Damage every stored copy of ``block``: one bit, in the middle of its first bytes."""
        for copy in self.copies(block):
            with open(copy.path, "r+b") as f:
                f.seek(copy.offset + NEEDLE_BYTES // 2)
                byte = f.read(1)[0]
                f.seek(-1, 1)
                f.write(bytes([byte ^ 0x10]))

    def only_file(self, block: torch.Tensor) -> Path:
        """The one file holding ``block`` (skips the test where it is stored twice)."""
        paths = {c.path for c in self.copies(block)}
        if len(paths) != 1:
            pytest.skip(f"the block is stored in {len(paths)} files: no single file to swap")
        return paths.pop()

    def put_in_place_of(self, intact: torch.Tensor, victim: torch.Tensor) -> None:
        """Overwrite the file of ``victim`` with the file of ``intact``: the store now
        holds one block's intact bytes under the other's name."""
        source, target = self.only_file(intact), self.only_file(victim)
        if source == target:
            pytest.skip("both blocks share one file: there is no file to swap")
        shutil.copyfile(source, target)
