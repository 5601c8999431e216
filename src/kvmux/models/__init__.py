"""Models kvmux builds for itself, so tests and demos run real engines offline.

Importing this package is cheap: torch, transformers and tokenizers are only
imported when a model has to be built.
"""

from __future__ import annotations

from kvmux.models.tiny import (
    FORMAT_VERSION,
    MARKER_FILE,
    NUM_SPECIAL_TOKENS,
    TinyModelSpec,
    default_cache_dir,
    random_prompts,
    tiny_model,
)

__all__ = [
    "FORMAT_VERSION",
    "MARKER_FILE",
    "NUM_SPECIAL_TOKENS",
    "TinyModelSpec",
    "default_cache_dir",
    "random_prompts",
    "tiny_model",
]
