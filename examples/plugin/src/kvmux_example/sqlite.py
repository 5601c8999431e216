"""``sqlite``: a LookupBuffer in an SQLite file, the database-like plug-in level.

``insert`` is one INSERT; ``drop_select`` polls SELECT + DELETE in a single
write transaction until the key appears or the timeout passes, so a block is
handed to exactly one reader even when several processes share the file.
Tensors are stored as dtype name, shape and raw bytes (never pickled) and
validated when read back. kvmux wraps this buffer in a ``BufferBackend``
when a config names ``sqlite``.
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
import time
from pathlib import Path

import torch
from pydantic import Field

from kvmux.buffer import LookupBuffer
from kvmux.capabilities import Capabilities
from kvmux.config import BackendConfig
from kvmux.errors import ClosedError, ProtocolError
from kvmux.keys import BlockKey
from kvmux.layout import dtype_name, torch_dtype

DEFAULT_FILE = "kvmux.sqlite3"


class SqliteConfig(BackendConfig):
    backend: str = "buffers:sqlite"
    path: Path = Field(description=f"database file, or a directory to hold {DEFAULT_FILE}")
    poll_s: float = Field(0.005, gt=0, description="interval at which drop_select re-checks")


class SqliteBuffer(LookupBuffer):
    """Blocks in an SQLite table; survives restarts, shareable between processes."""

    config_model = SqliteConfig
    capabilities = Capabilities(persistent=True, consumes_on_load=True)
    config: SqliteConfig

    def __init__(self, config: SqliteConfig) -> None:
        super().__init__(config)
        file = config.path / DEFAULT_FILE if config.path.is_dir() else config.path
        file.parent.mkdir(parents=True, exist_ok=True)
        # One connection, serialised by a lock: simple, and SQLite serialises writers anyway.
        self._db = sqlite3.connect(
            file, timeout=config.timeout_s, isolation_level=None, check_same_thread=False
        )
        self._lock = threading.Lock()
        self._closed = False
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS blocks (key TEXT PRIMARY KEY, dtype TEXT NOT NULL,"
                " shape TEXT NOT NULL, data BLOB NOT NULL)"
            )

    def insert(self, key: BlockKey, tensor: torch.Tensor) -> None:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        row = (
            key.id,
            dtype_name(flat.dtype),
            json.dumps(list(tensor.shape)),
            flat.view(torch.uint8).numpy().tobytes(),
        )
        with self._lock:
            self._check_open()
            self._db.execute("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", row)

    def drop_select(self, key: BlockKey, timeout: float) -> torch.Tensor | None:
        deadline = time.monotonic() + timeout
        while True:
            row = self._take(key)
            if row is not None:
                return _decode(*row)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(self.config.poll_s, left))

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            self._check_open()
            cur = self._db.execute("SELECT 1 FROM blocks WHERE key = ?", (key.id,))
            return cur.fetchone() is not None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._db.close()

    def _take(self, key: BlockKey) -> tuple[str, str, bytes] | None:
        """SELECT and DELETE the row in one transaction: one reader gets each block."""
        with self._lock:
            self._check_open()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                cur = self._db.execute(
                    "SELECT dtype, shape, data FROM blocks WHERE key = ?", (key.id,)
                )
                row: tuple[str, str, bytes] | None = cur.fetchone()
                if row is not None:
                    self._db.execute("DELETE FROM blocks WHERE key = ?", (key.id,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return row

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("sqlite buffer is closed")


def _decode(dtype: str, shape_json: str, data: bytes) -> torch.Tensor:
    """Rebuild a stored tensor, refusing rows whose parts disagree (a damaged file)."""
    shape = json.loads(shape_json)
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"stored shape is not a list of sizes: {shape_json!r}")
    kind = torch_dtype(dtype)
    if len(data) != math.prod(shape) * torch.empty((), dtype=kind).element_size():
        raise ProtocolError(f"stored block of {len(data)} bytes does not fit {dtype}{shape}")
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)
