"""Pydantic's validation errors as kvmux's config problems, and back: one conversion.

A problem is ``(path, message, value)`` (:data:`~kvmux.errors.ConfigProblem`), the
unit a :class:`~kvmux.errors.ConfigError` reports; ``path`` is dotted
(``children.1.capacity_bytes``). Going back to a ``ValidationError`` is for problems
found inside another model's validation (a nested backend config, a multi's policy
rules): raised as pydantic errors, pydantic prefixes each with where it sits, so the
outermost error names the full path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from kvmux.errors import ConfigProblem


def dotted(loc: Sequence[str | int]) -> str:
    """``("children", 1, "path")`` as ``"children.1.path"``."""
    return ".".join(str(part) for part in loc)


def problems_of(exc: ValidationError, under: str = "") -> list[ConfigProblem]:
    """Each of pydantic's errors as a problem; ``under`` prefixes every path (where the
    validated object sits in a larger config)."""
    return [
        (dotted([*([under] if under else []), *err["loc"]]), err["msg"], err.get("input"))
        for err in exc.errors()
    ]


def as_validation_error(title: str, problems: Iterable[ConfigProblem]) -> ValidationError:
    """The problems as one pydantic ``ValidationError`` (messages kept verbatim), for
    raising inside a validator; ``title`` names the model in pydantic's own rendering."""
    return ValidationError.from_exception_data(
        title,
        [
            InitErrorDetails(
                type=PydanticCustomError("kvmux_config", "{message}", {"message": message}),
                loc=_loc(path),
                input=value,
            )
            for path, message, value in problems
        ],
    )


def _loc(path: str) -> tuple[str | int, ...]:
    return tuple(int(part) if part.isdigit() else part for part in path.split(".") if part)
