"""Building connectors, buffers and pipes from configs.

Each builder checks that what the entry point names is the kind it builds
(:func:`~kvmux.registry.loader.check_kind`); other users of the registry (the
multi's policies) check their own kinds where they load them.
"""

from __future__ import annotations

from kvmux.bridges import BufferConnector, PipeLookupBuffer
from kvmux.buffer import LookupBuffer
from kvmux.connector import Connector
from kvmux.pipe import Pipe
from kvmux.registry.loader import ConfigLike, check_kind, parse_config

BACKEND_BASE = Connector
"""What a ``kvmux.backends`` entry point must name a subclass of."""


def create_connector(config: ConfigLike) -> Connector:
    """A ready Connector from ``{"backend": NAME, ...}`` (a dict, JSON text or a model).

    NAME is a backend; ``buffers:NAME`` and ``pipes:NAME`` name a lookup buffer
    or a pipe, bridged to a Connector (see :mod:`kvmux.bridges`).
    """
    entry, cls, cfg = parse_config(config)
    if entry.group == "buffers":
        buffer: LookupBuffer = check_kind(entry, cls, LookupBuffer)(cfg)
        return BufferConnector(buffer, cfg)
    if entry.group == "pipes":
        pipe: Pipe = check_kind(entry, cls, Pipe)(cfg)
        return BufferConnector(PipeLookupBuffer(pipe, cfg), cfg)
    connector: Connector = check_kind(entry, cls, BACKEND_BASE)(cfg)
    return connector


def create_buffer(config: ConfigLike) -> LookupBuffer:
    """A LookupBuffer from ``{"backend": NAME, ...}``, NAME in ``kvmux.buffers``."""
    entry, cls, cfg = parse_config(config, ("buffers",))
    buffer: LookupBuffer = check_kind(entry, cls, LookupBuffer)(cfg)
    return buffer


def create_pipe(config: ConfigLike) -> Pipe:
    """A Pipe from ``{"backend": NAME, ...}``, NAME in ``kvmux.pipes``."""
    entry, cls, cfg = parse_config(config, ("pipes",))
    pipe: Pipe = check_kind(entry, cls, Pipe)(cfg)
    return pipe
