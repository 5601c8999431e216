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

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvmux.cli.main import main
from kvmux.demo.run import (
    Cluster,
    DemoSettings,
    PromptResult,
    ask_both,
    cluster,
    report,
    request_body,
    run_prompts,
    transfer_totals,
)
from kvmux.demo.servers import ServerError, VllmServer, free_port
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


def test_a_decode_request_its_server_rejects_releases_the_prefills_publication(
    demo_cluster: Cluster, settings: DemoSettings
) -> None:
    """The decode server refuses a request before its engine sees it (its max_tokens
    overflow the context); vLLM tells the connector (``notify_kv_transfer_request_rejected``)
    and the prefill lets go of the request's blocks at once, not after ``lease_s``."""
    c = demo_cluster
    prompt = random_prompts(1, 300, seed=77, vocab_size=c.spec.vocab_size)[0]
    before = _settled_totals(c.prefill)
    body = {
        **request_body(prompt, 1, stream=False),
        "kv_transfer_params": {"do_remote_decode": True},
    }
    status, answer = _post(c.prefill.url, body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    assert params["kvmux"]["lease"], params
    refused = {**request_body(prompt, 10**7, stream=False), "kv_transfer_params": params}
    status, answer = _post(c.decode.url, refused)
    assert status == 400, answer
    deadline = time.monotonic() + 60
    released = 0.0
    while released < 1 and time.monotonic() < deadline:
        _post(c.prefill.url, request_body([5, 6, 7], 1, stream=False))  # a step logs counters
        time.sleep(1.5)
        now = transfer_totals(c.prefill.log_path)
        released = now.get("leases_released", 0) - before.get("leases_released", 0)
    assert released == 1, "the prefill never heard that the decode rejected the request"
    assert transfer_totals(c.prefill.log_path).get("leases_expired", 0) == 0


def _settled_totals(server: VllmServer, timeout_s: float = 60) -> dict[str, float]:
    """The server's logged kvmux counters once earlier tests' leases have been logged:
    two reads a step apart agree on them (a release left by an earlier test, logged
    late, would otherwise count as this test's)."""
    deadline = time.monotonic() + timeout_s

    def leases() -> dict[str, float]:
        totals = transfer_totals(server.log_path)
        return {k: v for k, v in totals.items() if k.startswith("leases_")}

    last = leases()
    while time.monotonic() < deadline:
        _post(server.url, request_body([5, 6, 7], 1, stream=False))  # a step logs counters
        time.sleep(1.5)
        now = leases()
        if now == last:
            return transfer_totals(server.log_path)
        last = now
    raise AssertionError(f"{server}'s lease counters never settled: {last}")


def _post(base_url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", urlsplit(base_url).port, timeout=60)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _text(seed: int, sentences: int = 40) -> str:
    """Several hundred tokens of words the tiny tokenizer was trained on."""
    from kvmux.models.tiny import CORPUS

    rng = random.Random(seed)
    return " ".join(rng.choice(CORPUS) for _ in range(sentences))


# ------------------------------------------------------------ clients that give up


#: vLLM's own series these tests read, by the name ``_counters`` gives them.
_SERIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
}
_COMPLETIONS = "/v1/completions"


def _counters(url: str) -> dict[str, float]:
    """Request gauges, token counters, finished requests by reason (``finished_length``
    ...) and HTTP requests to completions (``http_completions``), from ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name in _SERIES:
                key = sample.name
            elif sample.name == "vllm:request_success_total":
                key = f"finished_{labels['finished_reason']}"
            elif sample.name == "http_requests_total" and labels.get("handler") == _COMPLETIONS:
                key = "http_completions"
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _send(url: str, body: dict[str, object]) -> socket.socket:
    """A client that sends one request and reads nothing yet; closing it is giving up."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=10)
    data = json.dumps(body).encode()
    head = (
        f"POST {_COMPLETIONS} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``check`` until it holds; the seconds it took."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.05)
    return time.monotonic() - start


def _idle(url: str) -> bool:
    now = _counters(url)
    return (
        now.get("vllm:num_requests_running", 0) == 0
        and now.get("vllm:num_requests_waiting", 0) == 0
    )


def _generated(url: str, counters: dict[str, float] | None = None) -> float:
    return (counters or _counters(url))["vllm:generation_tokens_total"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_gives_up_stops_decode_generating(
    demo_cluster: Cluster, stream: bool
) -> None:
    """Decode is generating a long answer; the client leaves; decode stops within seconds
    instead of generating all ``max_tokens`` (plain vLLM stops in ~50 ms)."""
    from kvmux.demo.run import MAX_MODEL_LEN, request_body

    decode = demo_cluster.decode.url
    _wait_for("decode idle before the test", lambda: _idle(decode), 30)
    prompt = random_prompts(1, 200, seed=202, vocab_size=demo_cluster.spec.vocab_size)[0]
    max_tokens = MAX_MODEL_LEN - len(prompt)
    before = _counters(decode)
    client = _send(demo_cluster.proxy_url, request_body(prompt, max_tokens, stream=stream))
    try:
        _wait_for("decode generating", lambda: _generated(decode) > _generated(decode, before), 60)
        time.sleep(0.3)
        at_leave = _generated(decode)
    finally:
        client.close()
    took = _wait_for("decode stopped after the client left", lambda: _idle(decode), 5)
    after = _counters(decode)
    tokens = _generated(decode, after) - _generated(decode, before)
    print(
        f"\n{stream=}: decode stopped {took:.2f} s after the client left, "
        f"{_generated(decode, after) - at_leave:g} tokens later, {tokens:g} of {max_tokens} in all"
    )
    assert tokens < max_tokens, "decode generated the whole answer for nobody"
    assert after["finished_length"] == before["finished_length"]
    assert after["finished_stop"] == before["finished_stop"]


def test_a_client_gone_during_prefill_never_reaches_decode(demo_cluster: Cluster) -> None:
    """A long prompt (prefill takes ~0.5 s here) and a client that leaves 0.1 s after
    sending it: prefill is aborted, decode is never asked."""
    from kvmux.demo.run import MAX_MODEL_LEN, request_body

    prefill, decode = demo_cluster.prefill.url, demo_cluster.decode.url
    _wait_for("prefill and decode idle", lambda: _idle(prefill) and _idle(decode), 30)
    prompt = random_prompts(
        1, MAX_MODEL_LEN - 16, seed=303, vocab_size=demo_cluster.spec.vocab_size
    )[0]
    before_p, before_d = _counters(prefill), _counters(decode)
    client = _send(demo_cluster.proxy_url, request_body(prompt, 16, stream=False))
    time.sleep(0.1)
    client.close()
    _wait_for(
        "prefill saw the request",
        lambda: _counters(prefill).get("http_completions", 0) > before_p.get("http_completions", 0),
        10,
    )
    _wait_for("prefill idle", lambda: _idle(prefill), 10)
    time.sleep(2.0)  # long past the moment decode would have been asked
    after_p, after_d = _counters(prefill), _counters(decode)
    assert after_p["finished_length"] == before_p["finished_length"], "prefill ran to its end"
    assert after_d.get("http_completions", 0) == before_d.get("http_completions", 0)
    assert after_d["vllm:prompt_tokens_total"] == before_d["vllm:prompt_tokens_total"]
    assert _idle(decode)


# ------------------------------------------------------------ transfer-only demo


def test_transfer_only_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--transfer-only", "--blocks", "8", "--backend", "shm"]) == 0
    out = capsys.readouterr().out
    assert "every byte identical" in out


# ------------------------------------------------------------ VllmServer, no vLLM


class _StandIn(VllmServer):
    """A VllmServer running a Python snippet instead of vLLM."""

    def __init__(self, script: str, log_dir: Path, port: int | None = None) -> None:
        super().__init__("stand-in", "no-model", log_dir=log_dir, port=port)
        self.script = script
        self.script_args: list[str] = []

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", self.script, *self.script_args]


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


_HEALTH_SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


def test_a_server_is_ready_when_its_own_process_answers_health(tmp_path: Path) -> None:
    server = _StandIn(_HEALTH_SERVER, tmp_path)
    server.script_args = [str(server.port)]
    with server:
        assert server.healthy()


def test_another_process_answering_on_the_port_is_not_taken_for_the_server(
    tmp_path: Path,
) -> None:
    """Two runs that picked one port: the stranger's /health must not pass for ours."""
    port = free_port()
    stranger = subprocess.Popen([sys.executable, "-c", _HEALTH_SERVER, str(port)])
    try:
        server = _StandIn("import time; time.sleep(60)", tmp_path, port=port)
        server.start()
        try:
            deadline = time.monotonic() + 30
            while not server.healthy() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert server.healthy(), "the stranger never answered"
            with pytest.raises(ServerError, match="not healthy after 2 s"):
                server.wait_ready(timeout_s=2)
        finally:
            server.stop(grace_s=5)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_keeps_its_metrics_apart_from_servers_started_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM points PROMETHEUS_MULTIPROC_DIR at its own temporary directory in a process
    that ran an engine; a server inheriting it would sum every earlier server's counters."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    server = _StandIn("pass", tmp_path)
    assert "PROMETHEUS_MULTIPROC_DIR" not in server.env
    assert server.env["PATH"] == os.environ["PATH"]


def test_free_port_never_hands_out_one_port_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


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


def test_a_server_given_a_host_and_a_prefix_listens_there_and_runs_through_the_prefix(
    tmp_path: Path,
) -> None:
    prefix = ["ip", "netns", "exec", "somewhere"]
    server = VllmServer("away", "no-model", log_dir=tmp_path, host="10.9.0.3", prefix=prefix)
    assert server.command[: len(prefix) + 1] == [*prefix, sys.executable]
    assert server.command[server.command.index("--host") + 1] == "10.9.0.3"
    assert server.url == f"http://10.9.0.3:{server.port}"


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
