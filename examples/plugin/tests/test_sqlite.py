"""The conformance suite on the sqlite LookupBuffer, bridged to a Connector.

The factory builds what the registry builds for ``{"backend": "buffers:sqlite"}``: a
``BufferBackend`` around the buffer. Every instance opens the same file, so
the suite's reopen tests see the blocks persist.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from kvmux_example.sqlite import SqliteBuffer, SqliteConfig

from kvmux.bridges import BufferBackend
from kvmux.connector import Connector
from kvmux.keys import BlockKey
from kvmux.testing.suite import ConnectorSuite


class TestSqliteBuffer(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self, tmp_path: Path) -> Any:
        def make(**overrides: Any) -> Connector:
            config = SqliteConfig(path=tmp_path, timeout_s=5, **overrides)
            return Connector(BufferBackend(SqliteBuffer(config), config))

        return make


def test_two_buffers_on_one_file_hand_each_block_to_one_reader(tmp_path: Path) -> None:
    config = SqliteConfig(path=tmp_path / "shared.db")
    writer, reader = SqliteBuffer(config), SqliteBuffer(config)
    key = BlockKey(b"k" * 32)
    writer.insert(key, torch.arange(6, dtype=torch.int16).reshape(2, 3))
    assert reader.contains(key)
    got = reader.drop_select(key, timeout=1)
    assert got is not None and got.equal(torch.arange(6, dtype=torch.int16).reshape(2, 3))
    assert writer.drop_select(key, timeout=0.05) is None
    writer.close()
    reader.close()


def test_drop_select_waits_for_a_late_insert(tmp_path: Path) -> None:
    buffer = SqliteBuffer(SqliteConfig(path=tmp_path))
    key = BlockKey(b"late" * 8)
    threading.Timer(0.1, buffer.insert, (key, torch.ones(4))).start()
    got = buffer.drop_select(key, timeout=5)
    assert got is not None and got.equal(torch.ones(4))
    buffer.close()
