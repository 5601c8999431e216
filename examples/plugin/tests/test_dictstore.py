"""The conformance suite, the subclassing way: one fixture that builds the backend."""

from __future__ import annotations

from typing import Any

import pytest
from kvmux_example.dictstore import DictStoreBackend, DictStoreConfig

from kvmux.testing.suite import ConnectorSuite


class TestDictStore(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self) -> Any:
        def make(**overrides: Any) -> DictStoreBackend:
            return DictStoreBackend(DictStoreConfig(timeout_s=5, **overrides))

        return make
