"""Every built-in backend passes the conformance suite.

Each built-in runs the whole suite in this process by subclassing (the same
way a third party's tests do), built through the registry exactly as an
engine builds it. A built-in whose module does not import (yet) is skipped
with the reason. Pools are kept small so each backend's run stays quick;
``test_pytest_plugin.py`` runs the suite once more the no-code way, on
defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmux.errors import BackendUnavailableError, UnknownBackendError
from kvmux.registry.loader import load_class, resolve
from kvmux.testing.configs import registry_factory
from kvmux.testing.harness import ConnectorFactory
from kvmux.testing.suite import ConnectorSuite

SMALL_POOL = {"capacity_bytes": 8 * 2**20}

BUILTINS: dict[str, tuple[str, dict[str, Any]]] = {
    "cpu": ("cpu", SMALL_POOL),
    "disk": ("disk", {}),
    "shm": ("shm", SMALL_POOL),
    "tcp": ("tcp", SMALL_POOL),
    "tcp-borrow": ("tcp", {"save_mode": "borrow"}),
    "pipes:tcp": ("pipes:tcp", {}),
}
"""Test id → built-in name and config fields beyond the defaults (the suite invents
``disk``'s path). ``nixl`` and ``mooncake`` run it in their own modules."""


@pytest.fixture(scope="module", params=sorted(BUILTINS))
def builtin(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    name, config = BUILTINS[request.param]
    try:
        load_class(resolve(name))
    except (UnknownBackendError, BackendUnavailableError) as exc:
        pytest.skip(f"built-in {name!r} is not importable yet: {exc}")
    return name, config


class TestBuiltin(ConnectorSuite):
    @pytest.fixture
    def connector_factory(
        self, builtin: tuple[str, dict[str, Any]], tmp_path: Path
    ) -> ConnectorFactory:
        name, config = builtin
        return registry_factory(name, config, tmp_path)
