"""Config: one pydantic model per backend, all sharing this base.

The registry picks the model from the ``backend`` field, so a config is plain
data (a dict, a JSON string, a vLLM ``kv_connector_extra_config``) until it is
validated, and a bad field is reported with the backend's name, the field path
and the value.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo


class BackendConfig(BaseModel):
    """Fields every backend understands. Subclass it and add your own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = Field(description="registered name of the backend")
    timeout_s: float = Field(
        30.0, gt=0, description="deadline for one transfer; past it the keys fail, never hang"
    )

    @property
    def borrows_blocks(self) -> bool:
        """Whether saves keep the engine's blocks until they are returned
        (``Capabilities.borrows_blocks``), read from the config alone: an engine's
        scheduler plans around it without building the backend."""
        return False


def invent_paths(
    model: type[BackendConfig], given: Mapping[str, Any], tmp_path: Path
) -> dict[str, str]:
    """A fresh path under ``tmp_path`` for each required path field ``given`` lacks.

    Lets tools that build a backend from its defaults alone (the conformance
    suite, ``kvmux bench``) give a ``disk``-like backend a scratch directory.
    """
    invented: dict[str, str] = {}
    for field, info in model.model_fields.items():
        if field in given or not info.is_required():
            continue
        path = _fresh_path(field, info, tmp_path)
        if path is not None:
            invented[field] = str(path)
    return invented


def _fresh_path(field: str, info: FieldInfo, tmp_path: Path) -> Path | None:
    """A new directory for a path field (a path that does not exist yet for
    pydantic's ``NewPath``); None for fields no tool can invent."""
    if not _is_path(info.annotation):
        return None
    kinds = {getattr(m, "path_type", None) for m in info.metadata}
    if "file" in kinds:
        return None  # an existing file with backend-specific content: only the user knows it
    path = tmp_path / f"kvmux-{field}"
    if "new" not in kinds:
        path.mkdir(parents=True, exist_ok=True)
    return path


def _is_path(annotation: Any) -> bool:
    if isinstance(annotation, type):
        return issubclass(annotation, PurePath)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_path(arg) for arg in typing.get_args(annotation) if arg is not type(None))
    return False
