"""The pytest plugin behind ``pytest --kvmux-backend NAME [--kvmux-config JSON]``.

It is registered through the ``pytest11`` entry point, so pytest loads it in
*every* run in an environment where kvmux is installed, including runs of
projects that never heard of kvmux. Hence the rules this module keeps: import
nothing but pytest and the standard library at import time, touch the
registry only when ``--kvmux-backend`` is given, and never change a run that
does not use the suite's fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from kvmux.testing.harness import ConnectorFactory

# Plain asserts in the suite's helpers report their operands like asserts in tests do.
pytest.register_assert_rewrite("kvmux.testing.suite", "kvmux.testing.harness", "kvmux.testing.kv")

REQUIRES_MARKER = "kvmux_requires"

HOW_TO_RUN = (
    "no kvmux backend chosen: run the conformance suite with "
    "`pytest --pyargs kvmux.testing.suite --kvmux-backend NAME [--kvmux-config JSON]`, "
    "or subclass kvmux.testing.suite.ConnectorSuite and define a `connector_factory` fixture"
)


_ACTIVE: list[pytest.Config] = []
"""Configs of the pytest sessions running in this process, innermost last (pytester
nests them), so the suite's module can ask at import time whether a backend was chosen."""


def chosen_backend() -> str | None:
    """``--kvmux-backend`` of the innermost running pytest session, if any."""
    if not _ACTIVE:
        return None
    name: str | None = _ACTIVE[-1].getoption("kvmux_backend")
    return name


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvmux", "kvmux conformance suite")
    group.addoption(
        "--kvmux-backend",
        metavar="NAME",
        default=None,
        help="registered kvmux backend the conformance suite checks (`group:name` qualifies)",
    )
    group.addoption(
        "--kvmux-config",
        metavar="JSON",
        default=None,
        help="JSON object of config fields for --kvmux-backend (default: the backend's "
        "defaults, with a fresh temporary directory for each required path field)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{REQUIRES_MARKER}(*capabilities): kvmux conformance test that runs only when the "
        "backend declares these capabilities ('not NAME' for the opposite)",
    )
    user_config(config)  # a malformed --kvmux-config is a usage error before collection
    name = config.getoption("kvmux_backend")
    if name:
        from kvmux.errors import KvmuxError
        from kvmux.registry.loader import load_class, resolve

        try:
            load_class(resolve(name))
        except KvmuxError as exc:
            raise pytest.UsageError(f"--kvmux-backend {name}: {exc}") from None
    _ACTIVE.append(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config in _ACTIVE:
        _ACTIVE.remove(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = config.getoption("kvmux_backend")
    if not name:
        return []
    from kvmux.registry.loader import resolve

    entry = resolve(name)
    lines = [
        f"kvmux backend: {entry.qualified_name} = {entry.value} "
        f"({entry.distribution} {entry.version})"
    ]
    given = user_config(config)
    lines.append(f"kvmux config: {json.dumps(given) if given else '(backend defaults)'}")
    return lines


def user_config(config: pytest.Config) -> dict[str, Any]:
    """The parsed ``--kvmux-config`` object ({} when not given)."""
    text = config.getoption("kvmux_config")
    if not text:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise pytest.UsageError(f"--kvmux-config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise pytest.UsageError("--kvmux-config must be a JSON object of config fields")
    return data


@pytest.fixture(scope="session")
def kvmux_backend(pytestconfig: pytest.Config) -> str | None:
    """The ``--kvmux-backend`` name, or None when the option was not given."""
    name: str | None = pytestconfig.getoption("kvmux_backend")
    return name


@pytest.fixture
def kvmux_connector_factory(
    kvmux_backend: str | None, pytestconfig: pytest.Config, tmp_path: Path
) -> ConnectorFactory:
    """Builds connectors of the ``--kvmux-backend``; skips the test when none was chosen."""
    if not kvmux_backend:
        pytest.skip(HOW_TO_RUN)
    from kvmux.testing.configs import registry_factory

    return registry_factory(kvmux_backend, user_config(pytestconfig), tmp_path)
