"""Turning a name or a config into a live backend.

A name is looked up in exactly one entry-point group; groups never fall through
into each other (``tcp`` is a backend and ``pipes:tcp`` a pipe). Where a
connector config names its backend, a bare name is a ``kvmux.backends`` entry,
and a lookup buffer or pipe (bridged to a backend) is asked for as
``buffers:NAME`` or ``pipes:NAME``. Only the chosen entry point is imported.
Whether the imported object is the kind its caller needs (a Backend, a
Policy...) is the caller's check, :func:`check_kind`: the registry knows
groups, not what lives in them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BeforeValidator, SerializeAsAny, ValidationError, WithJsonSchema

from kvmux.config import BackendConfig
from kvmux.errors import BackendUnavailableError, ConfigError, UnknownBackendError
from kvmux.problems import as_validation_error, problems_of
from kvmux.registry.entries import CONNECTOR_GROUPS, BackendEntry, scan

ConfigLike = Mapping[str, Any] | str | BackendConfig


def resolve(name: str, groups: tuple[str, ...] = CONNECTOR_GROUPS) -> BackendEntry:
    """The winning entry for ``name`` in one group: ``groups[0]`` for a bare name,
    GROUP for ``GROUP:name`` (GROUP one of ``groups``).

    UnknownBackendError otherwise, listing every name ``groups`` accept as it is
    written (:func:`config_name`); a bare name that another of ``groups``
    declares is suggested in its explicit form (``buffers:mooncake-store``).
    """
    prefix, explicit, bare = name.rpartition(":")
    group = prefix if explicit else groups[0]
    found = _winner(group, bare) if group in groups else None
    if found is not None:
        return found
    elsewhere = [] if explicit else [e for g in groups[1:] if (e := _winner(g, bare))]
    suggestion = elsewhere[0].qualified_name if elsewhere else None
    looked_in = group if group in groups else "/".join(groups)
    raise UnknownBackendError(name, looked_in, _known(groups), suggestion=suggestion)


def _winner(group: str, name: str) -> BackendEntry | None:
    return next((e for e in scan(group) if e.name == name and e.shadowed_by is None), None)


def config_name(entry: BackendEntry, groups: tuple[str, ...] = CONNECTOR_GROUPS) -> str:
    """How a config names ``entry`` where ``groups`` are accepted: bare in ``groups[0]``,
    ``group:name`` in the others."""
    return entry.name if entry.group == groups[0] else entry.qualified_name


def _known(groups: tuple[str, ...]) -> list[str]:
    return [config_name(e, groups) for g in groups for e in scan(g) if e.shadowed_by is None]


def load_class(entry: BackendEntry) -> Any:
    """Import the entry's object; BackendUnavailableError with an install hint if it fails.

    The winning entry point alone is imported, even when other distributions
    declare the same name (they are listed as shadowed, never imported).
    """
    reason = entry.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(entry.name, entry.group, reason)
    try:
        return entry.entry_point.load()
    except Exception as exc:
        raise BackendUnavailableError(
            entry.name,
            entry.group,
            f"importing {entry.value} failed: {type(exc).__name__}: {exc}; "
            f"check the installation of {entry.distribution!r} ({entry.install_hint()})",
        ) from exc


def check_kind(entry: BackendEntry, loaded: object, base: type) -> type[Any]:
    """``loaded`` (what ``entry`` names), checked to be a subclass of ``base``, the kind
    its caller needs; BackendUnavailableError naming what it is otherwise. (``base`` is
    a plain ``type``: the kinds are abstract classes, which mypy refuses as ``type[T]``.)"""
    if not (isinstance(loaded, type) and issubclass(loaded, base)):
        raise BackendUnavailableError(
            entry.name,
            entry.group,
            f"entry point names {loaded!r}, which is not a {base.__name__} subclass",
        )
    return loaded


def load_check(entry: BackendEntry) -> str | None:
    """Import the backend for real; the reason it fails, or None. Slow by design."""
    try:
        load_class(entry)
    except BackendUnavailableError as exc:
        return exc.reason
    return None


def config_model_of(cls: type[Any]) -> type[BackendConfig]:
    """The config model a loaded backend class declares (the base model if none)."""
    model: type[BackendConfig] = getattr(cls, "config_model", BackendConfig)
    return model


def config_model_for(name: str) -> type[BackendConfig]:
    """The config model of the backend called ``name`` (imports that backend)."""
    return config_model_of(load_class(resolve(name)))


def parse_config(
    config: ConfigLike, groups: tuple[str, ...] = CONNECTOR_GROUPS
) -> tuple[BackendEntry, Any, BackendConfig]:
    """Validate ``{"backend": NAME, ...}`` against NAME's own config model (a model
    that already is one is returned as it is: validated once)."""
    if isinstance(config, BackendConfig):
        name: Any = config.backend
        data: Mapping[str, Any] | None = None
    else:
        data = _as_mapping(config)
        name = data.get("backend")
    if not isinstance(name, str) or not name:
        raise ConfigError(None, [("backend", "a backend name is required", name)])
    entry = resolve(name, groups)
    cls = load_class(entry)
    model = config_model_of(cls)
    if isinstance(config, model):
        return entry, cls, config
    raw = config.model_dump() if isinstance(config, BackendConfig) else dict(data or {})
    try:
        return entry, cls, model.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(name, problems_of(exc)) from None


def _as_mapping(config: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, str):
        try:
            loaded = json.loads(config)
        except json.JSONDecodeError as exc:
            raise ConfigError(None, [("", f"not valid JSON: {exc}", config)]) from None
        if not isinstance(loaded, dict):
            raise ConfigError(None, [("", "a config must be a JSON object", loaded)])
        return loaded
    if not isinstance(config, Mapping):
        raise ConfigError(None, [("", "a config must be a mapping", config)])
    return config


def nested_config(value: Any) -> BackendConfig:
    """Validate a backend config nested in another one (a MultiBackend's children,
    a wrapper's inner backend) through the registry, like a top-level config.

    Meant as a pydantic ``BeforeValidator``: the nested backend's problems are
    re-raised as one pydantic error each, so pydantic prefixes them with where
    the config sits (``children.1.capacity_bytes``) and the outermost
    :class:`ConfigError` names the full path, nested configs included.
    """
    try:
        _, _, config = parse_config(value)
    except ConfigError as exc:
        problems = exc.problems
    except (UnknownBackendError, BackendUnavailableError) as exc:
        problems = [("backend", str(exc), exc.name)]
    else:
        return config
    raise as_validation_error("nested backend config", problems)


NestedConfig = Annotated[
    SerializeAsAny[BackendConfig],
    BeforeValidator(nested_config),
    WithJsonSchema(
        {
            "type": "object",
            "description": 'a backend config: {"backend": NAME, ...NAME\'s fields}',
            "required": ["backend"],
        }
    ),
]
"""A config field holding another backend's config, validated through the registry."""
