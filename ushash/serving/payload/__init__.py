"""Compact payloads for cache entries: quantized (INT4 / FP16) and sparse (top-k) copies of an embedding.

Besides its binary code, a semantic-cache entry can hold a compact copy of the query's embedding. The
cache decodes it to re-rank the Hamming candidates and to verify a hit (a cosine check) before serving
it. The embedding that goes into the payload is the head's shared-space ``z`` (``USHash.embed``,
``dim``-d, L2-normalised, one space for every modality), so an image entry can verify a text query.

Formats (one `PayloadFormat` per modality; `PayloadCodec` holds them keyed by modality):

    kind   "fp32" | "fp16" | "int4"
    scale  int4 only: "group" -- one fp16 scale per `group_size` consecutive values of each vector,
                                 stored in the record (group_size >= dim: one scale per vector);
                      "channel" -- one float32 scale per dimension, calibrated once on a sample
                                 (`fit`), stored in the codec (the export), not in the records.
    topk   None (dense) or k: keep the k dimensions of largest |value| of each vector.

INT4 is symmetric: q = clip(round(x / s), -7, 7) and x' = q * s, with s = absmax / 7 over the group
(the scale is rounded to fp16 first, so encoder and decoder use the same s) or over the calibration
sample (channel). Values are stored as nibbles q + 8 in 1..15, two to a byte, the even position in the
low nibble. Channel scales saturate values beyond the calibration range.

Every record of a format has the same size, `nbytes`, so a store of N entries is a uint8 [N, nbytes]
array. Record layout, in this order (all multi-byte numbers little-endian):

    [positions]  topk only: a bitmask of dim bits (ceil(dim/8) bytes, bit i of byte i//8 is dimension
                 i + 8*(byte), LSB first, like ushash.core.codes) or k indices (uint8 when dim <= 256, else
                 uint16), whichever is smaller; values follow in ascending dimension order
    [scales]     int4 + group only: ceil(L / group_size) fp16 scales (L = dim, or k when sparse)
    [values]     fp32 (4 bytes each), fp16 (2 bytes each) or int4 (ceil(L / 2) bytes)

Modality-aware defaults (`PayloadConfig`, also as the plain dict `DEFAULTS`): image int4 (group scales,
group 32), text and audio fp16, all dense; every field can be overridden (`PayloadCodec.from_config`,
configs/payload/*.yaml, which extend `PayloadConfig` as the Hydra schema payload/schema).

Modules, each importing only numpy and the standard library (the serving runtime, ushash.serving.artifact,
uses them):

    settings.py   PayloadError, the settings schema (FormatSettings, PayloadConfig) and DEFAULTS
    scoring.py    operations on records: cosine / scores / verify / rerank, a checked and an unchecked path
    format.py     PayloadFormat: the record format (sizes, settings, fit, encode, decode)
    codec.py      PayloadCodec: formats keyed by modality, and their (de)serialisation for an export
"""

from ushash.serving.payload.codec import PayloadCodec
from ushash.serving.payload.format import INT4_MAX, KINDS, SCALES, PayloadFormat, describe, memory_bytes
from ushash.serving.payload.settings import DEFAULTS, FormatSettings, PayloadConfig, PayloadError

__all__ = ["DEFAULTS", "INT4_MAX", "KINDS", "SCALES", "FormatSettings", "PayloadCodec", "PayloadConfig", "PayloadError",
           "PayloadFormat", "describe", "memory_bytes"]
