"""Engine adapters: each maps one inference engine's KV-transfer hooks onto a Connector.

The core knows nothing about engines; an adapter lives here, one subpackage
per engine (``vllm`` first).
"""
