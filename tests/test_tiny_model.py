"""The tiny model builder: deterministic files, a shared on-disk cache, offline tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvmux.cli.main import main
from kvmux.errors import InvalidRequestError
from kvmux.models import MARKER_FILE, NUM_SPECIAL_TOKENS, TinyModelSpec, random_prompts, tiny_model
from kvmux.models import tiny as tiny_module

#: Smallest shape that still exercises GQA; keeps fresh builds quick.
SMALL = TinyModelSpec(layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, vocab_size=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default model for the read-only tests (building imports transformers once)."""
    pytest.importorskip("transformers")
    return tiny_model(cache_dir=tmp_path_factory.mktemp("models"))


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_same_spec_gives_identical_weights(built: Path, tmp_path: Path) -> None:
    again = tiny_model(TinyModelSpec(), cache_dir=tmp_path)

    assert again.name == built.name
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (built / name).read_bytes(), name
    reseeded = tiny_model(TinyModelSpec(seed=1), cache_dir=tmp_path)
    assert reseeded.name != built.name
    original = (built / "model.safetensors").read_bytes()
    assert (reseeded / "model.safetensors").read_bytes() != original


def test_specs_that_resolve_alike_share_a_directory() -> None:
    explicit = TinyModelSpec(intermediate_size=256, head_dim=32)

    assert explicit.cache_name == TinyModelSpec().cache_name


def test_concurrent_builds_share_one_directory(tmp_path: Path) -> None:
    """Two processes ask for the same model at once: one builds, the other waits for it.

    The build is faked (it logs itself, then waits until both processes have
    asked) so the race is certain and no transformers import is paid twice.
    """
    cache, scratch = tmp_path / "cache", tmp_path / "scratch"
    scratch.mkdir()
    code = """
        import os, sys, time
        from pathlib import Path
        from kvmux.models import TinyModelSpec, tiny
        cache, scratch = sys.argv[1], Path(sys.argv[2])

        def fake_build(spec, out):
            with open(scratch / "builds.log", "a") as log:
                log.write(f"{os.getpid()}\\n")
            deadline = time.monotonic() + 60
            while len(list(scratch.glob("asked-*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # let the other process reach the lock
            (out / "config.json").write_text("{}")

        tiny._build = fake_build
        (scratch / f"asked-{os.getpid()}").touch()
        print(tiny.tiny_model(TinyModelSpec(), cache_dir=cache))
    """
    argv = [sys.executable, "-c", textwrap.dedent(code), str(cache), str(scratch)]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]

    assert [proc.returncode for proc in procs] == [0, 0]
    expected = cache / TinyModelSpec().cache_name
    assert outputs == [f"{expected}\n"] * 2
    assert len((scratch / "builds.log").read_text().splitlines()) == 1
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [expected.name]  # no temp dirs
    assert (expected / MARKER_FILE).is_file()


def test_cached_model_is_reused_without_rebuilding(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    code = """
        import sys
        from kvmux.models import tiny_model
        path = tiny_model(cache_dir=sys.argv[1])
        heavy = sorted({"torch", "transformers", "tokenizers"} & set(sys.modules))
        print(path, heavy)
    """
    result = _run_python(code, str(built.parent))

    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{built} []\n"
    monkeypatch.setattr(tiny_module, "_build", lambda *_: pytest.fail("rebuilt a cached model"))
    assert tiny_model(cache_dir=built.parent) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp


def test_importing_models_does_not_import_torch() -> None:
    code = """
        import sys
        import kvmux.models
        print(sorted({"torch", "transformers", "tokenizers"} & set(sys.modules)))
    """
    result = _run_python(code)

    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


def test_failed_build_leaves_nothing_behind_and_next_call_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")

    def half_build(spec: TinyModelSpec, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("killed mid-build")

    with monkeypatch.context() as patch:
        patch.setattr(tiny_module, "_build", half_build)
        with pytest.raises(RuntimeError, match="killed mid-build"):
            tiny_model(SMALL, cache_dir=tmp_path)
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []

    stale = tmp_path / f".{SMALL.cache_name}.tmp-crashed"  # a build that was SIGKILLed
    stale.mkdir()
    path = tiny_model(SMALL, cache_dir=tmp_path)
    assert (path / MARKER_FILE).is_file()
    assert not stale.exists()


def test_tokenizer_round_trips_text(built: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(built)
    config = json.loads((built / "config.json").read_text())

    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "  leading spaces, tabs\tand\nnewlines  ",
        "Zebras xylophone quietly: 12345 != 54321?",
        "日本語 🙂 ünïcödé",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
        assert all(0 <= i < config["vocab_size"] for i in ids)
    assert len(tokenizer) == config["vocab_size"] == TinyModelSpec().vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        config["bos_token_id"],
        config["eos_token_id"],
    )
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "user: hi\nassistant: "


def test_small_corpus_vocab_is_padded_to_the_spec_size(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    spec = TinyModelSpec(layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, vocab_size=4096)

    path = tiny_model(spec, cache_dir=tmp_path)

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == 4096
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 4096


def test_transformers_loads_the_weights_in_the_spec_dtype(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    spec = SMALL.model_copy(update={"dtype": "bfloat16"})
    path = tiny_model(spec, cache_dir=tmp_path)

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    ids = torch.tensor(random_prompts(2, 8, vocab_size=spec.vocab_size))
    logits = model(input_ids=ids).logits

    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.bfloat16
    assert logits.shape == (2, 8, spec.vocab_size)
    assert torch.isfinite(logits).all()


def test_random_prompts_are_deterministic_and_in_range() -> None:
    prompts = random_prompts(50, 17, seed=3, vocab_size=300)

    assert prompts == random_prompts(50, 17, seed=3, vocab_size=300)
    assert prompts != random_prompts(50, 17, seed=4, vocab_size=300)
    assert all(len(p) == 17 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 50
    assert all(NUM_SPECIAL_TOKENS <= t < 300 for p in prompts for t in p)
    tight = random_prompts(4, 1, vocab_size=NUM_SPECIAL_TOKENS + 4)  # every possible prompt
    assert sorted(tight) == [[3], [4], [5], [6]]
    with pytest.raises(InvalidRequestError, match="distinct prompts"):
        random_prompts(5, 1, vocab_size=NUM_SPECIAL_TOKENS + 4)


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"hidden_size": 130}, ("num_heads",)),
        ({"num_kv_heads": 3}, ("num_kv_heads",)),
        ({"hidden_size": 120, "num_heads": 8}, ("head_dim",)),  # head size 15 is odd
        ({"dtype": "int8"}, ("dtype",)),
        ({"vocab_size": 100}, ("vocab_size",)),
        ({"hidden": 128}, ("hidden",)),
    ],
)
def test_invalid_spec_is_rejected_with_field_path(
    fields: dict[str, object], path: tuple[str, ...]
) -> None:
    with pytest.raises(ValidationError) as caught:
        TinyModelSpec.model_validate(fields)

    assert [err["loc"] for err in caught.value.errors()] == [path]


def test_cli_prints_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    argv = ["model", "--layers", "1", "--hidden", "64", "--heads", "2", "--kv-heads", "1"]
    argv += ["--vocab", "300", "--cache-dir", str(tmp_path)]

    assert main(argv) == 0
    assert capsys.readouterr().out == f"{tmp_path / SMALL.cache_name}\n"
    assert main(argv) == 0  # cached this time: same single line
    assert capsys.readouterr().out == f"{tmp_path / SMALL.cache_name}\n"


def test_cli_reports_an_invalid_spec_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "--kv-heads", "3", "--cache-dir", str(tmp_path)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert "num_kv_heads" in captured.err
    assert not os.listdir(tmp_path)


def test_missing_extra_is_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail

    with pytest.raises(ImportError, match=r"pip install 'kvmux\[model\]'"):
        tiny_model(SMALL, cache_dir=tmp_path)
    assert main(["model", "--cache-dir", str(tmp_path)]) == 2
    assert "kvmux[model]" in capsys.readouterr().err
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []
