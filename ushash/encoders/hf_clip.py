"""`hf_clip`: a transformers CLIPModel (image + text).

Give either `model` (a hub id such as "openai/clip-vit-base-patch32", or a local directory written by
`save_pretrained`, holding the model and its image processor) or `config` (a CLIPConfig as a dict, for a
seeded random init; tests use tiny ones). `tokenizer`: None loads the tokenizer saved with `model`;
"hash" uses the deterministic hashing tokenizer (the default, and the only choice, with `config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ushash.encoders.base import register
from ushash.encoders.hf import HFPairEncoder, check_source, load_or_init, pooled


def hash_tokenizer_ids(text_config: dict[str, Any]) -> dict[str, Any]:
    """Special ids for a random-init CLIP text tower: pad 0, bos vocab-2, eos vocab-1.

    CLIP pools the text at the eos token; with eos the largest id, both of transformers' pooling rules
    (argmax of ids for configs with eos_token_id == 2, first eos otherwise) find it.
    """
    vocab = int(text_config.get("vocab_size", 49408))
    return {"pad_token_id": 0, "bos_token_id": vocab - 2, "eos_token_id": vocab - 1, **text_config}


def _image_processor_kwargs(clip_config: Any) -> dict[str, Any]:
    """A random-init model's image processor: resize the shortest edge, then centre-crop, to its image size."""
    size = clip_config.vision_config.image_size
    return {"size": {"shortest_edge": size}, "crop_size": {"height": size, "width": size}}


@register("hf_clip")
class HFClipEncoder(HFPairEncoder):
    modalities = ("image", "text")

    def __init__(
        self,
        model: str | None = None,
        config: Mapping[str, Any] | None = None,
        tokenizer: str | None = None,
        max_length: int | None = None,
        normalize: bool = True,
        seed: int = 0,
        device: str | torch.device | None = None,
        amp: bool = True,
    ):
        super().__init__(device=device, amp=amp)
        from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

        tokenizer = check_source(model, config, tokenizer, "hf_clip")
        clip_config = None
        if config is not None:
            cfg = dict(config)
            cfg["text_config"] = hash_tokenizer_ids(dict(cfg.get("text_config", {})))
            clip_config = CLIPConfig(**cfg)
        self.model, self.image_processor = load_or_init(
            CLIPModel, CLIPImageProcessor, model, clip_config, seed, _image_processor_kwargs
        )
        max_length = self._text_tower(model, tokenizer, max_length, normalize)
        self._finish(dict(model=model, config=config, tokenizer=tokenizer, max_length=max_length,
                          normalize=normalize, seed=seed))

    def _preprocess_media(self, raw: Any) -> torch.Tensor:
        return self.image_processor(images=raw.convert("RGB"), return_tensors="pt")["pixel_values"][0]

    def _encode_media(self, batch: Any) -> torch.Tensor:
        return pooled(self.model.get_image_features(pixel_values=batch))
