"""The served pools as compositions: a store, a server started by register, a transport."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest

from kvmux.pool.served import ServedPoolBackend
from kvmux.registry import create_connector
from kvmux.testing.peer import make_caches, make_layout

NET = Path(__file__).resolve().parents[1] / "src" / "kvmux" / "net"


def _server_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.endswith("-accept")}


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_the_server_starts_at_register_and_stops_at_close(backend: str) -> None:
    before = _server_threads()
    conn = create_connector({"backend": backend})
    assert isinstance(conn.backend, ServedPoolBackend)
    assert _server_threads() == before, "a server thread started before register"
    assert conn.address() is None
    assert conn.health().healthy
    caches = make_caches(0, 4)
    conn.register(make_layout(caches), caches)
    started = _server_threads() - before
    assert len(started) == 1
    address = conn.address()
    assert address is not None and address["port"] > 0
    conn.close()
    for thread in started:
        thread.join(5)
        assert not thread.is_alive()


def test_net_is_wire_code_that_imports_no_backend_and_no_pool() -> None:
    for path in sorted(NET.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                assert not node.module.startswith(("kvmux.backends", "kvmux.pool")), (
                    f"{path.name} imports {node.module}"
                )
