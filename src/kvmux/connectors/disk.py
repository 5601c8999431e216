"""``disk``: blocks as files in a directory, surviving restarts.

Each block is one file named by its key under a subdirectory per layout
fingerprint, so instances with different layouts never read each other's
blocks. A write goes to a temporary file that is renamed into place, so a
crash leaves either the whole block or nothing readable; a file of the wrong
size (a torn write after power loss without ``fsync``) is treated as missing
and removed. With ``capacity_bytes`` set, least recently used files are
deleted to stay under the bound; recency survives restarts through mtimes.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

import torch
from pydantic import Field

from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.connector import Address, Connector
from kvmux.errors import CapacityError, ConfigError
from kvmux.handle import MISSING, OK, Handle, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout

_SUFFIX = ".kv"


class DiskConfig(BackendConfig):
    backend: str = "disk"
    path: Path = Field(description="directory holding the blocks; created if absent")
    capacity_bytes: int | None = Field(
        None, gt=0, description="bound on the bytes of blocks kept; None for no bound"
    )
    fsync: bool = Field(
        False, description="fsync each block before it becomes visible (slower, crash-proof)"
    )


class DiskConnector(Connector):
    config_model = DiskConfig
    capabilities = Capabilities(persistent=True, capacity_bound=True)
    config: DiskConfig

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config)
        _check_writable(config.path)
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._index: OrderedDict[BlockKey, None] = OrderedDict()  # LRU order
        self.evictions = 0

    def _register(self, layout: KVLayout, caches: Mapping[str, torch.Tensor]) -> None:
        cap = self.config.capacity_bytes
        if cap is not None and cap < layout.block_nbytes:
            raise CapacityError(
                f"capacity_bytes={cap} holds no block of {layout.block_nbytes} bytes"
            )
        directory = self.config.path / layout.fingerprint()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "layout.json").write_text(layout.model_dump_json(indent=1))
        found: list[tuple[float, BlockKey]] = []
        for entry in os.scandir(directory):
            if entry.name.startswith(".tmp"):
                os.unlink(entry.path)  # a write that never finished
            elif entry.name.endswith(_SUFFIX):
                key = BlockKey.from_id(_unquote(entry.name[: -len(_SUFFIX)]))
                found.append((entry.stat().st_mtime, key))
        with self._lock:
            self._dir = directory
            self._index = OrderedDict((key, None) for _, key in sorted(found, key=lambda f: f[0]))

    # ------------------------------------------------------------------ lookup

    def _lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    # ------------------------------------------------------------------ save

    def _save(self, keys: list[BlockKey], block_ids: list[int]) -> Handle:
        def work() -> tuple[list[Outcome], int]:
            rows = self.copier.gather(block_ids)
            outcomes: list[Outcome] = []
            for i, key in enumerate(keys):
                try:
                    self._write(key, rows[i])
                    outcomes.append(OK)
                except OSError as exc:
                    outcomes.append(failed(f"write failed: {exc}"))
            self._evict()
            return outcomes, sum(o.ok for o in outcomes) * self.copier.block_nbytes

        return self._run(keys, work)

    def _write(self, key: BlockKey, row: torch.Tensor) -> None:
        path = self._path(key)
        with self._lock:
            if key in self._index and path.exists():
                self._index.move_to_end(key)
                return  # same key, same content
        fd, tmp = tempfile.mkstemp(prefix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(row.numpy().data)
                if self.config.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        with self._lock:
            self._index[key] = None
            self._index.move_to_end(key)

    def _evict(self) -> None:
        cap = self.config.capacity_bytes
        if cap is None:
            return
        limit = cap // self.copier.block_nbytes
        with self._lock:
            victims = [self._index.popitem(last=False)[0] for _ in range(len(self._index) - limit)]
            self.evictions += len(victims)
        for key in victims:
            self._path(key).unlink(missing_ok=True)

    # ------------------------------------------------------------------ load

    def _load(self, keys: list[BlockKey], block_ids: list[int], source: Address | None) -> Handle:
        def work() -> tuple[list[Outcome], int]:
            outcomes = [self._read(key, block) for key, block in zip(keys, block_ids, strict=True)]
            return outcomes, sum(o.ok for o in outcomes) * self.copier.block_nbytes

        return self._run(keys, work)

    def _read(self, key: BlockKey, block: int) -> Outcome:
        nbytes = self.copier.block_nbytes
        path = self._path(key)
        direct = self.copier.contiguous_block(block)
        target = direct if direct is not None else torch.empty(nbytes, dtype=torch.uint8)
        try:
            with open(path, "rb") as f:
                got = f.readinto(target.numpy().data)
                extra = f.read(1)
        except FileNotFoundError:
            self._forget(key)
            return MISSING
        except OSError as exc:
            return failed(f"read failed: {exc}")
        if got != nbytes or extra:
            # Torn or foreign file. If it was read straight into KV memory the
            # block is now garbage, but the caller recomputes a failed block.
            self._forget(key)
            path.unlink(missing_ok=True)
            return failed(f"{path.name}: wrong size, expected {nbytes} bytes")
        if direct is None:
            self.copier.copy_in([block], target.view(1, nbytes))
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        os.utime(path)
        return OK

    # ------------------------------------------------------------------ misc

    def _release(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self._forget(key)
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _path(self, key: BlockKey) -> Path:
        assert self._dir is not None
        return self._dir / (_quote(key.id) + _SUFFIX)

    def stats(self) -> dict[str, float]:
        out = super().stats()
        with self._lock:
            stored = len(self._index)
        out.update(blocks_stored=stored, evictions=self.evictions)
        if self.layout is not None:
            out["bytes_stored"] = stored * self.layout.block_nbytes
        return out


def _check_writable(path: Path) -> None:
    """Fail at creation, not at the first save, if ``path`` cannot hold blocks."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=".tmp-probe", dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            "disk", [("path", f"not a writable directory: {exc.strerror}", str(path))]
        ) from None


def _quote(key_id: str) -> str:
    """A key id as a file name: '/' and '%' are the only characters to escape."""
    return key_id.replace("%", "%25").replace("/", "%2F")


def _unquote(name: str) -> str:
    return name.replace("%2F", "/").replace("%25", "%")
