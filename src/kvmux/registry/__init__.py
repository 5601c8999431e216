"""Finding backends by name through entry points, and building them from configs.

Groups: ``kvmux.backends`` (Connector backends), ``kvmux.buffers``,
``kvmux.pipes``, ``kvmux.policies``; a name is looked up in one group only
(:func:`~kvmux.registry.loader.resolve`). Listing (``entries``) imports neither
torch nor any backend, so ``kvmux list`` stays fast; the factory functions are
imported on first use.

Why not stevedore: kvmux needs three things from entry points, and stevedore
gives none of them as kvmux needs them. Listing must read metadata without
importing a plugin (stevedore's managers load what they list). A name declared
by two distributions must resolve to one winner, kvmux's own first, the others
listed as shadowed and never imported (``DriverManager`` imports every claimant
and refuses the name). And a multi resolving a dozen names wants the scan kept
in memory, not in stevedore's cache files under the user's home directory.
``importlib.metadata`` does all three in ``entries`` and ``loader``, one code
path, one dependency less.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvmux.registry.entries import CONNECTOR_GROUPS, GROUPS, BackendEntry, scan, scan_all

if TYPE_CHECKING:
    from kvmux.registry.factory import (
        create_backend,
        create_buffer,
        create_connector,
        create_pipe,
    )
    from kvmux.registry.loader import (
        check_kind,
        load_check,
        load_class,
        parse_config,
        resolve,
    )

_LAZY = {
    "create_backend": "kvmux.registry.factory",
    "create_buffer": "kvmux.registry.factory",
    "create_connector": "kvmux.registry.factory",
    "create_pipe": "kvmux.registry.factory",
    "check_kind": "kvmux.registry.loader",
    "load_check": "kvmux.registry.loader",
    "load_class": "kvmux.registry.loader",
    "parse_config": "kvmux.registry.loader",
    "resolve": "kvmux.registry.loader",
}

__all__ = [
    "CONNECTOR_GROUPS",
    "GROUPS",
    "BackendEntry",
    "check_kind",
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
