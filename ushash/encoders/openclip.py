"""`openclip`: an open_clip image-text model (image + text).

`model` is the architecture: a built-in name ("ViT-B-32"), a name registered with
`open_clip.add_model_config`, "hf-hub:org/repo" or "local-dir:/path" (those two carry their own weights).
`pretrained` is the weights: a registry tag ("laion2b_s34b_b79k", downloaded), a local checkpoint file
(.pt/.bin loaded with weights_only=True, or .safetensors), an "hf-hub:org/repo" id (then used as the
model name, since such a repo holds config and weights together), or None for a seeded random init.
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from ushash.encoders.base import MediaTextEncoder, register, seeded


@register("openclip")
class OpenClipEncoder(MediaTextEncoder):
    modalities = ("image", "text")

    def __init__(
        self,
        model: str = "ViT-B-32",
        pretrained: str | None = None,
        normalize: bool = True,
        seed: int = 0,
        cache_dir: str | None = None,
        device: str | torch.device | None = None,
        amp: bool = True,
    ):
        super().__init__(device=device, amp=amp)
        import open_clip

        model_name, weights = str(model), pretrained
        if weights is not None and str(weights).startswith("hf-hub:"):
            model_name, weights = str(weights), None
        with seeded(seed):
            self.model, _, self.image_transform = open_clip.create_model_and_transforms(
                model_name, pretrained=weights, device="cpu", cache_dir=cache_dir, weights_only=True
            )
        self.tokenizer = open_clip.get_tokenizer(model_name)
        self.normalize = normalize
        self.dims = self._probe_dims()
        self._finish(dict(model=model, pretrained=pretrained, normalize=normalize, seed=seed))

    def _probe_dims(self) -> dict[str, int]:
        """Embedding widths, read off one dummy forward pass (works for every open_clip tower type)."""
        with torch.inference_mode():
            img = self.image_transform(Image.new("RGB", (32, 32))).unsqueeze(0)
            return {
                "image": int(self.model.encode_image(img).shape[-1]),
                "text": int(self.model.encode_text(self.tokenizer([""])).shape[-1]),
            }

    def text_tokens(self, text: str) -> tuple[int, int] | None:
        """(the tokens `text` has, the context length) as open_clip's own tokenizer counts them: the BPE one
        (start + the text's tokens + end), the Hugging Face one after its cleaning (its ids with their special
        tokens; in 'clips' mode its content tokens + start, end and class); None for another kind (open_clip's
        SigLipTokenizer, which its models do not use)."""
        from open_clip import tokenizer as oc

        tok = self.tokenizer
        window = int(getattr(tok, "context_length", 0) or 0)
        if not window:
            return None
        if type(tok) is oc.SimpleTokenizer:
            return len(tok.encode(str(text))) + 2, window
        if type(tok) is oc.HFTokenizer:
            clips = getattr(tok, "tokenizer_mode", None) == "clips"
            ids = tok.tokenizer(tok.clean_fn(str(text)), add_special_tokens=not clips, truncation=False,
                                verbose=False)["input_ids"]
            return len(ids) + (3 if clips else 0), window
        return None

    def _preprocess_media(self, raw: Any) -> torch.Tensor:
        return self.image_transform(raw.convert("RGB"))

    def _encode(self, modality: str, batch: Any) -> torch.Tensor:
        if modality == "image":
            return self.model.encode_image(batch, normalize=self.normalize)
        return self.model.encode_text(batch, normalize=self.normalize)
