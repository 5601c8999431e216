"""``kvmux demo``: kvmux moving a real vLLM server's KV cache, and the transport alone.

* :mod:`~kvmux.demo.run`: three vLLM servers (reference, prefill, decode) and the
  kvmux proxy; every answer through prefill -> kvmux -> decode must equal the
  single server's, token for token.
* :mod:`~kvmux.demo.servers`: starting and always stopping those processes.
* :mod:`~kvmux.demo.transfer`: ``--transfer-only``, a hand-off between two plain
  processes with no vLLM, byte-checked.

Importing this package imports neither vLLM nor torch; the submodules do what
they need when they run.
"""

from __future__ import annotations

from kvmux.demo.servers import ProxyThread, ServerError, VllmServer, free_port

__all__ = ["ProxyThread", "ServerError", "VllmServer", "free_port"]
