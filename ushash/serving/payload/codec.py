"""`PayloadCodec`: payload formats keyed by modality, all for one shared space, and their settings as an
export's manifest stores them. numpy only."""

from __future__ import annotations

import numpy as np

from ushash.serving.payload.format import PayloadFormat
from ushash.serving.payload.settings import DEFAULTS, PayloadError


class PayloadCodec:
    """Payload formats keyed by modality, all for `dim`-d shared-space vectors.

        codec = PayloadCodec.default(128, ("image", "text"))        # image int4, text fp16
        rec = codec.encode("image", z_img)                           # uint8 [N, codec.nbytes("image")]
        S, I = codec.rerank(z_txt_query, "image", cand, image_records, k=10)
        ok = codec.verify(z_query, "image", image_records[hit_ids], threshold=0.8)
    """

    def __init__(self, formats: dict[str, PayloadFormat]):
        if not formats:
            raise PayloadError("a payload codec needs at least one modality's format")
        dims = {f.dim for f in formats.values()}
        if len(dims) != 1:
            raise PayloadError(f"all payload formats must share one dim (the shared space); got {dims}")
        self.formats = dict(formats)
        self.dim = dims.pop()

    @classmethod
    def default(cls, dim: int, modalities=("image", "text", "audio"), overrides: dict | None = None) -> "PayloadCodec":
        """Modality-aware defaults (`DEFAULTS`), with per-modality overrides {modality: {field: value}};
        an override key "all" applies to every modality first."""
        overrides = dict(overrides or {})
        everyone = overrides.pop("all", None) or {}
        unknown = set(overrides) - set(modalities)
        if unknown:
            raise PayloadError(f"payload overrides for {sorted(unknown)}, not among the modalities {tuple(modalities)}")
        formats = {}
        for m in modalities:
            s = dict(DEFAULTS.get(m, DEFAULTS["text"]))
            s.update(everyone)
            s.update(overrides.get(m) or {})
            s.pop("dim", None)
            formats[m] = PayloadFormat.from_settings({"dim": dim, **s})
        return cls(formats)

    @classmethod
    def uniform(cls, dim: int, modalities, **settings) -> "PayloadCodec":
        """The same format for every modality."""
        return cls({m: PayloadFormat(dim=dim, **settings) for m in modalities})

    @classmethod
    def from_config(cls, dim: int, modalities, cfg: dict | None) -> "PayloadCodec":
        """From a config mapping like configs/payload/default.yaml: {all: {...}, image: {...}, ...}.
        Entries for modalities the model does not have are ignored (one config serves every model)."""
        cfg = {m: v for m, v in (cfg or {}).items() if m == "all" or m in tuple(modalities)}
        return cls.default(dim, modalities, overrides=cfg)

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.formats)

    def __getitem__(self, modality: str) -> PayloadFormat:
        try:
            return self.formats[modality]
        except KeyError:
            raise PayloadError(f"no payload format for modality {modality!r}; this codec has {self.modalities}") from None

    def __repr__(self) -> str:
        return "PayloadCodec(" + ", ".join(f"{m}={f.name} ({f.nbytes} B)" for m, f in self.formats.items()) + ")"

    def nbytes(self, modality: str) -> int:
        return self[modality].nbytes

    def entry_bytes(self, modality: str, bits: int) -> int:
        return self[modality].entry_bytes(bits)

    def fit(self, samples: dict) -> "PayloadCodec":
        """Calibrate channel scales: samples {modality: float [N, dim]}; formats without them ignore it."""
        for m, f in self.formats.items():
            if f.uses_channel_scales:
                if m not in samples:
                    raise PayloadError(f"{m} payload format {f.name} needs a calibration sample; got {sorted(samples)}")
                f.fit(samples[m])
        return self

    def encode(self, modality: str, x) -> np.ndarray:
        return self[modality].encode(x)

    def decode(self, modality: str, records) -> np.ndarray:
        return self[modality].decode(records)

    def scores(self, modality: str, q_unit: np.ndarray, records: np.ndarray, checked: bool = True) -> np.ndarray:
        """Cosines of one unit-norm query z with `modality` records (ushash.serving.payload.scoring.scores;
        checked=False for records the caller built itself)."""
        return self[modality].scores(q_unit, records, checked)

    def cosine(self, query, modality: str, records) -> np.ndarray:
        """Cosine of query z (any modality: the space is shared) with decoded `modality` records."""
        return self[modality].cosine(query, records)

    def verify(self, query, modality: str, records, threshold: float) -> np.ndarray:
        return self[modality].verify(query, records, threshold)

    def rerank(self, query, modality: str, candidates, records, k: int | None = None):
        return self[modality].rerank(query, candidates, records, k)

    # ------------------------------------------------------------------ serialisation (export manifest)
    def settings(self) -> dict:
        return {"dim": self.dim, "modalities": {m: f.settings() for m, f in self.formats.items()}}

    def tensors(self) -> dict[str, np.ndarray]:
        """Arrays to store beside the settings: channel scales, as payload.<modality>.channel_scales."""
        return {f"payload.{m}.channel_scales": f.channel_scales for m, f in self.formats.items()
                if f.channel_scales is not None}

    @classmethod
    def from_settings(cls, d: dict, tensors: dict | None = None) -> "PayloadCodec":
        tensors = tensors or {}
        mods = d.get("modalities") if isinstance(d, dict) else None
        if not isinstance(mods, dict) or not all(isinstance(s, dict) for s in mods.values()):
            raise PayloadError("payload settings need modalities: an object of modality -> an object of "
                               "its settings {kind, dim, ...}")
        formats = {}
        for m, s in mods.items():
            scales = tensors.get(f"payload.{m}.channel_scales")
            formats[m] = PayloadFormat.from_settings(s, channel_scales=None if scales is None else np.asarray(scales))
            if not formats[m].fitted:
                raise PayloadError(f"{m} payload format {formats[m].name} has no channel scales tensor "
                                   f"payload.{m}.channel_scales")
        codec = cls(formats)
        if "dim" in d and d["dim"] != codec.dim:
            raise PayloadError(f"payload settings say dim={d['dim']} but formats are {codec.dim}-d")
        return codec
