"""Named shared-memory segments in ``/dev/shm`` that hold an ``shm`` connector's pool.

Why files in ``/dev/shm`` and not ``multiprocessing.shared_memory``: on
Python 3.11 a process that merely *attaches* to a SharedMemory registers it
with its resource tracker, which unlinks the producer's segment when the
consumer exits. A plain ``mmap`` of the file has no such side effect.

Layout of a segment: one page of header (``_MAGIC`` and the owner's random
token, which a consumer checks to be sure it mapped the segment its peer
meant), then the slots' *versions* (one little-endian uint64 per slot, bumped
by the owner before it overwrites the slot: what lets a consumer copy a slot
without pinning it and then check nobody wrote it meanwhile, see
:mod:`kvmux.backends.shm`), then the pool, ``slots * block_nbytes`` bytes,
both page aligned.

Leaks: the owner unlinks the file on ``close()``, and a finalizer does it at
interpreter exit if close was never called. A process killed outright (OOM,
SIGKILL) cannot; for that, the owner holds an exclusive ``flock`` on the file
for the segment's life (the kernel drops it when the process dies, whatever
the PID namespace), and every new segment first unlinks any ``kvmux-*``
segment whose lock it can take: those have no living owner. A segment gets
its final name only after it is locked, so a half-made one is never swept.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import warnings
import weakref
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from kvmux.addressing import Ids
from kvmux.errors import CapacityError, TransferError

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
HEADER_NBYTES = mmap.PAGESIZE
_MAGIC = b"KVMXSEG1"
VERSION_NBYTES = 8


def _page_up(nbytes: int) -> int:
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


def host_id() -> str:
    """Identity of the running kernel and of the ``/dev/shm`` this process sees: two
    processes with different ids cannot share a segment (other machines, or
    containers / namespaces with a ``/dev/shm`` of their own). The same id does
    not prove they share ``/dev/shm``; the segment token check does."""
    try:
        kernel = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        kernel = socket.gethostname()
    try:
        shm = os.stat(SHM_DIR)
    except OSError:
        return kernel
    return f"{kernel}/shm-{shm.st_dev:x}"


class OwnedSegment:
    """The producer's segment: created, locked and sized up front; unlinked on close."""

    def __init__(self, slots: int, block_nbytes: int) -> None:
        sweep_orphans()
        self.name = f"kvmux-{os.getpid()}-{secrets.token_hex(8)}"
        self.token = secrets.token_hex(16)
        self.path = SHM_DIR / self.name
        self.versions_offset = HEADER_NBYTES
        self.offset = HEADER_NBYTES + _page_up(slots * VERSION_NBYTES)
        size = self.offset + slots * block_nbytes
        staging = SHM_DIR / f".{self.name}.new"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:  # reserve every page now: a full /dev/shm fails here, not as SIGBUS later
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise CapacityError(
                    f"cannot reserve {size} bytes in {SHM_DIR}: {exc}; lower capacity_bytes "
                    f"or enlarge {SHM_DIR}"
                ) from None
            os.pwrite(fd, _MAGIC + bytes.fromhex(self.token), 0)
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            os.rename(staging, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        self._fd = fd  # holds the lock that marks the segment as alive
        self.pool = torch.frombuffer(
            self._mmap, dtype=torch.uint8, offset=self.offset, count=slots * block_nbytes
        ).view(slots, block_nbytes)
        self.versions: npt.NDArray[np.uint64] = np.frombuffer(
            self._mmap, dtype="<u8", count=slots, offset=self.versions_offset
        )
        """Each slot's version: bumped (``bump``) before the slot is overwritten."""
        self._finalizer = weakref.finalize(self, _remove, self.path, fd)

    def bump(self, rows: Ids) -> None:
        """Mark ``rows`` as about to be overwritten. Called before the first byte of
        them changes, so a consumer that read a row's version, then its bytes, then
        the version again sees a change if any byte it copied was new (x86's store
        order: see :mod:`kvmux.backends.shm`)."""
        self.versions[rows] += np.uint64(1)

    def close(self) -> None:
        """Unlink the segment and drop the lock. Mappings (ours while a tensor still
        views it, consumers') stay valid until unmapped; the memory goes with the last."""
        self._finalizer()


def _remove(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    os.close(fd)


class MappedSegment:
    """A consumer's read-only mapping of a producer's segment."""

    def __init__(
        self,
        name: str,
        token: str,
        offset: int,
        slots: int,
        block_nbytes: int,
        versions_offset: int | None = None,
    ) -> None:
        self.name = name
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise TransferError(
                f"cannot open the producer's segment {path}: {exc} (is the producer on this "
                f"host, with the same {SHM_DIR}?)"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size < offset + slots * block_nbytes or (
                versions_offset is not None and size < versions_offset + slots * VERSION_NBYTES
            ):
                raise TransferError(f"segment {path} is {size} bytes, smaller than announced")
            # Populated up front: faulting pages in one at a time during copies
            # costs several times the copy itself (about 0.2 s per 256 MiB).
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            mapped = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mapped[: len(_MAGIC) + 16] != _MAGIC + bytes.fromhex(token):
            raise TransferError(f"segment {path} is not the one the producer announced")
        with warnings.catch_warnings():  # read-only by design; torch warns about that
            warnings.simplefilter("ignore", UserWarning)
            self.pool = torch.frombuffer(
                mapped, dtype=torch.uint8, offset=offset, count=slots * block_nbytes
            ).view(slots, block_nbytes)
        self.versions: npt.NDArray[np.uint64] | None = None
        """The producer's slot versions, where it announced them (read-only)."""
        if versions_offset is not None:
            self.versions = np.frombuffer(mapped, dtype="<u8", count=slots, offset=versions_offset)


def sweep_orphans() -> int:
    """Unlink segments whose owner died without closing them; how many went."""
    removed = 0
    for path in SHM_DIR.glob("kvmux-*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its owner is alive
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
                log.info("removed orphaned shared-memory segment %s", path)
        finally:
            os.close(fd)
    return removed
