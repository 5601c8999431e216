"""kvmux as a vLLM KV connector: ``--kv-transfer-config '{"kv_connector": "kvmux", ...}'``.

vLLM has no entry-point group for connectors, but it runs every
``vllm.general_plugins`` entry point in each of its processes before it
creates one; kvmux's (``register``) adds ``kvmux`` to vLLM's connector
factory there, and makes the factory check kvmux's extra config whenever it
resolves the connector class (:mod:`~kvmux.adapters.vllm.preflight`), so a bad
config stops vLLM's front end before an engine starts. Importing this package
does not import vLLM.
"""

from __future__ import annotations

CONNECTOR_NAME = "kvmux"
CONNECTOR_MODULE = "kvmux.adapters.vllm.connector"
CONNECTOR_CLASS = "KvmuxConnector"


def register() -> None:
    """The ``vllm.general_plugins`` hook: make ``"kv_connector": "kvmux"`` resolvable,
    and checked before use."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvmux.adapters.vllm import preflight

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    preflight.install(KVConnectorFactory)
