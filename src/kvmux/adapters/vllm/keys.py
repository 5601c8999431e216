"""Block keys for vLLM requests, computed the same way in every instance.

vLLM's own block hashes are seeded per process unless ``PYTHONHASHSEED`` is
set, so a prefill and a decode instance would disagree on them. kvmux keys
are a chained hash of the token ids alone (``kvmux.keys``) in a namespace
that names the model and everything else that changes a block's KV for the
same tokens: a LoRA adapter, a cache salt, multimodal inputs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from kvmux.compat import ModelInfo
from kvmux.keys import BlockKey, token_bytes


def _short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def default_namespace(vllm_config: Any) -> str:
    """Model, dtype, KV dtype and block size: what must match for blocks to be interchangeable."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parts = [str(model.model), str(model.dtype), str(cache.cache_dtype), str(cache.block_size)]
    return "vllm-" + _short_hash("|".join(parts))


def model_info(vllm_config: Any, namespace: str | None, tp_rank: int) -> ModelInfo:
    """The model as a P2P handshake compares it: by name (the adapter's ``namespace``
    when set, which declares differently named copies to be one model), dtype and
    tensor-parallel shard."""
    model = vllm_config.model_config
    return ModelInfo(
        name=namespace or str(model.model),
        dtype=str(model.dtype).removeprefix("torch."),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        tp_rank=tp_rank,
    )


def request_namespace(base: str, request: Any) -> str:
    """``base`` refined by whatever makes this request's KV differ from the same tokens' elsewhere.

    Multimodal inputs change the KV of placeholder tokens whose ids stay the
    same; mixing every input's identifier into the whole request's namespace
    gives up some sharing, never correctness.
    """
    extras: list[str] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        extras.append(f"lora={lora.lora_name}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        extras.append(f"salt={salt}")
    for feature in getattr(request, "mm_features", None) or ():
        extras.append(f"mm={feature.identifier}")
    if not extras:
        return base
    return f"{base}/{_short_hash('|'.join(extras))}"


class RequestKeys:
    """Keys of one request's blocks, extended as the request's tokens are computed.

    ``full(n)`` keys the first ``n`` full blocks; ``tail(num_tokens)`` keys a
    trailing partial block (published only for P/D, where the decode instance
    must receive the whole prompt to match a single instance exactly).
    """

    def __init__(self, namespace: str, block_size: int) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self._keys: list[BlockKey] = []

    def full(self, token_ids: Any, num_blocks: int) -> list[BlockKey]:
        bs = self.block_size
        while len(self._keys) < num_blocks:
            i = len(self._keys)
            parent = self._keys[-1] if self._keys else None
            chunk = token_ids[i * bs : (i + 1) * bs]
            if len(chunk) < bs:
                raise ValueError(f"block {i} is not full: {len(chunk)} of {bs} tokens known")
            self._keys.append(BlockKey.child(parent, token_bytes(chunk), self.namespace))
        return self._keys[:num_blocks]

    def upto(self, token_ids: Any, num_tokens: int) -> list[BlockKey]:
        """Keys of the blocks holding the first ``num_tokens`` tokens, a partial last one too."""
        num_full, rest = divmod(num_tokens, self.block_size)
        keys = list(self.full(token_ids, num_full))
        if rest:
            start = num_full * self.block_size
            parent = keys[-1] if keys else None
            content = b"partial:" + token_bytes(token_ids[start:num_tokens])
            keys.append(BlockKey.child(parent, content, self.namespace))
        return keys
