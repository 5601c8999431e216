"""Failed saves, said once per cause.

A failed save costs no correctness (the block is not stored; a later request
computes it again), so vLLM carries on and, without this, nothing would tell
an operator that, say, the disk is full. Logging each failed block would
flood the log instead: a full disk fails every block of every step. So each
distinct failure reason (backends word one cause the same way for every
block it hits: ``disk`` names the directory and the errno) is logged once,
with the request and block count it was first seen on; every failure goes on
counting in the backend's ``save_blocks_failed``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

from kvmux.handle import Handle, Status, TransferResult

log = logging.getLogger("kvmux.vllm")

MAX_CAUSES = 32
"""Distinct causes logged; past that, one line says further ones are not."""


class SaveFailureLog:
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._seen: set[str] = set()
        self._overflowed = False
        self._lock = threading.Lock()

    def watch(self, req_id: str, handle: Handle) -> None:
        """Log, when ``handle`` ends, the causes of its failed blocks not logged before."""
        handle.add_done_callback(lambda result: self._check(req_id, result))

    def _check(self, req_id: str, result: TransferResult) -> None:
        causes = Counter(
            o.reason or "no reason given" for o in result.outcomes if o.status is Status.FAILED
        )
        for cause, blocks in causes.items():
            with self._lock:
                if cause in self._seen or self._overflowed:
                    continue
                self._overflowed = len(self._seen) == MAX_CAUSES
                if not self._overflowed:
                    self._seen.add(cause)
            if self._overflowed:
                log.warning(
                    "kvmux: saves to backend %r fail for more than %d causes; further "
                    "causes are not logged (all failures count in save_blocks_failed)",
                    self.backend,
                    MAX_CAUSES,
                )
                return
            log.warning(
                "kvmux: saves to backend %r fail: %s (%d of %d blocks of request %s); "
                "the blocks are not stored and will be recomputed when needed. Later "
                "failures with this cause are not logged; they count in save_blocks_failed",
                self.backend,
                cause,
                blocks,
                len(result.outcomes),
                req_id,
            )
