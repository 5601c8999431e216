"""Capability requirements: SQLAlchemy-style honest skips for the conformance suite.

A test that relies on a promise only some backends make says so with
``@requires("persistent")`` (or ``requires("not consumes_on_load")``); where
the backend's :class:`~kvmux.capabilities.Capabilities` does not make that
promise the test is skipped with a message naming the capability, so a report
shows what was *not* checked and why, instead of a silent pass.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

import pytest

from kvmux.capabilities import Capabilities
from kvmux.testing.plugin import REQUIRES_MARKER

FLAGS: frozenset[str] = frozenset(f.name for f in fields(Capabilities) if f.type in ("bool", bool))
"""Capability names a requirement may use: the boolean fields of Capabilities."""


def _parse(requirement: str) -> tuple[str, bool]:
    """``"persistent"`` → (persistent, True); ``"not consumes_on_load"`` → (..., False)."""
    negated = requirement.startswith("not ")
    name = requirement.removeprefix("not ").strip()
    if name not in FLAGS:
        raise ValueError(
            f"unknown capability {name!r} in requirement {requirement!r}; "
            f"known: {', '.join(sorted(FLAGS))}"
        )
    return name, not negated


def requires(*requirements: str) -> pytest.MarkDecorator:
    """Mark a suite test as needing these capabilities (checked when the test runs)."""
    for requirement in requirements:
        _parse(requirement)  # a typo fails at import, not as a mysterious skip
    mark: pytest.MarkDecorator = getattr(pytest.mark, REQUIRES_MARKER)(*requirements)
    return mark


def unmet(capabilities: Capabilities, requirements: Iterable[str], backend: str) -> str | None:
    """The skip message for the first requirement ``capabilities`` fails, else None."""
    for requirement in requirements:
        name, wanted = _parse(requirement)
        if bool(getattr(capabilities, name)) != wanted:
            return (
                f"requires capability {requirement!r} "
                f"({backend} declares {name}={getattr(capabilities, name)})"
            )
    return None
