"""`clap`: a transformers ClapModel (audio + text), 48 kHz audio.

Give either `model` (a hub id such as "laion/clap-htsat-unfused", or a local directory written by
`save_pretrained` holding the model and its feature extractor) or `config` (a ClapConfig as a dict, for a
seeded random init). `tokenizer` as in `hf_clip`. Audio is cropped/zero-padded to `audio_seconds`
(at most the feature extractor's `max_length_s`, so the extractor never crops at random), then the
extractor repeat-pads it to its window. `is_longer` is therefore always False, as in LAION-CLAP; the
extractor's own habit of flagging a random clip of an all-short batch is not used, so features do not
depend on batch composition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ushash.encoders.base import Encoder, audio_to_length, register, seeded
from ushash.encoders.hf import check_source, pooled
from ushash.encoders.tokenizing import HashTokenizer, HFTokenizer


@register("clap")
class ClapEncoder(Encoder):
    modalities = ("audio", "text")

    def __init__(
        self,
        model: str | None = None,
        config: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
        audio_seconds: float | None = None,
        max_length: int | None = None,
        normalize: bool = True,
        seed: int = 0,
        device: str | torch.device | None = None,
        amp: bool = True,
    ):
        super().__init__(device=device, amp=amp)
        from transformers import AutoTokenizer, ClapConfig, ClapFeatureExtractor, ClapModel

        tokenizer = check_source(model, config, tokenizer, "clap")
        if config is not None:
            clap_config = ClapConfig(**dict(config))
            with seeded(seed):
                self.model: nn.Module = ClapModel(clap_config)
            self.feature_extractor = ClapFeatureExtractor(
                feature_size=clap_config.audio_config.num_mel_bins, max_length_s=audio_seconds or 10
            )
        else:
            self.model = ClapModel.from_pretrained(model)
            self.feature_extractor = ClapFeatureExtractor.from_pretrained(model)
        fe = self.feature_extractor
        self.sample_rate = int(fe.sampling_rate)
        self.audio_seconds = float(audio_seconds or fe.max_length_s)
        if self.audio_seconds > fe.max_length_s:
            raise ValueError(f"clap: audio_seconds {self.audio_seconds} exceeds the model's window {fe.max_length_s} s")
        self.truncation = "fusion" if self.model.config.audio_config.enable_fusion else "rand_trunc"

        text_cfg = self.model.config.text_config
        max_length = int(max_length or text_cfg.max_position_embeddings - 2)  # RoBERTa positions start at pad+1
        if tokenizer == "hash":
            self.tokenizer = HashTokenizer(
                text_cfg.vocab_size, max_length, text_cfg.pad_token_id, text_cfg.bos_token_id, text_cfg.eos_token_id
            )
        else:
            self.tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(model), max_length)
        self.normalize = normalize
        d = int(self.model.config.projection_dim)
        self.dims = {"audio": d, "text": d}
        self._finish(dict(model=model, config=config, tokenizer=tokenizer, audio_seconds=self.audio_seconds,
                          max_length=max_length, normalize=normalize, seed=seed))

    def _preprocess(self, modality: str, raw: Any) -> Any:
        if modality == "text":
            return str(raw)
        wave = audio_to_length(np.asarray(raw, dtype=np.float32), self.sample_rate, self.audio_seconds)
        feats = self.feature_extractor(
            wave, sampling_rate=self.sample_rate, return_tensors="pt", truncation=self.truncation, padding="repeatpad"
        )
        return feats["input_features"][0]  # [channels (1, or 4 with fusion), frames, mel bins]

    def _collate(self, modality: str, items: list[Any]) -> Any:
        if modality == "audio":
            return torch.stack(items)
        return self.tokenizer(items)

    def _encode(self, modality: str, batch: Any) -> torch.Tensor:
        if modality == "audio":
            is_longer = torch.zeros(batch.shape[0], 1, dtype=torch.bool, device=batch.device)
            out = pooled(self.model.get_audio_features(input_features=batch, is_longer=is_longer))
        else:
            out = pooled(self.model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
        return nn.functional.normalize(out, dim=-1) if self.normalize else out
