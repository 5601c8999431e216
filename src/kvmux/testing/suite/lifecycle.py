"""Close, reuse and health: what an engine relies on at shutdown and restart."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from kvmux.connector import Connector
from kvmux.errors import ClosedError
from kvmux.net.advertise import WILDCARDS
from kvmux.testing.harness import Harness
from kvmux.testing.requirements import requires
from kvmux.testing.suite.base import SuiteBase


def _after_close(conn: Connector, memory: Any, keys: Any) -> dict[str, Callable[[], object]]:
    return {
        "lookup": lambda: conn.lookup(keys),
        "save": lambda: conn.save(keys, [0]),
        "load": lambda: conn.load(keys, [0]),
        "release": lambda: conn.release(keys),
        "register": lambda: conn.register(memory.layout, memory.caches),
    }


class LifecycleTests(SuiteBase):
    def test_close_is_idempotent(self, harness: Harness) -> None:
        pair = harness.pair()
        pair.save_all(harness.keys(2), [0, 1])
        for conn in (pair.loader, pair.saver, pair.loader, pair.saver):
            conn.close()

    def test_calls_after_close_raise_closed_error(self, harness: Harness) -> None:
        pair = harness.pair()
        keys = harness.keys(1)
        pair.save_all(keys, [0])
        for conn, memory in ((pair.loader, pair.dst), (pair.saver, pair.src)):
            conn.close()
            for name, call in _after_close(conn, memory, keys).items():
                try:
                    call()
                except ClosedError:
                    continue
                pytest.fail(f"{name}() after close() did not raise ClosedError")

    def test_health_is_good_while_open_and_bad_after_close(self, harness: Harness) -> None:
        pair = harness.pair()
        assert pair.saver.health().healthy, pair.saver.health().detail
        pair.saver.close()
        assert not pair.saver.health().healthy

    def test_context_manager_closes_the_connector(self, harness: Harness) -> None:
        with harness.open() as conn:
            assert conn.health().healthy
        assert not conn.health().healthy
        with pytest.raises(ClosedError):
            conn.lookup(harness.keys(1))

    def test_a_new_instance_from_the_same_config_works_after_close(self, harness: Harness) -> None:
        first = harness.pair()
        first.save_all(harness.keys(2), [0, 1])
        first.loader.close()
        first.saver.close()
        second = harness.pair()
        keys = harness.keys(3)
        expected = second.save_all(keys, [0, 1, 2])
        second.load_and_verify(keys, [5, 6, 7], expected)

    @requires("p2p")
    def test_p2p_address_is_a_json_object(self, harness: Harness) -> None:
        pair = harness.pair()
        address = pair.saver.address()
        assert isinstance(address, dict), f"address() returned {address!r}"
        assert json.loads(json.dumps(address)) == address

    @requires("p2p")
    def test_p2p_address_never_names_a_wildcard_host(self, harness: Harness) -> None:
        """A consumer on another host dials what ``address()`` says: a host of
        ``0.0.0.0`` or ``::`` (where a server listens, not where it is) reaches
        nobody. Name a reachable address (kvmux's servers: ``advertise``)."""
        address = harness.pair().saver.address()
        assert isinstance(address, dict), f"address() returned {address!r}"
        host = address.get("host")
        assert host not in WILDCARDS, f"address() names the wildcard host {host!r}: {address}"
