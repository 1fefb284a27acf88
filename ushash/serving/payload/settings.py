"""Payload settings: the one source of the per-modality defaults (configs/payload/*.yaml extend
`PayloadConfig`, registered as the Hydra schema payload/schema by ushash.serving.export), and PayloadError.

numpy-free plain dataclasses: the serving runtime imports them without Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


class PayloadError(ValueError):
    """Bad payload settings or records; the message names the argument and what was expected."""


@dataclass
class FormatSettings:
    """One modality's payload format (ushash.serving.payload.format.PayloadFormat without its dim)."""
    kind: str = "fp16"                # fp32 | fp16 | int4
    scale: str = "group"              # int4 only: group (fp16 scales in each record) | channel (per-dimension
                                      # scales calibrated at export on the training split)
    group_size: int = 32              # values per fp16 group scale
    topk: Optional[int] = None        # None: dense; k: keep the k largest |z_i|


@dataclass
class PayloadConfig:
    """Payload formats per modality; modalities the model lacks are ignored. Vision tolerates INT4 well;
    text and audio keep fp16."""
    image: FormatSettings = field(default_factory=lambda: FormatSettings(kind="int4"))
    text: FormatSettings = field(default_factory=FormatSettings)
    audio: FormatSettings = field(default_factory=FormatSettings)


#: Modality-aware defaults as plain dicts {modality: {kind, scale, group_size, topk}} (from PayloadConfig).
DEFAULTS: dict[str, dict] = {f.name: dataclasses.asdict(getattr(PayloadConfig(), f.name))
                             for f in dataclasses.fields(PayloadConfig)}
