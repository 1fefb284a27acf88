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

from ushash.encoders.base import audio_to_length, register
from ushash.encoders.hf import HFPairEncoder, check_source, load_or_init, pooled


@register("clap")
class ClapEncoder(HFPairEncoder):
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
        from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

        tokenizer = check_source(model, config, tokenizer, "clap")
        self.model, self.feature_extractor = load_or_init(
            ClapModel, ClapFeatureExtractor, model, ClapConfig(**dict(config)) if config is not None else None, seed,
            lambda c: dict(feature_size=c.audio_config.num_mel_bins, max_length_s=audio_seconds or 10),
        )
        fe = self.feature_extractor
        self.sample_rate = int(fe.sampling_rate)
        self.audio_seconds = float(audio_seconds or fe.max_length_s)
        if self.audio_seconds > fe.max_length_s:
            raise ValueError(f"clap: audio_seconds {self.audio_seconds} exceeds the model's window {fe.max_length_s} s")
        self.truncation = "fusion" if self.model.config.audio_config.enable_fusion else "rand_trunc"

        # RoBERTa positions start at pad+1, so two of them are never a token's.
        max_length = self._text_tower(model, tokenizer, max_length, normalize, reserved=2)
        self._finish(dict(model=model, config=config, tokenizer=tokenizer, audio_seconds=self.audio_seconds,
                          max_length=max_length, normalize=normalize, seed=seed))

    def _preprocess_media(self, raw: Any) -> torch.Tensor:
        wave = audio_to_length(np.asarray(raw, dtype=np.float32), self.sample_rate, self.audio_seconds)
        feats = self.feature_extractor(
            wave, sampling_rate=self.sample_rate, return_tensors="pt", truncation=self.truncation, padding="repeatpad"
        )
        return feats["input_features"][0]  # [channels (1, or 4 with fusion), frames, mel bins]

    def _encode_media(self, batch: Any) -> torch.Tensor:
        is_longer = torch.zeros(batch.shape[0], 1, dtype=torch.bool, device=batch.device)
        return pooled(self.model.get_audio_features(input_features=batch, is_longer=is_longer))
