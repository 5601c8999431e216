"""Wire and socket code of the served pools (:mod:`kvmux.pool`) and the ``tcp`` pipe.

``messages`` (the protocol, as pydantic models), ``frames`` (length-prefixed
frames with bounded waits), ``handshake`` (layout and shared-secret checks),
``server`` / ``client`` (threaded server, cached client links), ``advertise``
(the address peers dial), ``segment`` (shared-memory segments), ``memory`` /
``kv_views`` (tensor memory as socket buffers) and the engines of the
zero-copy transports (``nixl_agent``, ``mooncake_engine``). Nothing here
knows a backend: the pools are built on it, never the other way round.
"""
