"""ushash: multimodal semantic hashing (US-HASH) and the semantic cache it feeds."""

__version__ = "0.1.0"

MODALITIES = ("image", "text", "audio")
