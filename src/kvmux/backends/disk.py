"""``disk``: blocks as files in a directory, surviving restarts.

Each block is one file named by its key under a subdirectory per layout
fingerprint, so instances with different layouts never read each other's
blocks. A write goes to a temporary file that is renamed into place, so a
crash leaves either the whole block or nothing readable. With ``capacity_bytes``
set, least recently used files are deleted to stay under the bound; recency
survives restarts through mtimes.

Integrity (``checksum: true``, the default): each file carries a digest
(XXH3) of its block bound to its key (:mod:`kvmux.backends.block_file`),
verified on every load. A file that fails (flipped bytes, a torn write after power loss
without ``fsync``, another key's block under this name, the wrong size) ends
its key ``failed`` and is *removed*, so ``lookup`` stops counting it and the
engine's recomputed block is saved afresh. Removed rather than quarantined:
this is a cache, the engine recomputes the block anyway, and a quarantine
directory on a failing disk would need a bound and a cleaner of its own; the
failure reason names the file and ``damaged_blocks_removed`` counts them.

One format per store: an instance indexes only files of its own format and
removes the others when it registers, saying so once in the log. So a store
written before kvmux checked blocks (plain ``.kv`` files) is emptied, once, by
the first instance with checksums on; its blocks are recomputed and saved
again, checked, and are never read unverified. ``checksum: false`` trusts the
disk and likewise removes checked files.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch
from pydantic import Field

from kvmux.backend import Address, Backend
from kvmux.backends.block_file import BlockFormat
from kvmux.blocks import BlockCopier
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import CapacityError, ConfigError, StorageError
from kvmux.handle import MISSING, OK, Outcome, failed
from kvmux.keys import BlockKey
from kvmux.layout import KVLayout

log = logging.getLogger(__name__)


class DiskConfig(BackendConfig):
    backend: str = "disk"
    path: Path = Field(description="directory holding the blocks; created if absent")
    capacity_bytes: int | None = Field(
        None, gt=0, description="bound on the bytes of blocks kept; None for no bound"
    )
    fsync: bool = Field(
        False, description="fsync each block before it becomes visible (slower, crash-proof)"
    )
    checksum: bool = Field(
        True,
        description="store a digest (XXH3) of each block, bound to its key, and verify it on every "
        "load (a damaged file fails and is removed); false trusts the disk",
    )


class DiskBackend(Backend):
    config_model = DiskConfig
    capabilities = Capabilities(persistent=True, file_backed=True, capacity_bound=True)
    config: DiskConfig

    def __init__(self, config: DiskConfig) -> None:
        super().__init__(config)
        _check_writable(config.path)
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self._format: BlockFormat | None = None
        self._index: OrderedDict[BlockKey, None] = OrderedDict()  # LRU order
        self.evictions = 0

    def register(self, blocks: BlockCopier) -> None:
        layout = blocks.layout
        cap = self.config.capacity_bytes
        if cap is not None and cap < layout.block_nbytes:
            raise CapacityError(
                f"capacity_bytes={cap} holds no block of {layout.block_nbytes} bytes"
            )
        fingerprint = layout.fingerprint()
        directory = self.config.path / fingerprint
        _write_layout(directory, layout)
        fmt = BlockFormat(checked=self.config.checksum, scope=fingerprint)
        found: list[tuple[float, BlockKey]] = []
        foreign = 0
        for entry in os.scandir(directory):
            key = fmt.key_of(entry.name)
            if entry.name.startswith(".tmp"):
                if _abandoned(entry.name):
                    os.unlink(entry.path)  # a write that never finished
            elif key is not None:
                found.append((entry.stat().st_mtime, key))
            elif entry.name.endswith(fmt.foreign_suffix):
                os.unlink(entry.path)
                foreign += 1
        if foreign:
            log.warning(
                "kvmux disk: removed %d block files %s from %s, which runs with checksum=%s "
                "(a store keeps one format); their blocks will be recomputed",
                foreign,
                fmt.foreign_description,
                directory,
                str(fmt.checked).lower(),
            )
        with self._lock:
            self._dir, self._format = directory, fmt
            self._index = OrderedDict((key, None) for _, key in sorted(found, key=lambda f: f[0]))

    # ------------------------------------------------------------------ lookup

    def lookup(self, keys: list[BlockKey], source: Address | None) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    # ------------------------------------------------------------------ save

    def save(self, keys: list[BlockKey], block_ids: list[int]) -> list[Outcome]:
        rows = self.copier.gather(block_ids)
        outcomes: list[Outcome] = []
        for i, key in enumerate(keys):
            try:
                self._write(key, rows[i])
                outcomes.append(OK)
            except OSError as exc:
                # One reason for every block a cause fails, so a caller can log it once.
                outcomes.append(failed(f"cannot write blocks in {self._dir}: {_oserror(exc)}"))
        self._evict()
        return outcomes

    def _write(self, key: BlockKey, row: torch.Tensor) -> None:
        path = self._path(key)
        with self._lock:
            if key in self._index and path.exists():
                self._index.move_to_end(key)
                return  # same key, same content
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), dir=path.parent)
        try:
            try:
                self.block_format.write(fd, key, row.numpy().data)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
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

    def load(
        self,
        keys: list[BlockKey],
        block_ids: list[int],
        source: Address | None,
        deadline: float,
    ) -> list[Outcome]:
        return [self._read(key, block) for key, block in zip(keys, block_ids, strict=True)]

    def _read(self, key: BlockKey, block: int) -> Outcome:
        nbytes = self.copier.block_nbytes
        path = self._path(key)
        direct = self.copier.contiguous_block(block)
        target = direct if direct is not None else torch.empty(nbytes, dtype=torch.uint8)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._forget(key)
            return MISSING
        except OSError as exc:
            return failed(f"read failed: {exc}")
        try:
            identity = os.fstat(fd)
            problem = self.block_format.read_into(fd, identity.st_size, key, target.numpy().data)
        except OSError as exc:
            return failed(f"read failed: {path}: {exc}")
        finally:
            os.close(fd)
        if problem is not None:
            # If it was read straight into KV memory the block is now garbage, but
            # the caller recomputes a failed block.
            self._discard(key, path, identity)
            return failed(f"{path}: {problem}; removed")
        if direct is None:
            self.copier.copy_in([block], target.view(1, nbytes))
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        os.utime(path)
        return OK

    def _discard(self, key: BlockKey, path: Path, identity: os.stat_result) -> None:
        """Remove a block file that failed verification, unless a save has meanwhile
        replaced it with a new one (another inode): that one is sound and stays."""
        self.counters.add("damaged_blocks_removed")
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        if current is None or (current.st_dev, current.st_ino) == (
            identity.st_dev,
            identity.st_ino,
        ):
            self._forget(key)
            path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ misc

    def release(self, keys: list[BlockKey]) -> None:
        for key in keys:
            self._forget(key)
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            self._index.pop(key, None)

    @property
    def block_format(self) -> BlockFormat:
        assert self._format is not None, "register() first"
        return self._format

    def _path(self, key: BlockKey) -> Path:
        assert self._dir is not None
        return self._dir / self.block_format.file_name(key)

    def stats(self) -> dict[str, float]:
        with self._lock:
            stored = len(self._index)
        out: dict[str, float] = {"blocks_stored": stored, "evictions": self.evictions}
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


def _tmp_prefix() -> str:
    """Temporary files carry their writer's pid: instances sharing a store (a
    prefill and a decode on one host) register while others write, and must
    not delete a write still in progress."""
    return f".tmp-{os.getpid()}-"


def _abandoned(name: str) -> bool:
    """A temporary file is left over when its writer is gone: no pid in its name
    (an older kvmux, or none at all) or that process no longer runs."""
    match = re.fullmatch(r"\.tmp-(\d+)-.*", name)
    if match is None:
        return True
    pid = int(match.group(1))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False


def _write_layout(directory: Path, layout: KVLayout) -> None:
    """Create the layout's directory and its ``layout.json`` (rewritten only when it
    differs, so an existing store still opens, and loads, on a full disk)."""
    description = directory / "layout.json"
    text = layout.model_dump_json(indent=1)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if description.exists() and description.read_text() == text:
            return
        fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, description)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise StorageError(
            f"disk: cannot set up the store in {directory}: {_oserror(exc)}"
        ) from exc


def _oserror(exc: OSError) -> str:
    """``ENOSPC (No space left on device)``: the cause alone, without the file name
    (a temporary name differs for every block)."""
    name = errno.errorcode.get(exc.errno or 0)
    reason = exc.strerror or str(exc)
    return f"{name} ({reason})" if name else reason
