"""Frozen encoders: `build_encoder(cfg) -> Encoder`, a registry keyed by `name`.

    enc = build_encoder({"name": "offline"})          # or "tiny", "openclip", "hf_clip", "clap"
    x = enc.preprocess("image", pil_image)             # CPU, per item
    f = enc.encode("image", enc.collate("image", [x]))  # float32 [1, enc.dims["image"]]

See base.py for the contract. Importing this package is cheap: the encoder modules import
open_clip / transformers / timm only when an encoder is built.
"""

from ushash.encoders.base import ENCODERS, Encoder, Part, audio_to_length, build_encoder, register

# Importing the encoder modules fills ENCODERS.
from ushash.encoders import clap, hf_clip, offline, openclip, tiny  # noqa: E402,F401  isort: skip

__all__ = ["ENCODERS", "Encoder", "Part", "audio_to_length", "build_encoder", "register"]
