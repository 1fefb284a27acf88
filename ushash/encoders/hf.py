"""Small helpers shared by the encoders built on Hugging Face transformers (hf_clip, clap)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def pooled(out: Any) -> torch.Tensor:
    """get_*_features returns a tensor in transformers 4 and a ModelOutput (pooler_output) in 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def check_source(model: str | None, config: Mapping | None, tokenizer: str | None, who: str) -> str | None:
    """Exactly one of `model` / `config`; returns the tokenizer choice (None = the saved one, or "hash")."""
    if (model is None) == (config is None):
        raise ValueError(f"{who}: give exactly one of `model` (hub id or local dir) and `config` (random init)")
    if tokenizer not in (None, "hash"):
        raise ValueError(f"{who}: tokenizer must be None (load the one saved with `model`) or 'hash', got {tokenizer!r}")
    if config is not None and tokenizer is None:
        return "hash"
    return tokenizer
