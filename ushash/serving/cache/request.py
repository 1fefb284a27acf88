"""Requests: raw media, encoder features or codes -> a `Query` (modality, packed code, shared-space z).

    enc = QueryEncoder(head)                  # head: an ExportedHead (or anything with encode/bits/...)
    q = enc("text", "a red fox")              # raw input through the export's frozen encoder
    q = enc("image", png_bytes)               # encoded file bytes, or a PIL image
    q = enc("audio", wav_bytes)               # encoded file bytes, or a mono float32 wave at enc rate
    q = enc("image", features=f)              # precomputed encoder features [in_dim]

Raw inputs need the frozen encoder the head was trained on. It is built on first use from the export's
manifest (encoder name + config) and must reproduce the manifest's weights fingerprint, or a
`RequestError` says so; or pass `encoder=` yourself. Bad input raises `RequestError` (a ValueError)
with a message meant for the client: unknown modality, undecodable media, wrong feature shape.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ushash.data import media

MODALITIES = ("image", "text", "audio")


class RequestError(ValueError):
    """The request cannot be turned into a code: the message says why (for a 4xx)."""


@dataclass
class Query:
    modality: str
    code: bytes                 # packed code, bits / 8 bytes (ushash.core.codes bit order)
    z: np.ndarray | None        # float32 [dim], unit L2 norm, shared-space embedding (payload check)
    revision: str | None = None  # the head revision that encoded it: it is looked up and stored only under
                                 # that revision (None: the cache's current one, for codes made elsewhere)


def _decode_bytes(modality: str, data: bytes, sample_rate: int | None, seconds: float | None,
                  limits: media.MediaLimits):
    """Encoded file bytes -> the raw value the encoder preprocesses, through ushash.data.media's decoder,
    from memory and within `limits` (checked before anything expensive is decoded)."""
    if not data:
        raise RequestError(f"empty {modality} input (0 bytes)")
    try:
        return media.decode_bytes(modality, data, None, sample_rate, seconds, limits=limits)
    except media.MediaError as e:
        raise RequestError(f"undecodable {modality}: {e.reason}") from None


def _unit(z) -> np.ndarray:
    """float32 copy with unit L2 norm (heads already normalise z; this guards rounding and stand-ins)."""
    z = np.asarray(z, np.float32).reshape(-1)
    return np.ascontiguousarray(z / max(float(np.sqrt(z @ z)), 1e-30))


def _out_of_range(modality: str) -> RequestError:
    return RequestError(f"{modality} features are out of the range the head encodes (its embedding "
                        f"overflows or vanishes); send the encoder's features unscaled")


def _units(z) -> list[np.ndarray]:
    """`_unit` of every row of z [B, dim], the same numbers: each row's norm taken as `_unit` takes it,
    the divisions done in one go (float32 by float32, as `_unit`'s division by a Python float is). The
    rows are views of one new array. One row (a single request): `_unit` itself, cheaper for one."""
    if len(z) == 1:
        return [_unit(z[0])]
    z = np.asarray(z, np.float32)
    norms = np.array([max(float(np.sqrt(r @ r)), 1e-30) for r in z], np.float32)
    return list(z / norms[:, None])


class QueryEncoder:
    def __init__(self, head, encoder=None, limits: media.MediaLimits | None = None):
        self.head = head
        self._encoder = encoder
        self.limits = limits if limits is not None else media.MediaLimits()
        self._lock = threading.Lock()

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.head.modalities)

    def check_modality(self, modality) -> str:
        if not isinstance(modality, str) or modality not in self.modalities:
            known = ", ".join(self.modalities)
            raise RequestError(f"modality {modality!r} is not served; this cache's head encodes: {known}")
        return modality

    # ------------------------------------------------------------------ encoder
    def encoder(self):
        with self._lock:
            if self._encoder is None:
                self._encoder = self._build_encoder()
            return self._encoder

    def _build_encoder(self):
        from ushash.encoders import build_encoder

        man = getattr(self.head, "manifest", None) or {}
        enc = man.get("encoder") or {}
        name = enc.get("name") or getattr(getattr(self.head, "encoder", None), "name", None)
        cfg = dict(enc.get("config") or {})
        if not name or name == "synthetic":
            raise RequestError(f"this head was trained on {name or 'unknown'!s} features: send precomputed "
                               f"features, not raw media")
        cfg["name"] = name
        cfg.setdefault("device", "cpu")
        try:
            encoder = build_encoder(cfg)
        except Exception as e:  # missing weights package, unknown args ...
            raise RequestError(f"cannot build the {name!r} encoder for raw inputs ({type(e).__name__}: {e}); "
                               f"send precomputed features instead") from e
        want = enc.get("fingerprint") or getattr(getattr(self.head, "encoder", None), "fingerprint", None)
        if want and encoder.fingerprint != want:
            raise RequestError(f"the {name!r} encoder built here has fingerprint {encoder.fingerprint}, the export "
                               f"was trained on {want}: raw inputs would give meaningless codes")
        tokenizers = enc.get("tokenizers") or {}
        here = {k: encoder.tokenizer_digests().get(k) for k in tokenizers}
        if here != tokenizers:
            raise RequestError(f"the {name!r} encoder built here reads other tokenizer files ({here}) than the "
                               f"export's features were made with ({tokenizers}): its texts would give meaningless "
                               f"codes; give it the tokenizer files it was trained with")
        return encoder

    def features(self, modality: str, data) -> np.ndarray:
        """Raw input -> encoder features float32 [in_dim]."""
        enc = self.encoder()
        if modality not in enc.modalities:
            raise RequestError(f"the encoder has no {modality} tower")
        if modality == "text":
            if isinstance(data, bytes):
                try:
                    data = data.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise RequestError(f"text is not valid UTF-8 ({e})") from None
            try:
                raw = media.load_text(data, self.limits)
            except media.MediaError as e:
                raise RequestError(f"bad text: {e.reason}") from None
            window = enc.text_tokens(raw)
            if window is not None and window[0] > window[1]:
                # keyed by its first tokens, it would share an entry with every text that starts the same
                raise RequestError(f"text of {window[0]} tokens is over the text encoder's window of {window[1]}: "
                                   f"its code would be that of its first {window[1]} tokens alone; shorten it")
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = _decode_bytes(modality, bytes(data), enc.sample_rate, enc.audio_seconds, self.limits)
        elif modality == "image":
            from PIL import Image
            if not isinstance(data, Image.Image):
                raise RequestError(f"image input must be encoded file bytes or a PIL image; got {type(data).__name__}")
            try:
                media.check_image_size(data.width, data.height, None, self.limits)
            except media.MediaError as e:
                raise RequestError(f"bad image: {e.reason}") from None
            raw = data.convert("RGB")
        else:
            try:
                raw = np.asarray(data, dtype=np.float32)
            except (TypeError, ValueError):
                raw = np.zeros(0, np.float32)
            if raw.ndim != 1 or raw.size == 0 or not np.isfinite(raw).all():
                raise RequestError("audio input must be encoded file bytes or a finite mono float wave [samples]")
            most = self.limits.max_audio_seconds
            if most is not None and raw.size > most * enc.sample_rate:
                raise RequestError(f"audio wave of {raw.size} samples is longer than max_audio_seconds={most:g}")
        x = enc.preprocess(modality, raw)
        return enc.encode(modality, enc.collate(modality, [x])).float().cpu().numpy()[0]

    # ------------------------------------------------------------------ query
    def __call__(self, modality: str, data=None, features=None) -> Query:
        modality = self.check_modality(modality)
        if (data is None) == (features is None):
            raise RequestError("give exactly one of: the raw input, or precomputed encoder features")
        if features is None:
            features = self.features(modality, data)
        return self.from_features(modality, features)

    def from_features(self, modality: str, features) -> Query:
        f = np.asarray(features)
        want = getattr(self.head, "in_dims", {}).get(modality)
        if f.ndim != 1 or (want is not None and f.shape[0] != want):
            raise RequestError(f"{modality} features must be a vector of {want or 'in_dim'} floats; got shape {f.shape}")
        return self.from_feature_rows(modality, f[None])[0]

    def from_feature_rows(self, modality: str, features) -> list[Query]:
        """Queries for encoder features [B, in_dim], encoded in one forward pass: `head.encode`, or for one
        row the head's `encode_row` where it has one (ExportedHead: compiled for one row, its z unit to
        rounding as it comes)."""
        modality = self.check_modality(modality)
        f = np.asarray(features)
        want = getattr(self.head, "in_dims", {}).get(modality)
        if f.ndim != 2 or (want is not None and f.shape[1] != want):
            raise RequestError(f"{modality} features must be rows of {want or 'in_dim'} floats; got shape {f.shape}")
        if f.dtype == np.float32:  # what a served request holds: the checks below in one (a float32 is one)
            if not np.isfinite(f).all():
                raise RequestError(f"{modality} features must be finite numbers")
            if len(f) == 0:
                return []
            f32 = f
        else:
            if not (np.issubdtype(f.dtype, np.floating) or np.issubdtype(f.dtype, np.integer)) or not np.isfinite(f).all():
                raise RequestError(f"{modality} features must be finite numbers")
            if len(f) == 0:
                return []
            with np.errstate(over="ignore", invalid="ignore"):
                f32 = f.astype(np.float32)
            if not np.isfinite(f32).all():
                raise RequestError(f"{modality} features must be finite float32 numbers (|x| < 3.4e38)")
        rev = str(getattr(self.head, "revision", "")) or None
        row = getattr(self.head, "encode_row", None) if len(f32) == 1 else None
        if row is not None:    # one request row: the head's own pass for one (ExportedHead's compiled kernels)
            code, z1 = row(modality, f32[0])   # z1 float32, unit to rounding (normalised in float64)
            if not (np.isfinite(z1).all() and z1.any()):
                raise _out_of_range(modality)
            return [Query(modality, code, z1, rev)]
        codes, z = self.head.encode(modality, f32)
        z = np.asarray(z)
        if z.dtype != np.float32:  # float32 (every head's) is checked as it is: float64 would say the same
            z = z.astype(np.float64)
        if not np.isfinite(z).all() or not np.any(z, axis=1).all():
            raise _out_of_range(modality)
        return [Query(modality, codes[i].tobytes(), u, rev) for i, u in enumerate(_units(z))]
