"""Building backends (and their Connector front), buffers and pipes from configs.

Each builder checks that what the entry point names is the kind it builds
(:func:`~kvmux.registry.loader.check_kind`); other users of the registry (the
multi's policies) check their own kinds where they load them.
"""

from __future__ import annotations

from kvmux.backend import Backend
from kvmux.bridges import BufferBackend, PipeLookupBuffer
from kvmux.buffer import LookupBuffer
from kvmux.connector import Connector
from kvmux.pipe import Pipe
from kvmux.registry.loader import ConfigLike, check_kind, parse_config

BACKEND_BASE = Backend
"""What a ``kvmux.backends`` entry point must name a subclass of."""


def create_connector(config: ConfigLike) -> Connector:
    """A ready Connector from ``{"backend": NAME, ...}`` (a dict, JSON text or a model):
    the front over :func:`create_backend`'s backend."""
    return Connector(create_backend(config))


def create_backend(config: ConfigLike) -> Backend:
    """The backend named in ``config``, without a front (composites hold backends).

    NAME is a backend; ``buffers:NAME`` and ``pipes:NAME`` name a lookup buffer
    or a pipe, bridged to a backend (see :mod:`kvmux.bridges`).
    """
    entry, cls, cfg = parse_config(config)
    if entry.group == "buffers":
        buffer: LookupBuffer = check_kind(entry, cls, LookupBuffer)(cfg)
        return BufferBackend(buffer, cfg)
    if entry.group == "pipes":
        pipe: Pipe = check_kind(entry, cls, Pipe)(cfg)
        return BufferBackend(PipeLookupBuffer(pipe, cfg), cfg)
    backend: Backend = check_kind(entry, cls, BACKEND_BASE)(cfg)
    return backend


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
