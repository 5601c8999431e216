"""Turning a name or a config into a live backend.

Resolution order for a connector name: the ``kvmux.connectors`` group, then
``kvmux.buffers`` (wrapped in a BufferBackend), then ``kvmux.pipes``
(wrapped in a PipeLookupBuffer and a BufferBackend). ``group:name``
(``pipes:tcp``) picks a group explicitly. Only the chosen entry point is
imported, through stevedore's DriverManager.
"""

from __future__ import annotations

import importlib.metadata as md
import json
from collections.abc import Mapping
from typing import Annotated, Any, cast

from pydantic import BeforeValidator, SerializeAsAny, ValidationError, WithJsonSchema
from pydantic_core import InitErrorDetails, PydanticCustomError
from stevedore import driver
from stevedore.exception import NoUniqueMatch

from kvmux.config import BackendConfig
from kvmux.errors import BackendUnavailableError, ConfigError, UnknownBackendError
from kvmux.registry.entries import GROUPS, BackendEntry, entry_point_group, scan

ConfigLike = Mapping[str, Any] | str | BackendConfig

_CONNECTOR_SEARCH = ("connectors", "buffers", "pipes")


def resolve(name: str, groups: tuple[str, ...] = _CONNECTOR_SEARCH) -> BackendEntry:
    """The winning entry for ``name`` (optionally ``group:name``) in the first group
    that declares it; UnknownBackendError with the known names otherwise."""
    group_prefix, sep, bare = name.rpartition(":")
    if sep:
        if group_prefix not in GROUPS:
            raise UnknownBackendError(name, "/".join(groups), _known(groups))
        groups = (group_prefix,)
        name = bare
    for group in groups:
        for entry in scan(group):
            if entry.name == name and entry.shadowed_by is None:
                return entry
    raise UnknownBackendError(name, "/".join(groups), _known(groups))


def load_class(entry: BackendEntry) -> type[Any]:
    """Import the entry's object; BackendUnavailableError with an install hint if it fails."""
    reason = entry.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(entry.name, entry.group, reason)
    if any(e.name == entry.name and e.shadowed_by for e in scan(entry.group)):
        return _load_winner(entry)
    failures: list[BaseException] = []

    def on_failure(_mgr: object, _ep: object, exc: BaseException) -> None:
        failures.append(exc)

    try:
        mgr: driver.DriverManager[Any] = driver.DriverManager(
            namespace=entry_point_group(entry.group),
            name=entry.name,
            invoke_on_load=False,
            on_load_failure_callback=on_failure,
        )
        loaded: type[Any] = cast(type[Any], mgr.driver)
    except NoUniqueMatch as exc:
        raise _import_failed(entry, failures[0] if failures else exc) from None
    return loaded


def _load_winner(entry: BackendEntry) -> type[Any]:
    """Several distributions declare the name: import only the winner's entry point
    (stevedore's DriverManager would import every claimant and refuse)."""
    for ep in md.entry_points(group=entry_point_group(entry.group), name=entry.name):
        if ep.dist is not None and ep.dist.metadata["Name"] == entry.distribution:
            try:
                loaded: type[Any] = ep.load()
            except Exception as exc:
                raise _import_failed(entry, exc) from exc
            return loaded
    raise BackendUnavailableError(entry.name, entry.group, "entry point vanished")


def _import_failed(entry: BackendEntry, cause: BaseException) -> BackendUnavailableError:
    return BackendUnavailableError(
        entry.name,
        entry.group,
        f"importing {entry.value} failed: {type(cause).__name__}: {cause}; "
        f"check the installation of {entry.distribution!r} ({entry.install_hint()})",
    )


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
    config: ConfigLike, groups: tuple[str, ...] = _CONNECTOR_SEARCH
) -> tuple[BackendEntry, type[Any], BackendConfig]:
    """Validate ``{"backend": NAME, ...}`` against NAME's own config model."""
    data = _as_mapping(config)
    name = data.get("backend")
    if not isinstance(name, str) or not name:
        raise ConfigError(None, [("backend", "a backend name is required", name)])
    entry = resolve(name, groups)
    cls = load_class(entry)
    model = config_model_of(cls)
    if isinstance(config, model):
        return entry, cls, config
    try:
        return entry, cls, model.model_validate(dict(data))
    except ValidationError as exc:
        problems = [
            (".".join(str(part) for part in err["loc"]), err["msg"], err.get("input"))
            for err in exc.errors()
        ]
        raise ConfigError(name, problems) from None


def _as_mapping(config: ConfigLike) -> Mapping[str, Any]:
    if isinstance(config, BackendConfig):
        return config.model_dump()
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


def _known(groups: tuple[str, ...]) -> list[str]:
    return [e.name for g in groups for e in scan(g) if e.shadowed_by is None]


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
        details = [_error_detail(path, msg, got) for path, msg, got in exc.problems]
    except (UnknownBackendError, BackendUnavailableError) as exc:
        details = [_error_detail("backend", str(exc), exc.name)]
    else:
        return config
    raise ValidationError.from_exception_data("nested backend config", details)


def _error_detail(path: str, msg: str, value: Any) -> InitErrorDetails:
    loc = tuple(int(part) if part.isdigit() else part for part in path.split(".") if part)
    return InitErrorDetails(
        type=PydanticCustomError("nested_config", "{message}", {"message": msg}),
        loc=loc,
        input=value,
    )


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
