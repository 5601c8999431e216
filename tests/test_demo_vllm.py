"""``kvmux demo`` on real vLLM servers, and the proxy end to end on the same servers.

Starting vLLM servers is the expensive part (tens of seconds each on two
cores), so the demo's three servers and proxy start once for the module; the
demo flow runs once on them, then the proxy is driven with the request kinds
clients send (streamed and whole completions, a string prompt, chat). Every
answer must be token-identical to the reference server's, and every request
must have loaded KV through kvmux (identity alone would also hold if decode
silently recomputed the prompt).

The :class:`VllmServer` process handling (failures reported with the log
tail, whole process groups stopped) is checked with stand-in commands, which
needs no vLLM.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmux.cli.main import main
from kvmux.demo.run import (
    Cluster,
    DemoSettings,
    PromptResult,
    ask_both,
    cluster,
    report,
    run_prompts,
)
from kvmux.demo.servers import ServerError, VllmServer
from kvmux.models import random_prompts

pytestmark = pytest.mark.timeout(900)


# ------------------------------------------------------------ the demo on vLLM


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> DemoSettings:
    return DemoSettings(log_dir=tmp_path_factory.mktemp("demo-logs"))


@pytest.fixture(scope="module")
def demo_cluster(settings: DemoSettings) -> Iterator[Cluster]:
    """The demo's servers and proxy, started once; everything is stopped afterwards."""
    pytest.importorskip("vllm")
    pytest.importorskip("aiohttp")
    with cluster(settings) as c:
        yield c
    for server in (c.reference, c.prefill, c.decode):
        assert not _group_alive(server.pid), f"{server} still running after the demo stopped it"


@pytest.fixture(scope="module")
def demo_results(demo_cluster: Cluster, settings: DemoSettings) -> list[PromptResult]:
    results = run_prompts(demo_cluster, settings)
    print("\n".join(report(results)))  # shown with -s, and on failure
    return results


def test_demo_answers_are_identical_and_kv_moved(demo_results: list[PromptResult]) -> None:
    assert len(demo_results) == 4
    for r in demo_results:
        assert len(r.reference.token_ids) == 16, r
        assert r.identical, f"prompt {r.index}: {r.proxied.token_ids} != {r.reference.token_ids}"
        assert r.loaded_blocks > 0, f"prompt {r.index}: decode loaded no KV ({r.loaded})"
        assert r.loaded_bytes == r.layout_bytes, r.loaded
    assert {r.stream for r in demo_results} == {True, False}


def _check_via_proxy(
    c: Cluster, settings: DemoSettings, prompt: list[int] | str, *, stream: bool, chat: bool
) -> None:
    reference, proxied, loaded = ask_both(c, settings, prompt, stream=stream, chat=chat)
    assert len(reference.token_ids) == 16
    assert proxied.token_ids == reference.token_ids
    assert proxied.text == reference.text
    assert loaded.get("load_blocks_ok", 0) > 0, f"decode loaded no KV: {loaded}"


def test_proxy_streaming_completion(demo_cluster: Cluster, settings: DemoSettings) -> None:
    prompt = random_prompts(1, 450, seed=101, vocab_size=512)[0]
    _check_via_proxy(demo_cluster, settings, prompt, stream=True, chat=False)


def test_proxy_whole_completion_of_a_text_prompt(
    demo_cluster: Cluster, settings: DemoSettings
) -> None:
    """A string prompt: the proxy hands decode the token ids prefill used."""
    _check_via_proxy(demo_cluster, settings, _text(seed=1), stream=False, chat=False)


def test_proxy_chat_completion(demo_cluster: Cluster, settings: DemoSettings) -> None:
    _check_via_proxy(demo_cluster, settings, _text(seed=2), stream=False, chat=True)


def _text(seed: int, sentences: int = 40) -> str:
    """Several hundred tokens of words the tiny tokenizer was trained on."""
    from kvmux.models.tiny import CORPUS

    rng = random.Random(seed)
    return " ".join(rng.choice(CORPUS) for _ in range(sentences))


# ------------------------------------------------------------ transfer-only demo


def test_transfer_only_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--transfer-only", "--blocks", "8", "--backend", "shm"]) == 0
    out = capsys.readouterr().out
    assert "every byte identical" in out


# ------------------------------------------------------------ VllmServer, no vLLM


class _StandIn(VllmServer):
    """A VllmServer running a Python snippet instead of vLLM."""

    def __init__(self, script: str, log_dir: Path) -> None:
        super().__init__("stand-in", "no-model", log_dir=log_dir)
        self.script = script

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script]


def test_server_that_exits_is_reported_with_its_log(tmp_path: Path) -> None:
    server = _StandIn("print('no model here', flush=True); raise SystemExit(3)", tmp_path)
    with pytest.raises(ServerError, match=r"exited with status 3(.|\n)*no model here"), server:
        pass
    assert (tmp_path / "stand-in.log").is_file()


def test_server_that_never_gets_healthy_times_out(tmp_path: Path) -> None:
    server = _StandIn("import time; print('starting', flush=True); time.sleep(60)", tmp_path)
    server.start()
    try:
        with pytest.raises(ServerError, match=r"not healthy after 1 s(.|\n)*starting"):
            server.wait_ready(timeout_s=1)
    finally:
        server.stop(grace_s=5)
    assert not _group_alive(server.pid)


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    """A child that ignores SIGTERM (as a wedged EngineCore might) is SIGKILLed with its parent."""
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # inherited by the child
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print('CHILD-PID', child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    server = _StandIn(script, tmp_path).start()
    child = _wait_for_child(server.log_path)
    started = time.monotonic()
    server.stop(grace_s=1)
    assert time.monotonic() - started < 15
    gone_by = time.monotonic() + 5  # SIGKILL is delivered at once, reaped a moment later
    while _alive(child) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not _alive(child)
    assert not _group_alive(server.pid)


def test_pinned_server_and_its_threads_stay_on_the_given_cores(tmp_path: Path) -> None:
    core = max(os.sched_getaffinity(0))
    server = VllmServer("pinned", "no-model", log_dir=tmp_path, cpus=(core,))
    taskset = server.command[: server.command.index(sys.executable)]
    assert taskset[1:] == ["-c", str(core)]
    assert server.env["OMP_NUM_THREADS"] == "1"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == str(core)
    script = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0)))"
    child = "import os; print(sorted(os.sched_getaffinity(0)))"
    script += f"; subprocess.run([sys.executable, '-c', {child!r}])"
    out = subprocess.run(
        [*taskset, sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split("\n")[:2] == [f"[{core}]", f"[{core}]"], out  # children inherit it
    assert VllmServer("free", "no-model", log_dir=tmp_path).command[0] == sys.executable


def _wait_for_child(log: Path, timeout_s: float = 30) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith("CHILD-PID "):
                return int(line.split()[1])
        time.sleep(0.1)
    raise AssertionError(f"no child pid in {log}: {log.read_text()}")


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's zombie waits for init, which may be slow)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _group_alive(pgid: int | None) -> bool:
    """Whether any non-zombie process is left in the group."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
