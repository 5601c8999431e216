"""Fixtures shared by every conformance test class.

A backend's own tests override ``connector_factory`` (and ``kv_device`` for
GPU memory); without an override the factory comes from the pytest plugin's
``--kvmux-backend`` option, and the test is skipped, with instructions,
when that option is absent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from kvmux.testing.harness import ConnectorFactory, Harness
from kvmux.testing.plugin import REQUIRES_MARKER
from kvmux.testing.requirements import unmet


class SuiteBase:
    @pytest.fixture
    def connector_factory(self, kvmux_connector_factory: ConnectorFactory) -> ConnectorFactory:
        """``factory(**config_overrides) -> Backend`` (or Connector), each call a
        fresh instance on the same config. Override this fixture to check a backend
        without the registry."""
        return kvmux_connector_factory

    @pytest.fixture
    def peer_config(self, connector_factory: ConnectorFactory) -> Mapping[str, Any] | None:
        """The registry config (``{"backend": NAME, ...}``) that builds this backend in
        another process, for tests with a peer they can stop; None skips those tests.
        Default: the factory's ``config`` (a registry factory's); override it for a
        factory of your own."""
        config = getattr(connector_factory, "config", None)
        return dict(config) if isinstance(config, Mapping) else None

    @pytest.fixture
    def kv_device(self) -> str:
        """Device of the KV tensors the suite registers (``"cpu"``; ``"cuda"`` for GPU backends)."""
        return "cpu"

    @pytest.fixture
    def harness(
        self, connector_factory: ConnectorFactory, kv_device: str, request: pytest.FixtureRequest
    ) -> Iterator[Harness]:
        harness = Harness(connector_factory, kv_device, request.node.nodeid)
        yield harness
        harness.close()

    @pytest.fixture(autouse=True)
    def _kvmux_requirements(self, request: pytest.FixtureRequest) -> None:
        """Skip, naming the capability, a test whose ``requires(...)`` the backend fails."""
        wanted = [r for mark in request.node.iter_markers(REQUIRES_MARKER) for r in mark.args]
        if not wanted:
            return
        harness: Harness = request.getfixturevalue("harness")
        reason = unmet(harness.capabilities, wanted, harness.backend_label)
        if reason is not None:
            pytest.skip(reason)
