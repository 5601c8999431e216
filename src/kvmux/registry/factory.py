"""Building connectors, buffers and pipes from configs."""

from __future__ import annotations

from kvmux.backend import Backend
from kvmux.bridges import BufferConnector, PipeLookupBuffer
from kvmux.buffer import LookupBuffer
from kvmux.connector import Connector
from kvmux.errors import BackendUnavailableError
from kvmux.multi.policy import Policy
from kvmux.pipe import Pipe
from kvmux.registry.loader import ConfigLike, load_class, parse_config, resolve

_KINDS = {"connectors": Backend, "buffers": LookupBuffer, "pipes": Pipe, "policies": Policy}


def create_connector(config: ConfigLike) -> Connector:
    """A ready Connector from ``{"backend": NAME, ...}`` (a dict, JSON text or a model).

    NAME may be a connector, a lookup buffer or a pipe; the latter two are
    bridged to a Connector (see :mod:`kvmux.bridges`).
    """
    entry, cls, cfg = parse_config(config)
    _check_kind(entry.name, entry.group, cls)
    if entry.group == "connectors":
        backend: Backend = cls(cfg)
        return Connector(backend)
    if entry.group == "buffers":
        return BufferConnector(cls(cfg), cfg)
    pipe: Pipe = cls(cfg)
    return BufferConnector(PipeLookupBuffer(pipe, cfg), cfg)


def create_buffer(config: ConfigLike) -> LookupBuffer:
    entry, cls, cfg = parse_config(config, ("buffers",))
    _check_kind(entry.name, entry.group, cls)
    buffer: LookupBuffer = cls(cfg)
    return buffer


def create_pipe(config: ConfigLike) -> Pipe:
    entry, cls, cfg = parse_config(config, ("pipes",))
    _check_kind(entry.name, entry.group, cls)
    pipe: Pipe = cls(cfg)
    return pipe


def load_policy(name: str) -> type[Policy]:
    """The MultiConnector policy called ``name`` (entry-point group ``kvmux.policies``),
    imported on first use; UnknownBackendError with a did-you-mean otherwise."""
    entry = resolve(name, ("policies",))
    cls = load_class(entry)
    _check_kind(entry.name, entry.group, cls)
    policy: type[Policy] = cls
    return policy


def _check_kind(name: str, group: str, cls: object) -> None:
    base = _KINDS[group]
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise BackendUnavailableError(
            name, group, f"entry point names {cls!r}, which is not a {base.__name__} subclass"
        )
