"""Configs: bad fields are refused naming the backend and the field; good ones round-trip.

Validation through the registry (``{"backend": NAME, ...}``) is what engines
use. A backend given to the suite by a custom factory under a name the
registry does not resolve to its config model is checked on the model alone.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvmux.config import BackendConfig
from kvmux.connector import Connector
from kvmux.errors import ConfigError, KvmuxError
from kvmux.registry.loader import load_class, parse_config, resolve
from kvmux.testing.harness import Harness
from kvmux.testing.suite.base import SuiteBase

BOGUS = "kvmux_suite_no_such_field"


def _registry_validates(conn: Connector) -> bool:
    """Whether ``conn.config.backend`` resolves to a class with ``conn``'s config model."""
    try:
        cls = load_class(resolve(conn.config.backend))
    except KvmuxError:
        return False
    return getattr(cls, "config_model", None) is type(conn.config)


def _refused(conn: Connector, data: dict[str, Any]) -> str:
    """Validate ``data`` as ``conn``'s config; the error text (fails if it is accepted)."""
    if _registry_validates(conn):
        with pytest.raises(ConfigError) as info:
            parse_config(data)
        assert info.value.backend == conn.config.backend
        return str(info.value)
    with pytest.raises(ValidationError) as raw:
        type(conn.config).model_validate(data)
    return str(raw.value)


class BadConfigTests(SuiteBase):
    def test_unknown_config_field_is_refused_naming_backend_and_field(
        self, harness: Harness
    ) -> None:
        conn = harness.open()
        message = _refused(conn, {**conn.config.model_dump(mode="json"), BOGUS: 1})
        assert BOGUS in message
        if _registry_validates(conn):
            assert repr(conn.config.backend) in message

    def test_invalid_timeout_is_refused_naming_the_field(self, harness: Harness) -> None:
        conn = harness.open()
        message = _refused(conn, {**conn.config.model_dump(mode="json"), "timeout_s": -1})
        assert "timeout_s" in message

    def test_config_round_trips_through_json(self, harness: Harness) -> None:
        """Configs travel as JSON (vLLM's ``kv_connector_extra_config``)."""
        conn = harness.open()
        model: type[BackendConfig] = type(conn.config)
        assert model.model_validate_json(conn.config.model_dump_json()) == conn.config
        if _registry_validates(conn):
            _, _, parsed = parse_config(conn.config.model_dump_json())
            assert parsed == conn.config
