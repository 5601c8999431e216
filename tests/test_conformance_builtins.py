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

BUILTINS: dict[str, dict[str, Any]] = {
    "cpu": SMALL_POOL,
    "disk": {},
    "shm": SMALL_POOL,
    "tcp": SMALL_POOL,
    "pipes:tcp": {},
}
"""Built-in name → config fields beyond the defaults (the suite invents ``disk``'s path)."""


@pytest.fixture(scope="module", params=sorted(BUILTINS))
def builtin(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    try:
        load_class(resolve(name))
    except (UnknownBackendError, BackendUnavailableError) as exc:
        pytest.skip(f"built-in {name!r} is not importable yet: {exc}")
    return name


class TestBuiltin(ConnectorSuite):
    @pytest.fixture
    def connector_factory(self, builtin: str, tmp_path: Path) -> ConnectorFactory:
        return registry_factory(builtin, BUILTINS[builtin], tmp_path)
