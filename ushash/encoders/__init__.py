"""Frozen encoders: `build_encoder(cfg) -> Encoder`, a registry keyed by `name`.

    enc = build_encoder({"name": "offline"})          # or "tiny", "openclip", "hf_clip", "clap"
    x = enc.preprocess("image", pil_image)             # CPU, per item
    f = enc.encode("image", enc.collate("image", [x]))  # float32 [1, enc.dims["image"]]

See base.py for the contract. Importing this package is cheap: the encoder modules import
open_clip / transformers / timm only when an encoder is built.
"""

from ushash.encoders.base import (ENCODERS, FP16_AUTOCAST, FP32, Encoder, Part, audio_to_length, autocast_precision,
                                  build_encoder, register)

# Every module of this package is imported: the ones that register themselves fill the registry.
from ushash.core.registry import import_all  # noqa: E402
import_all(__name__, __path__)  # noqa: E402

__all__ = ["ENCODERS", "FP16_AUTOCAST", "FP32", "Encoder", "Part", "audio_to_length", "autocast_precision",
           "build_encoder", "register"]
