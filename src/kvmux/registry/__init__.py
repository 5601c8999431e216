"""Finding backends by name through entry points, and building them from configs.

Listing (``entries``) imports neither torch nor any backend, so ``kvmux
list`` stays fast; the factory functions are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmux.registry.entries import GROUPS, BackendEntry, scan, scan_all

if TYPE_CHECKING:
    from kvmux.registry.factory import (
        create_backend,
        create_buffer,
        create_connector,
        create_pipe,
    )
    from kvmux.registry.loader import load_check, load_class, parse_config, resolve

_LAZY = {
    "create_backend": "kvmux.registry.factory",
    "create_buffer": "kvmux.registry.factory",
    "create_connector": "kvmux.registry.factory",
    "create_pipe": "kvmux.registry.factory",
    "load_check": "kvmux.registry.loader",
    "load_class": "kvmux.registry.loader",
    "parse_config": "kvmux.registry.loader",
    "resolve": "kvmux.registry.loader",
}

__all__ = [
    "GROUPS",
    "BackendEntry",
    "create_backend",
    "create_buffer",
    "create_connector",
    "create_pipe",
    "load_check",
    "load_class",
    "parse_config",
    "resolve",
    "scan",
    "scan_all",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmux.registry' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
