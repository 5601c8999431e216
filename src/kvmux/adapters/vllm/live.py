"""Worker halves of the engines in this process, by vLLM engine id.

vLLM asks the *scheduler* how many tokens a backend holds, but a process-local
backend (``cpu``) keeps its blocks in the *worker's* connector, and only the
worker knows when a request's saves have ended. When both live in one process
(one worker per engine: every CPU deployment and any TP=1 engine), the
scheduler half asks the worker half directly: no second pool, no IPC, and no
delayed free for saves that already ended.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmux.adapters.vllm.worker import WorkerSide

_lock = threading.Lock()
_by_engine: dict[str, WorkerSide] = {}


def publish(engine_id: str, worker: WorkerSide) -> None:
    with _lock:
        _by_engine[engine_id] = worker


def find(engine_id: str) -> WorkerSide | None:
    with _lock:
        return _by_engine.get(engine_id)


def withdraw(engine_id: str, worker: WorkerSide) -> None:
    with _lock:
        if _by_engine.get(engine_id) is worker:
            del _by_engine[engine_id]
