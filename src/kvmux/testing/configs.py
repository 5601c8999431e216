"""Configs for the suite's registry-driven mode: a backend's defaults, made runnable.

``pytest --kvmux-backend disk`` has to work with no config at all, yet
``disk`` requires a ``path``. Every *required* path-typed field therefore
gets a fresh directory under the test's ``tmp_path`` (so tests never share
storage by accident); everything else comes from the backend's defaults or
``--kvmux-config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmux.config import invent_paths
from kvmux.connector import Connector
from kvmux.registry.factory import create_connector
from kvmux.registry.loader import config_model_for

SUITE_TIMEOUT_S = 10.0
"""``timeout_s`` the suite uses unless the config says otherwise: long enough for a
loaded 2-core machine, short enough that a hung transfer fails a test quickly."""


def suite_config(name: str, given: Mapping[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``{"backend": name, ...given}`` plus whatever required fields the suite can invent."""
    model = config_model_for(name)
    data: dict[str, Any] = {"timeout_s": SUITE_TIMEOUT_S, **given, "backend": name}
    return {**invent_paths(model, data, tmp_path), **data}


@dataclass(frozen=True)
class RegistryFactory:
    """Builds one backend through the registry, exactly as an engine would.

    Every call uses the same ``config`` (so a second instance reopens the same
    storage, or is the other end of a P2P pair); keyword overrides replace
    config fields for that call only. ``config`` is plain data, so the suite
    can also build the backend in another process (a peer it can stop).
    """

    config: Mapping[str, Any]

    def __call__(self, **overrides: Any) -> Connector:
        return create_connector({**self.config, **overrides})


def registry_factory(name: str, given: Mapping[str, Any], tmp_path: Path) -> RegistryFactory:
    """A :class:`RegistryFactory` building ``name`` on :func:`suite_config`."""
    return RegistryFactory(suite_config(name, given, tmp_path))
