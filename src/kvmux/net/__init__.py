"""Networking shared by the ``tcp`` and ``shm`` connectors and the ``tcp`` pipe.

``messages`` (the protocol, as pydantic models), ``frames`` (length-prefixed
frames with bounded waits), ``handshake`` (layout and shared-secret checks),
``server`` / ``client`` (threaded server, cached client links), ``slots``
(pool slots with pins and leases), ``segment`` (shared-memory segments),
``memory`` / ``kv_views`` (tensor memory as socket buffers) and
``served_pool`` (the connector base both pool backends build on).
"""
