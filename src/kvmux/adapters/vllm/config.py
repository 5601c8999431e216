"""The adapter's share of ``kv_connector_extra_config``.

vLLM hands a connector one free-form dict. kvmux reads it as a backend config
(``{"backend": "shm", ...}``, exactly what ``create_connector`` takes) plus an
optional ``"vllm"`` object with the adapter's own options, so a user who knows
kvmux's config already knows this one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmux.config import BackendConfig
from kvmux.errors import ConfigError, KvmuxError
from kvmux.problems import problems_of
from kvmux.registry import parse_config

ADAPTER_KEY = "vllm"
#: Where vLLM keeps the object this module reads; error paths start here.
EXTRA_CONFIG = "kv_connector_extra_config"


class AdapterOptions(BaseModel):
    """How the adapter drives the backend; every field has a safe default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str | None = Field(
        None,
        description=(
            "names the model in every block key; instances share blocks only when it is "
            "equal. Default: model name, dtype, KV dtype and block size"
        ),
    )
    lease_s: float = Field(
        120.0,
        gt=0,
        description=(
            "longest the producer keeps a finished request's blocks for a consumer that "
            "never pulls; then the backend is told to release them"
        ),
    )
    save_generated: bool = Field(
        True, description="also save blocks filled by generated tokens (multi-turn reuse)"
    )


_validated: dict[str, tuple[BackendConfig, AdapterOptions]] = {}
"""Extra configs this process has validated, by their canonical JSON text."""


def split_extra_config(extra: Mapping[str, Any] | None) -> tuple[BackendConfig, AdapterOptions]:
    """Validate ``kv_connector_extra_config``; errors name the field path and value.

    Once per process and config: vLLM's factory resolves the connector class
    (where :mod:`~kvmux.adapters.vllm.preflight` checks the config) right before
    it builds the connector of each role, which reads the same config again; the
    second read gets the first's result (both models are frozen). Validation
    imports the backend and, for a ``multi``, every child and the policy. A
    refused config is not remembered: it raises each time.
    """
    key = json.dumps(extra or {}, sort_keys=True, default=str)
    found = _validated.get(key)
    if found is None:
        found = _validated[key] = _validate(dict(extra or {}))
    return found


def _validate(data: dict[str, Any]) -> tuple[BackendConfig, AdapterOptions]:
    if "backend" not in data:
        raise ConfigError(
            None,
            [
                (
                    f"{EXTRA_CONFIG}.backend",
                    'name a kvmux backend, e.g. {"backend": "shm"} (see `kvmux list`)',
                    None,
                )
            ],
        )
    raw_options = data.pop(ADAPTER_KEY, None) or {}
    try:
        options = AdapterOptions.model_validate(raw_options)
    except ValidationError as exc:
        raise ConfigError("vllm adapter", problems_of(exc, under=ADAPTER_KEY)) from None
    _, _, backend = parse_config(data)
    return backend, options


class ExtraConfigError(KvmuxError, RuntimeError):
    """``kv_connector_extra_config`` that kvmux refuses, found while vLLM builds its config.

    One line naming the full path and the value, so it can be the last line a
    failing server prints. Not a ``ValueError`` on purpose: vLLM builds its
    config inside pydantic validation, which turns a ``ValueError`` into a
    ``ValidationError`` and buries the message under its own lines. The error
    kvmux found is its ``__cause__``.
    """

    @classmethod
    def from_error(cls, exc: KvmuxError) -> ExtraConfigError:
        if isinstance(exc, ConfigError):
            problems = "; ".join(
                f"{_full_path(path)}: {msg} (got {value!r})" for path, msg, value in exc.problems
            )
        else:  # the backend name: unknown, or its code cannot be imported here
            problems = f"{EXTRA_CONFIG}.backend: {exc}"
        return cls(" ".join(f"invalid kvmux config in {EXTRA_CONFIG}: {problems}".split()))


def _full_path(path: str) -> str:
    if path.startswith(EXTRA_CONFIG):
        return path
    return f"{EXTRA_CONFIG}.{path}" if path else EXTRA_CONFIG
