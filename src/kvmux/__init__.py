"""kvmux: every way of moving an LLM's KV cache behind one interface.

``import kvmux`` is cheap: names below are imported on first use, and no
backend is ever imported until it is chosen by name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "kvmux.backend",
    "BackendConfig": "kvmux.config",
    "BlockKey": "kvmux.keys",
    "chain_keys": "kvmux.keys",
    "Capabilities": "kvmux.capabilities",
    "Connector": "kvmux.connector",
    "Health": "kvmux.backend",
    "Handle": "kvmux.handle",
    "Outcome": "kvmux.handle",
    "Status": "kvmux.handle",
    "TransferResult": "kvmux.handle",
    "KVLayout": "kvmux.layout",
    "LayerSpec": "kvmux.layout",
    "LookupBuffer": "kvmux.buffer",
    "Pipe": "kvmux.pipe",
    "BufferBackend": "kvmux.bridges",
    "PipeLookupBuffer": "kvmux.bridges",
    "create_connector": "kvmux.registry.factory",
    "create_buffer": "kvmux.registry.factory",
    "create_pipe": "kvmux.registry.factory",
}

__all__ = [
    "Backend",
    "BackendConfig",
    "BlockKey",
    "BufferBackend",
    "Capabilities",
    "Connector",
    "Handle",
    "Health",
    "KVLayout",
    "LayerSpec",
    "LookupBuffer",
    "Outcome",
    "Pipe",
    "PipeLookupBuffer",
    "Status",
    "TransferResult",
    "chain_keys",
    "create_buffer",
    "create_connector",
    "create_pipe",
]

if TYPE_CHECKING:
    from kvmux.backend import Backend, Health
    from kvmux.bridges import BufferBackend, PipeLookupBuffer
    from kvmux.buffer import LookupBuffer
    from kvmux.capabilities import Capabilities
    from kvmux.config import BackendConfig
    from kvmux.connector import Connector
    from kvmux.handle import Handle, Outcome, Status, TransferResult
    from kvmux.keys import BlockKey, chain_keys
    from kvmux.layout import KVLayout, LayerSpec
    from kvmux.pipe import Pipe
    from kvmux.registry.factory import create_buffer, create_connector, create_pipe


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmux' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
