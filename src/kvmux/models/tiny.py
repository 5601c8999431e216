"""A tiny random-weight Llama that real vLLM engines can load on a CPU, offline.

Tests, the demo and the benchmarks need a *real* engine (real KV cache, real
scheduler, real connector hooks) but can neither download a checkpoint nor wait
for a big one. So the model is built here: a ``LlamaForCausalLM`` config, seeded
random weights and a byte-level BPE tokenizer trained on a corpus embedded in
this module. Building takes seconds; the result is cached on disk under a name
derived from the spec, so every later call (in any process) is a ``stat``.

Nothing heavy is imported at module level: ``import kvmux.models`` must stay
cheap, and a cached model is found without importing torch or transformers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from kvmux.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMAT_VERSION",
    "MARKER_FILE",
    "NUM_SPECIAL_TOKENS",
    "TinyModelSpec",
    "default_cache_dir",
    "random_prompts",
    "tiny_model",
]

#: Bumped whenever the files written for a spec change, so caches built by an
#: older kvmux are never mistaken for the current layout.
FORMAT_VERSION = 1

#: Written last inside a model directory: its presence means the build finished.
MARKER_FILE = "kvmux_tiny_model.json"

#: ``<s>``, ``</s>``, ``<unk>`` take ids 0, 1, 2; ordinary tokens start after them.
NUM_SPECIAL_TOKENS = 3
SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")

MISSING_EXTRA = "building the tiny model needs the model extra: pip install 'kvmux[model]'"

#: Concatenates role and content, one message a line. Deliberately trivial: it
#: only has to make vLLM's /v1/chat/completions produce *some* prompt.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

#: Training text for the tokenizer. Varied on purpose (prose, digits, code,
#: punctuation, a little non-ASCII) so BPE finds enough merges to fill the
#: default vocabulary; byte-level fallback covers anything it never saw.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A key-value cache stores the attention keys and values of every token seen so far.",
    "Prefill computes the cache for the whole prompt; decode extends it one token at a time.",
    "Moving the cache between machines lets one server prefill while another decodes.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "In 1969, two astronauts walked on the Moon while a third orbited above them.",
    "The train leaves at 07:45 from platform 9 and arrives at 12:30 in the afternoon.",
    "Please remember to water the plants, feed the cat, and lock the back door.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.",
    "To be, or not to be: that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The mitochondria is the powerhouse of the cell, or so the textbooks say.",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on mountains.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    'import json\nconfig = json.loads(\'{"backend": "cpu", "timeout_s": 30}\')\n',
    "SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name;",
    "Error: connection refused (errno 111) while sending 4096 bytes to 127.0.0.1:8000.",
    "The weather today is sunny with a light breeze and a high of 24 degrees.",
    "Tomorrow there may be rain in the morning, clearing up by the evening.",
    "He ordered a coffee, two croissants and a glass of orange juice.",
    "The library opens at nine and closes at six, except on Sundays.",
    "Our results show a 3.5x speedup over the baseline on sequences of 8k tokens.",
    "Ask not what your country can do for you; ask what you can do for your country.",
    "The children built a sandcastle with towers, a moat and a tiny wooden bridge.",
    "Every block of the cache holds sixteen tokens for every layer of the model.",
    "Scientists discovered a new species of frog in the rainforest last year.",
    "Once upon a time, in a kingdom by the sea, there lived a curious princess.",
    "The stock market rose 2% on Tuesday after the central bank held rates steady.",
    "Mix the flour, sugar and eggs, then bake for 25 minutes at 180 degrees.",
    "Why did the chicken cross the road? To get to the other side!",
    "Café, naïve, résumé and jalapeño borrow their accents from other languages.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 65536 3.14159 -7 1e-6.",
    "Good morning! How are you today? I'm fine, thanks — and you?",
    "The committee will meet again next Thursday to review the budget proposal.",
    "Birds sing at dawn, bees hum at noon, and crickets chirp through the night.",
    "A journey of a thousand miles begins with a single step.",
    "Servers, clients, sockets, buffers, queues, threads, locks and timeouts.",
    "Quantum computers use qubits, which can hold a superposition of zero and one.",
    "The old lighthouse keeper climbed the spiral stairs every evening at sunset.",
)


class TinyModelSpec(BaseModel):
    """The shape of a tiny model; equal specs always give byte-identical files.

    ``None`` for ``intermediate_size`` and ``head_dim`` means the usual Llama
    ratio (2x hidden, hidden / heads). vLLM's CPU attention only supports some
    head sizes (32, 64, 80, 96, 112, 128, ...), which this spec does not check
    because it is a property of the engine, not of the model.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(2, ge=1, description="decoder layers")
    hidden_size: int = Field(128, ge=1, description="width of the residual stream")
    intermediate_size: int | None = Field(
        None, ge=1, description="MLP width; None means 2 * hidden_size"
    )
    # validate_default: the divisibility checks must also run when only hidden_size is given
    num_heads: int = Field(4, ge=1, validate_default=True, description="attention (query) heads")
    num_kv_heads: int = Field(
        2, ge=1, validate_default=True, description="key/value heads (GQA when < num_heads)"
    )
    head_dim: int | None = Field(
        None,
        ge=2,
        validate_default=True,
        description="size of one head; None means hidden_size // num_heads",
    )
    vocab_size: int = Field(
        512,
        ge=256 + NUM_SPECIAL_TOKENS,
        description="tokenizer and embedding size (at least the 256 bytes plus 3 specials)",
    )
    max_position_embeddings: int = Field(4096, ge=1, description="longest sequence the model takes")
    seed: int = Field(0, ge=0, lt=2**63, description="torch seed for the random weights")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the saved weights and of config.json"
    )

    @field_validator("num_heads")
    @classmethod
    def _heads_divide_hidden(cls, value: int, info: ValidationInfo) -> int:
        hidden = info.data.get("hidden_size")
        if hidden is not None and hidden % value:
            raise ValueError(f"hidden_size {hidden} is not divisible by num_heads {value}")
        return value

    @field_validator("num_kv_heads")
    @classmethod
    def _kv_heads_divide_heads(cls, value: int, info: ValidationInfo) -> int:
        heads = info.data.get("num_heads")
        if heads is not None and heads % value:
            raise ValueError(f"num_heads {heads} is not divisible by num_kv_heads {value}")
        return value

    @field_validator("head_dim")
    @classmethod
    def _head_dim_is_even(cls, value: int | None, info: ValidationInfo) -> int | None:
        """Rotary embeddings rotate pairs of channels, so a head needs an even size."""
        size = value
        if size is None:
            hidden, heads = info.data.get("hidden_size"), info.data.get("num_heads")
            if hidden is None or heads is None:
                return value  # already reported on those fields
            size = hidden // heads
        if size % 2:
            raise ValueError(f"head size {size} must be even for rotary embeddings")
        return value

    @property
    def resolved_intermediate_size(self) -> int:
        return self.intermediate_size or 2 * self.hidden_size

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def resolved(self) -> dict[str, Any]:
        """Every field with ``None`` replaced by its value, so two specs that
        describe the same model also share one cache directory."""
        return self.model_dump() | {
            "intermediate_size": self.resolved_intermediate_size,
            "head_dim": self.resolved_head_dim,
        }

    @property
    def cache_name(self) -> str:
        """Directory name: format version plus a short hash of the resolved spec."""
        canonical = json.dumps(self.resolved(), sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(f"{FORMAT_VERSION}:{canonical}".encode()).hexdigest()
        return f"llama-v{FORMAT_VERSION}-{digest[:16]}"


def default_cache_dir() -> Path:
    """``$KVMUX_CACHE_DIR/models``, else ``~/.cache/kvmux/models``."""
    root = os.environ.get("KVMUX_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "kvmux"
    return base / "models"


def tiny_model(
    spec: TinyModelSpec | None = None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The directory of the model ``spec`` describes, building it on first use.

    The directory loads with ``vllm.LLM(model=str(path))`` and with
    ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer``. Builds go to a
    temp directory next to the cache entry and appear with one atomic
    ``os.rename``, under an ``flock``: processes that ask for the same spec at
    once all get the same, complete directory, and a crashed build leaves no
    half-written model behind.
    """
    spec = spec if spec is not None else TinyModelSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / spec.cache_name
    if _is_complete(final):  # fast path: no lock, no heavy imports
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{spec.cache_name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return final
        _remove_leftovers(root, spec.cache_name)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.cache_name}.tmp-", dir=root))
        try:
            _build(spec, tmp)
            marker = {"format_version": FORMAT_VERSION, "spec": spec.resolved()}
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def random_prompts(
    n: int, num_tokens: int, seed: int = 0, vocab_size: int = 512
) -> list[list[int]]:
    """``n`` distinct prompts of exactly ``num_tokens`` ordinary token ids each.

    Ids skip the special tokens (a stray ``</s>`` would end a request early) and
    stay below ``vocab_size``. Token ids rather than text, because text
    re-tokenizes to an unpredictable length and the tests need exact block
    counts. The same arguments always give the same prompts.
    """
    if n < 0 or num_tokens < 1:
        raise InvalidRequestError(f"need n >= 0 and num_tokens >= 1, got {n} and {num_tokens}")
    choices = vocab_size - NUM_SPECIAL_TOKENS
    if choices < 1:
        raise InvalidRequestError(f"vocab_size {vocab_size} leaves no ordinary token ids")
    if choices**num_tokens < n:
        raise InvalidRequestError(
            f"only {choices**num_tokens} distinct prompts of {num_tokens} tokens exist, not {n}"
        )
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    prompts: list[list[int]] = []
    while len(prompts) < n:
        ids = tuple(rng.randrange(NUM_SPECIAL_TOKENS, vocab_size) for _ in range(num_tokens))
        if ids not in seen:
            seen.add(ids)
            prompts.append(list(ids))
    return prompts


def _is_complete(path: Path) -> bool:
    return (path / MARKER_FILE).is_file()


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """An ``flock`` on ``path``; the kernel drops it if the holder dies, so a
    killed build never blocks the next one. The lock file itself is left in
    place: deleting it would let two processes lock two different inodes."""
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(root: Path, name: str) -> None:
    """Temp dirs of builds that were killed, and a final dir with no marker
    (never made by ``tiny_model``, so not to be trusted). Only called under the
    lock, when no other build of this spec can be running."""
    for stale in root.glob(f".{name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / name
    if final.exists():
        shutil.rmtree(final)


def _build(spec: TinyModelSpec, out: Path) -> None:
    """Write config, tokenizer and weights for ``spec`` into the empty dir ``out``."""
    try:
        import safetensors.torch
        import torch
        import transformers
    except ImportError as exc:
        raise ImportError(f"{MISSING_EXTRA} ({exc})") from exc

    tokenizer = _train_tokenizer(spec)
    tokenizer.save_pretrained(out)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.resolved_intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.resolved_head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
        dtype=spec.dtype,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(out)
    generation = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=bos, eos_token_id=eos
    )
    generation.save_pretrained(out)
    weights = _random_weights(spec, len(tokenizer), getattr(torch, spec.dtype))
    safetensors.torch.save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _train_tokenizer(spec: TinyModelSpec) -> Any:
    """Byte-level BPE trained on ``CORPUS``: any text encodes, and decodes back
    exactly. Exactly ``spec.vocab_size`` entries: when the corpus runs out of
    merges first, filler tokens pad the vocabulary so every id below
    ``vocab_size`` (and so every id ``random_prompts`` draws) is valid."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer=trainer)
    missing = spec.vocab_size - raw.get_vocab_size()
    if missing > 0:
        raw.add_tokens([AddedToken(f"<extra_{i}>", normalized=False) for i in range(missing)])
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=spec.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _random_weights(spec: TinyModelSpec, vocab: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Llama weights from a private generator seeded with ``spec.seed``.

    Drawn in float32 in a fixed order, then cast, so equal specs give identical
    bytes without touching torch's global RNG. Each matrix has std
    1/sqrt(fan_in) and embeddings std 1 (not the usual 0.02): activations stay
    O(1) through every layer, attention is sharp enough that the next token
    depends on the whole context, and so a KV cache that arrives corrupted
    changes the greedy output instead of vanishing in the noise.
    """
    import torch

    generator = torch.Generator().manual_seed(spec.seed)
    hidden, ffn, head = spec.hidden_size, spec.resolved_intermediate_size, spec.resolved_head_dim
    q_out, kv_out = spec.num_heads * head, spec.num_kv_heads * head

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        values = torch.randn(rows, cols, generator=generator, dtype=torch.float32) * std
        return values.to(dtype).contiguous()

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal(out_features, in_features, in_features**-0.5)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=dtype)

    weights = {"model.embed_tokens.weight": normal(vocab, hidden, 1.0)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones()
        weights[p + "self_attn.q_proj.weight"] = linear(q_out, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_out, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_out)
        weights[p + "post_attention_layernorm.weight"] = ones()
        weights[p + "mlp.gate_proj.weight"] = linear(ffn, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(ffn, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, ffn)
    weights["model.norm.weight"] = ones()
    weights["lm_head.weight"] = linear(vocab, hidden)
    return weights
