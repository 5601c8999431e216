"""A real vLLM engine in a child process, driven with JSON lines: for tests and benchmarks.

vLLM keeps one KV connector per process (a module global), so a prefill and
a decode instance, or two engines with different connectors, need separate
processes. ``EngineProcess`` starts ``python -m kvmux.testing.vllm_engine``
with an :class:`EngineSpec`, then sends it commands (``generate``,
``reset_prefix_cache``, ``stats``, ``corrupt_loads``, ``abort_during_load``,
``reject``) and reads one JSON reply per command.
Replies are marked lines on stdout, so vLLM's own logging there does no harm.
``kill()`` is a SIGKILL by PID: the peer-dies-mid-transfer tests use it;
``stopped()`` a SIGSTOP (a frozen peer) until the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from kvmux.testing.lifetime import die_with_parent, stopped

REPLY = "KVMUX-ENGINE "

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "TOKENIZERS_PARALLELISM": "false",
}
"""What vLLM needs on a CPU-only box (shared/NOTES.md): loopback, no downloads, one process."""


class EngineSpec(BaseModel):
    """How to build the engine: the arguments of ``vllm.LLM`` that tests vary."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 4
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    tensor_parallel_size: int = Field(
        1, ge=1, description="above 1: vLLM's multiprocessing executor, one process per rank"
    )
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_transfer_config: dict[str, Any] | None = None
    env: dict[str, str] = Field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine process failed to start, died, or answered a command with an error."""


class EngineProcess:
    """One engine in a child process. Use as a context manager; ``stop`` is idempotent."""

    def __init__(
        self,
        spec: EngineSpec,
        *,
        wait: bool = True,
        start_timeout_s: float = 300.0,
        prefix: Sequence[str] = (),
    ) -> None:
        """``prefix`` runs the engine through a command that execs it, e.g. on another
        host of a :class:`kvmux.testing.netns.Topology` (``host.command``)."""
        self.spec = spec
        env = {**os.environ, **ENGINE_ENV, **spec.env}
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvmux.testing.vllm_engine", spec.model_dump_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            bufsize=1,
        )
        self.pid = self._proc.pid
        self._log: list[str] = []
        self._replies: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()
        self._start_timeout_s = start_timeout_s
        self._ready: dict[str, Any] | None = None
        if wait:
            self.wait_ready()

    def wait_ready(self) -> dict[str, Any]:
        """Block until the engine is up; start several, then wait for each, to overlap starts."""
        if self._ready is None:
            self._ready = self._reply(self._start_timeout_s)
        return self._ready

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cv:
                if line.startswith(REPLY):
                    self._replies.append(json.loads(line[len(REPLY) :]))
                else:
                    self._log.append(line)
                    del self._log[:-400]
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while not self._replies:
                left = deadline - time.monotonic()
                if self._proc.poll() is not None and not self._replies:
                    raise EngineError(
                        f"engine exited ({self._proc.returncode}):\n{self.log_tail()}"
                    )
                if left <= 0:
                    raise EngineError(f"engine did not answer in {timeout_s} s:\n{self.log_tail()}")
                self._cv.wait(min(left, 0.5))
            reply = self._replies.pop(0)
        if "error" in reply:
            raise EngineError(reply["error"])
        return reply

    def log_tail(self, lines: int = 60) -> str:
        with self._cv:
            return "".join(self._log[-lines:])

    def call(self, op: str, timeout_s: float = 300.0, **args: Any) -> dict[str, Any]:
        self.wait_ready()
        if self._proc.poll() is not None:
            raise EngineError(f"engine is not running:\n{self.log_tail()}")
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._proc.stdin.flush()
        return self._reply(timeout_s)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int,
        kv_transfer_params: Sequence[dict[str, Any] | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Greedy generation; one dict per prompt: ``token_ids``, ``kv_transfer_params``,
        ``finish_reason``."""
        reply = self.call(
            "generate",
            prompts=[list(p) for p in prompts],
            max_tokens=max_tokens,
            kv_transfer_params=list(kv_transfer_params) if kv_transfer_params else None,
        )
        outputs: list[dict[str, Any]] = reply["outputs"]
        return outputs

    def kill(self) -> None:
        """SIGKILL: the process dies mid-whatever, as a crashed peer would."""
        if self._proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self._proc.wait(30)

    def stopped(self) -> contextlib.AbstractContextManager[None]:
        """Frozen (SIGSTOP) for a ``with`` block: see :func:`kvmux.testing.lifetime.stopped`."""
        return stopped(self.pid)

    def stop(self) -> None:
        if self._proc.poll() is None:
            with contextlib.suppress(EngineError):
                self.call("quit", timeout_s=30)
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._reader.join(5)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------ the child process


def _serve(spec: EngineSpec) -> None:  # pragma: no cover - runs in the child process
    die_with_parent()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if spec.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.block_size is not None:
        kwargs["block_size"] = spec.block_size
    if spec.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = spec.tensor_parallel_size
        kwargs["distributed_executor_backend"] = "mp"
    llm = LLM(
        model=spec.model,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        enable_prefix_caching=spec.enable_prefix_caching,
        enforce_eager=True,
        seed=spec.seed,
        kv_transfer_config=spec.kv_transfer_config,
        **kwargs,
    )
    _say({"ready": True, "pid": os.getpid(), "address": _worker_address()})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "quit":
            _shut_down(llm)
            _say({"bye": True})
            return
        try:
            _say(_handle(llm, op, cmd, SamplingParams, TokensPrompt))
        except Exception as exc:
            _say({"error": f"{type(exc).__name__}: {exc}"})


def _handle(llm: Any, op: str, cmd: dict[str, Any], sampling: Any, tokens: Any) -> dict[str, Any]:
    if op == "generate":
        prompts = cmd["prompts"]
        params = cmd.get("kv_transfer_params") or [None] * len(prompts)
        sps = [
            sampling(
                max_tokens=cmd["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                extra_args={"kv_transfer_params": p} if p is not None else None,
            )
            for p in params
        ]
        start = time.perf_counter()
        outs = llm.generate([tokens(prompt_token_ids=p) for p in prompts], sps, use_tqdm=False)
        seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ],
        }
    if op == "reset_prefix_cache":
        return {"ok": bool(llm.reset_prefix_cache())}
    if op == "stats":
        worker = _worker()
        if worker is not None:
            return {"stats": worker.stats(), "ranks": [worker.stats()]}
        ranks = llm.collective_rpc(_rank_stats)  # TP > 1: each rank in its own process
        return {"stats": _added(ranks), "ranks": ranks}
    if op == "corrupt_loads":
        from kvmux.connector import Connector
        from kvmux.testing.faults import CorruptBytes

        worker = _worker()
        assert worker is not None, "no kvmux connector in this engine"
        nbytes = cmd.get("nbytes", 256)
        path = cmd.get("path", [])
        if path:  # a backend inside the connector's: wrap it where it sits
            _replace(worker.connector, path, lambda b: CorruptBytes(b, rate=1.0, nbytes=nbytes))
        else:
            backend = worker.connector.backend
            worker.connector = Connector(CorruptBytes(backend, rate=1.0, nbytes=nbytes))
        return {"ok": True}
    if op == "abort_during_load":
        return _abort_during_load(llm, cmd, sampling, tokens)
    if op == "reject":
        return _reject(llm, cmd["kv_transfer_params"], sampling)
    raise ValueError(f"unknown op {op!r}")


def _scheduler(llm: Any) -> Any:
    """The engine core's scheduler (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def _step_until(llm: Any, done: Any, timeout_s: float, what: str) -> None:
    """Step the engine until ``done()``, or raise TimeoutError after ``timeout_s``."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        llm.llm_engine.step()
        time.sleep(0.005)


def _abort_during_load(llm: Any, cmd: dict[str, Any], sampling: Any, tokens: Any) -> dict[str, Any]:
    """Add P/D requests whose loads start ``delay_s`` late, step until every one waits
    for its KV, abort them all (a client gone), then step until the engine has let
    go of everything. Times are wall clock (``time.time()``), comparable across
    processes."""
    from kvmux.connector import Connector
    from kvmux.testing.faults import Delay

    worker = _worker()
    assert worker is not None, "no kvmux connector in this engine"
    real = worker.connector
    worker.connector = Connector(Delay(real.backend, float(cmd["delay_s"])))
    try:
        return _abort_loading(llm, cmd, sampling, tokens)
    finally:
        worker.connector = real


def _abort_loading(llm: Any, cmd: dict[str, Any], sampling: Any, tokens: Any) -> dict[str, Any]:
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler(llm)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    ids = []
    for i, (prompt, params) in enumerate(
        zip(cmd["prompts"], cmd["kv_transfer_params"], strict=True)
    ):
        sp = sampling(
            max_tokens=cmd["max_tokens"],
            temperature=0.0,
            ignore_eos=True,
            extra_args={"kv_transfer_params": params},
        )
        ids.append(
            llm.llm_engine.add_request(
                f"abort-{time.monotonic_ns()}-{i}", tokens(prompt_token_ids=prompt), sp
            )
        )
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS

    def all_loading() -> bool:
        statuses = [r.status for r in scheduler.requests.values()]
        return len(statuses) == len(ids) and all(s == waiting for s in statuses)

    _step_until(llm, all_loading, 60, "every request loading")
    free_loading = pool.get_num_free_blocks()
    aborted_at = time.time()
    llm.llm_engine.abort_request(ids, internal=True)  # add_request returned internal ids
    _step_until(llm, lambda: not scheduler.has_requests(), 120, "engine idle after abort")
    return {
        "free_before": free_before,
        "free_while_loading": free_loading,
        "free_after": pool.get_num_free_blocks(),
        "aborted_at": aborted_at,
        "idle_at": time.time(),
    }


def _reject(llm: Any, params: list[dict[str, Any]], sampling: Any) -> dict[str, Any]:
    """Requests an API server refused before they reached the engine, as vLLM's
    ``AsyncLLM.notify_kv_transfer_request_rejected`` hands them on: one token,
    the params, ``abort_immediately``; then step until the engine is idle."""
    from vllm.v1.engine import EngineCoreRequest

    for i, p in enumerate(params):
        request = EngineCoreRequest(
            request_id=f"rejected-{time.monotonic_ns()}-{i}",
            prompt_token_ids=[0],
            mm_features=None,
            sampling_params=sampling(max_tokens=1, extra_args={"kv_transfer_params": dict(p)}),
            pooling_params=None,
            arrival_time=time.time(),
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            abort_immediately=True,
        )
        llm.llm_engine.engine_core.add_request(request)
    scheduler = _scheduler(llm)
    _step_until(llm, lambda: not scheduler.has_requests(), 60, "engine idle after rejects")
    return {"ok": True}


def _replace(root: Any, path: list[str | int], make: Any) -> None:
    """Swap the object at ``path`` (attribute names and list indices) for ``make(it)``:
    from a connector, ``["backend", "children", 0, "backend", "inner"]`` reaches below
    a multi's first child's checksum, where a damaged transport would sit."""
    parent = root
    for step in path[:-1]:
        parent = parent[step] if isinstance(step, int) else getattr(parent, step)
    last = path[-1]
    if isinstance(last, int):
        parent[last] = make(parent[last])
    else:
        setattr(parent, last, make(getattr(parent, last)))


def _worker() -> Any:
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "worker_side", None)


def _rank_stats(_: Any) -> dict[str, float]:  # pragma: no cover - runs in a vLLM worker
    """One TP rank's kvmux counters (called there through ``LLM.collective_rpc``)."""
    worker = _worker()
    return dict(worker.stats()) if worker is not None else {}


def _added(ranks: Sequence[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for stats in ranks:
        for name, value in stats.items():
            total[name] = total.get(name, 0) + value
    return total


def _shut_down(llm: Any) -> None:  # pragma: no cover - runs in the child process
    """Shut the engine down as a server does on SIGTERM: its workers close their KV
    connectors, and kvmux's close lets saves still in flight end (within the
    backend's ``timeout_s``). The child then leaves with ``os._exit``, which runs
    no finalizer: without this, a quit right after a generate dropped the saves of
    its last steps, and a restarted engine found fewer blocks."""
    llm.llm_engine.engine_core.shutdown()


def _worker_address() -> dict[str, Any] | None:
    worker = _worker()
    return worker.address() if worker is not None else None


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":  # pragma: no cover
    _serve(EngineSpec.model_validate_json(sys.argv[1]))
    # vLLM's atexit handlers can outlive a closed stdin; leave promptly.
    sys.stdout.flush()
    os._exit(0)
