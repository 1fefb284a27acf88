"""Small helpers shared by the encoders built on Hugging Face transformers (hf_clip, clap)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ushash.encoders.base import MediaTextEncoder, seeded
from ushash.encoders.tokenizing import HashTokenizer, HFTokenizer


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


def load_or_init(
    model_cls: type,
    processor_cls: type,
    model: str | None,
    model_config: Any | None,
    seed: int,
    processor_kwargs: Callable[[Any], dict[str, Any]],
) -> tuple[nn.Module, Any]:
    """(model, input processor): a random init of `model_config` (a transformers config object) seeded with
    `seed` and `processor_cls(**processor_kwargs(model_config))`, or, when `model_config` is None, both
    `from_pretrained(model)`."""
    if model_config is not None:
        with seeded(seed):
            net = model_cls(model_config)
        return net, processor_cls(**processor_kwargs(model_config))
    return model_cls.from_pretrained(model), processor_cls.from_pretrained(model)


def text_tokenizer(model: str | None, tokenizer: str | None, text_cfg: Any, max_length: int) -> Any:
    """"hash": the hashing tokenizer over the text tower's vocabulary and special ids; None: the one saved
    with `model`."""
    if tokenizer == "hash":
        return HashTokenizer(
            text_cfg.vocab_size, max_length, text_cfg.pad_token_id, text_cfg.bos_token_id, text_cfg.eos_token_id
        )
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(model), max_length)


class HFPairEncoder(MediaTextEncoder):
    """Base of hf_clip and clap: one transformers model (`self.model`) whose media tower (the modality other
    than "text") and text tower project to one space of `projection_dim`. Subclasses load `self.model`, call
    `_text_tower`, and implement `_encode_media`."""

    def _text_tower(
        self, model: str | None, tokenizer: str | None, max_length: int | None, normalize: bool, reserved: int = 0
    ) -> int:
        """Set the tokenizer (see `text_tokenizer`), `normalize` and `dims`; return the token limit used:
        `max_length`, else the text tower's positions less `reserved`."""
        text_cfg = self.model.config.text_config
        max_length = int(max_length or text_cfg.max_position_embeddings - reserved)
        self.tokenizer = text_tokenizer(model, tokenizer, text_cfg, max_length)
        self.normalize = normalize
        d = int(self.model.config.projection_dim)
        self.dims = {m: d for m in self.modalities}
        return max_length

    def _encode_media(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def _encode(self, modality: str, batch: Any) -> torch.Tensor:
        if modality == "text":
            out = pooled(self.model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
        else:
            out = self._encode_media(batch)
        return nn.functional.normalize(out, dim=-1) if self.normalize else out
