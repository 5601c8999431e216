"""Checking ``kv_connector_extra_config`` in vLLM's front end, before any engine starts.

A bad backend name or option should stop ``vllm.entrypoints.openai.api_server``
within seconds, with kvmux's message as its last line. vLLM 0.32 gives a
connector no config-carrying hook that early: in the API-server process it
only resolves the connector class (``KVConnectorFactory.get_connector_class``,
from ``VllmConfig.__post_init__`` via ``supports_hma_config``) and, later,
``build_prom_metrics`` -- after the engine core has loaded the weights. The
classmethods that get a config run elsewhere or not at all on a CPU:
``get_required_kvcache_layout(vllm_config)`` in the engine core after the
weights load, ``requires_piecewise_for_cudagraph(extra_config)`` only when
full CUDA graphs are on. The connector itself is built after that.

So kvmux checks where vLLM resolves the class: :func:`install` (run by the
``vllm.general_plugins`` hook in every vLLM process) wraps
``get_connector_class`` so that resolving a :class:`KvmuxConnector` (by name,
by module path, or as a ``MultiConnector`` child) first validates its extra
config; every other connector is resolved exactly as before. With
``--disable-hybrid-kv-cache-manager`` vLLM skips that resolution in the front
end and the same error comes from the engine core instead.
"""

from __future__ import annotations

import sys
from typing import Any

from kvmux.adapters.vllm import CONNECTOR_CLASS, CONNECTOR_MODULE
from kvmux.adapters.vllm.config import ExtraConfigError, split_extra_config
from kvmux.errors import KvmuxError

_MARK = "__kvmux_checks_extra_config__"


def install(factory: Any) -> None:
    """Make ``factory.get_connector_class`` validate kvmux's extra config. Idempotent."""
    resolve = factory.get_connector_class
    if getattr(resolve, _MARK, False):
        return

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
        connector_cls = resolve(kv_transfer_config)
        if _is_kvmux(connector_cls):
            check(kv_transfer_config.kv_connector_extra_config)
        return connector_cls

    setattr(get_connector_class, _MARK, True)
    get_connector_class.__doc__ = resolve.__doc__
    factory.get_connector_class = classmethod(get_connector_class)


def check(extra: Any) -> None:
    """Validate ``kv_connector_extra_config`` as the connector will; raise
    :class:`ExtraConfigError` (one line, path and value) if it would refuse it."""
    try:
        split_extra_config(extra)
    except KvmuxError as exc:
        raise ExtraConfigError.from_error(exc) from exc


def _is_kvmux(connector_cls: Any) -> bool:
    # A KvmuxConnector (or subclass) can only exist once its module is imported;
    # looking it up there keeps other connectors from importing it (torch, vLLM).
    module = sys.modules.get(CONNECTOR_MODULE)
    ours = getattr(module, CONNECTOR_CLASS, None)
    return (
        isinstance(ours, type)
        and isinstance(connector_cls, type)
        and issubclass(connector_cls, ours)
    )
