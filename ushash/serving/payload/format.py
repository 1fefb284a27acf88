"""The payload record format: one fixed-size byte layout per `PayloadFormat` (the package docstring,
ushash/serving/payload/__init__.py, describes the layout), its sizes, settings, calibration, encoding and
decoding. Cosines, verification and re-ranking on the records are ushash.serving.payload.scoring.

numpy only (the serving runtime imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from ushash.core.jit import njit

from ushash.serving.payload import scoring
from ushash.serving.payload.scoring import _as_float2d
from ushash.serving.payload.settings import FormatSettings, PayloadError

KINDS = ("fp32", "fp16", "int4")
SCALES = ("group", "channel")
INT4_MAX = 7
_VALUE_BYTES = {"fp32": 4, "fp16": 2}


# ---------------------------------------------------------------------------------------------- int4

def _nibbles_pack(q: np.ndarray) -> np.ndarray:
    """int8 in [-7, 7] [N, L] -> uint8 [N, ceil(L/2)] (q + 8, even position in the low nibble)."""
    u = (q + 8).astype(np.uint8)
    if u.shape[1] % 2:
        u = np.concatenate([u, np.full((len(u), 1), 8, np.uint8)], axis=1)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def _nibbles_unpack(b: np.ndarray, length: int) -> np.ndarray:
    """uint8 [N, ceil(L/2)] -> int8 [N, L]."""
    out = np.empty((len(b), b.shape[1] * 2), np.int8)
    out[:, 0::2] = (b & 0x0F).astype(np.int8)
    out[:, 1::2] = (b >> 4).astype(np.int8)
    out -= 8
    return out[:, :length]


@njit(cache=True, nogil=True)
def _half(lo, hi):
    """An fp16 from its two little-endian bytes, as float32."""
    h = np.uint32(lo) | (np.uint32(hi) << np.uint32(8))
    sign = -1.0 if h & 0x8000 else 1.0
    e = (h >> 10) & 0x1F
    f = h & 0x3FF
    if e == 0:
        return np.float32(sign * f * 2.0 ** -24)
    if e == 31:
        return np.float32(sign * np.inf) if f == 0 else np.float32(np.nan)
    return np.float32(sign * (1.0 + f / 1024.0) * 2.0 ** (int(e) - 15))


@njit(cache=True, nogil=True)
def _int4_group_value(r, k, i, sc32, o_vals):
    """Value i of record k: (nibble i - 8) * its group's scale."""
    byte = r[k, o_vals + i // 2]
    nib = (byte & 0x0F) if i % 2 == 0 else (byte >> 4)
    return np.float32(np.int32(nib) - 8) * sc32


@njit(cache=True, nogil=True)
def _int4_group_values(r, o_scale, o_vals, length, group):
    """float32 [N, L] of int4 records with fp16 group scales (the `scale="group"` layout), in one compiled
    pass: value i = (nibble i - 8) * scale of group i // group."""
    n = r.shape[0]
    out = np.empty((n, length), np.float32)
    for k in range(n):
        for g in range((length + group - 1) // group):
            sc32 = _half(r[k, o_scale + 2 * g], r[k, o_scale + 2 * g + 1])
            for i in range(g * group, min(length, (g + 1) * group)):
                out[k, i] = _int4_group_value(r, k, i, sc32, o_vals)
    return out


@njit(cache=True, nogil=True)
def _int4_group_cosines(r, o_scale, o_vals, length, group, q, per_row):
    """Cosines float32 [N] of int4 group-scaled records with unit-norm q (row k of q for record k when
    per_row, else row 0), decoding on the fly: no decoded array is made."""
    n = r.shape[0]
    out = np.empty(n, np.float32)
    for k in range(n):
        out[k] = int4_group_cosine(r, k, o_scale, o_vals, length, group, q, k if per_row else 0)
    return out


@njit(cache=True, nogil=True)
def int4_group_cosine(r, k, o_scale, o_vals, length, group, q, qi):
    """The cosine of record k of r with row qi of q (unit norm): `_int4_group_cosines`'s arithmetic for one
    record, also called by compiled callers (the L1's fused hit check), so that both give the same bits."""
    dot = 0.0
    nn = 0.0
    for g in range((length + group - 1) // group):
        sc32 = _half(r[k, o_scale + 2 * g], r[k, o_scale + 2 * g + 1])
        for i in range(g * group, min(length, (g + 1) * group)):
            v = _int4_group_value(r, k, i, sc32, o_vals)
            dot += v * q[qi, i]
            nn += v * v
    return np.float32(dot / max(np.sqrt(nn), 1e-15))


def _group_scales(x: np.ndarray, group: int) -> np.ndarray:
    """fp16 scales [N, ceil(L/group)]: absmax / 7 of each group, rounded to fp16 (a group longer than the row is
    the row: not padded to its size)."""
    n, length = x.shape
    group = max(1, min(group, length))
    ng = -(-length // group)
    pad = ng * group - length
    a = np.abs(x)
    if pad:
        a = np.concatenate([a, np.zeros((n, pad), np.float32)], axis=1)
    with np.errstate(over="ignore"):
        s = (a.reshape(n, ng, group).max(axis=2) / INT4_MAX).astype(np.float16)
    if not np.isfinite(s).all():
        raise PayloadError("values too large for fp16 group scales (|x| > 458,000); use kind='fp32'")
    return s


def _inverse(scale: np.ndarray) -> np.ndarray:
    """1 / scale as float32, 0 where the scale is 0 (those values quantize to 0)."""
    scale = np.asarray(scale, np.float32)
    return np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale > 0)


def _quantize(x: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """int8 q = clip(round(x * inv), -7, 7), inv = 1 / scale broadcast to x (one multiply instead of a
    division: at most one ulp from x / scale, the error bound |x - q * scale| <= scale / 2 holds)."""
    q = x * inv
    np.rint(q, out=q)
    np.clip(q, -INT4_MAX, INT4_MAX, out=q)
    return q.astype(np.int8)


def _expand_groups(s: np.ndarray, group: int, length: int) -> np.ndarray:
    return np.repeat(s.astype(np.float32), max(1, min(group, length)), axis=1)[:, :length]



# ---------------------------------------------------------------------------------------------- format

@dataclass(eq=False)
class PayloadFormat:
    """One fixed-size payload format for `dim`-d vectors (see the module docstring for the layout)."""

    dim: int
    kind: str = FormatSettings.kind
    scale: str = FormatSettings.scale
    group_size: int = FormatSettings.group_size
    topk: int | None = FormatSettings.topk
    channel_scales: np.ndarray | None = field(default=None, repr=False)  # float32 [dim], scale="channel"

    def __post_init__(self):
        if isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer)) or self.dim < 1:
            raise PayloadError(f"dim must be a positive int; got {self.dim!r}")
        self.dim = int(self.dim)
        if self.kind not in KINDS:
            raise PayloadError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if self.scale not in SCALES:
            raise PayloadError(f"scale must be one of {SCALES}; got {self.scale!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, (int, np.integer)) or self.group_size < 1:
            raise PayloadError(f"group_size must be a positive int; got {self.group_size!r}")
        self.group_size = int(self.group_size)
        if self.topk is not None:
            if isinstance(self.topk, bool) or not isinstance(self.topk, (int, np.integer)) or not 1 <= self.topk <= self.dim:
                raise PayloadError(f"topk must be None or an int in [1, dim={self.dim}]; got {self.topk!r}")
            self.topk = int(self.topk)
        if self.channel_scales is not None:
            s = np.asarray(self.channel_scales, dtype=np.float32)
            if s.shape != (self.dim,) or not np.isfinite(s).all() or (s < 0).any():
                raise PayloadError(f"channel_scales must be finite non-negative float32 [{self.dim}]; got shape {s.shape}")
            self.channel_scales = s

    # ------------------------------------------------------------------ sizes
    @property
    def length(self) -> int:
        """Values stored per vector: dim, or topk when sparse."""
        return self.topk if self.topk is not None else self.dim

    @property
    def uses_channel_scales(self) -> bool:
        return self.kind == "int4" and self.scale == "channel"

    @property
    def fitted(self) -> bool:
        return not self.uses_channel_scales or self.channel_scales is not None

    @property
    def index_encoding(self) -> str | None:
        """'bitmask', 'u8' or 'u16' for sparse formats (the smaller), None when dense."""
        if self.topk is None:
            return None
        width = 1 if self.dim <= 256 else 2
        return "bitmask" if -(-self.dim // 8) <= self.topk * width else ("u8" if width == 1 else "u16")

    @property
    def index_bytes(self) -> int:
        enc = self.index_encoding
        if enc is None:
            return 0
        return -(-self.dim // 8) if enc == "bitmask" else self.topk * (1 if enc == "u8" else 2)

    @property
    def n_groups(self) -> int:
        return -(-self.length // self.group_size) if self.kind == "int4" and self.scale == "group" else 0

    @property
    def scale_bytes(self) -> int:
        return 2 * self.n_groups

    @property
    def value_bytes(self) -> int:
        return -(-self.length // 2) if self.kind == "int4" else _VALUE_BYTES[self.kind] * self.length

    @property
    def nbytes(self) -> int:
        """Bytes per record (per cache entry, payload only)."""
        return self.index_bytes + self.scale_bytes + self.value_bytes

    def entry_bytes(self, bits: int) -> int:
        """Bytes per cache entry: the packed `bits`-bit code plus this payload."""
        return int(bits) // 8 + self.nbytes

    @property
    def name(self) -> str:
        """Short label, e.g. 'int4/g32+top32', 'fp16', 'int4/channel'."""
        s = self.kind
        if self.kind == "int4":
            s += "/channel" if self.scale == "channel" else f"/g{self.group_size}"
        if self.topk is not None:
            s += f"+top{self.topk}"
        return s

    # ------------------------------------------------------------------ config
    def settings(self) -> dict:
        """Plain JSON-able settings (no channel scales: those are a tensor), with derived sizes."""
        int4 = self.kind == "int4"
        return {"kind": self.kind, "scale": self.scale if int4 else None,
                "group_size": self.group_size if int4 and self.scale == "group" else None, "topk": self.topk,
                "dim": self.dim, "nbytes": self.nbytes, "index_encoding": self.index_encoding,
                "int4_range": [-INT4_MAX, INT4_MAX] if self.kind == "int4" else None}

    @classmethod
    def from_settings(cls, d: dict, channel_scales=None) -> "PayloadFormat":
        known = {"kind", "scale", "group_size", "topk", "dim", "nbytes", "index_encoding", "int4_range"}
        extra = set(d) - known
        if extra:
            raise PayloadError(f"unknown payload settings {sorted(extra)}; known: {sorted(known)}")
        if "dim" not in d:
            raise PayloadError(f"payload settings need dim; got {sorted(d)}")
        fmt = cls(dim=d["dim"], kind=d.get("kind") or FormatSettings.kind, scale=d.get("scale") or FormatSettings.scale,
                  group_size=d.get("group_size") or FormatSettings.group_size, topk=d.get("topk"),
                  channel_scales=channel_scales)
        if "nbytes" in d and d["nbytes"] != fmt.nbytes:
            raise PayloadError(f"payload settings say nbytes={d['nbytes']} but {fmt.name} on {fmt.dim}-d "
                               f"vectors is {fmt.nbytes} bytes")
        return fmt

    def fit(self, x, percentile: float = 100.0) -> "PayloadFormat":
        """Calibrate channel scales on a sample x [N, dim] (absmax, or a percentile of |x|, per dim / 7).

        No-op for formats without channel scales. Returns self."""
        if not self.uses_channel_scales:
            return self
        x = _as_float2d(x, "x", self.dim)
        if len(x) == 0:
            raise PayloadError("fit needs at least one calibration vector")
        a = np.abs(x)
        if self.topk is not None:  # calibrate on what is kept
            a = a * self._topk_mask(x)
        top = a.max(axis=0) if percentile >= 100 else np.percentile(a, percentile, axis=0)
        self.channel_scales = (top / INT4_MAX).astype(np.float32)
        return self

    # ------------------------------------------------------------------ encode / decode
    def _topk_mask(self, x: np.ndarray) -> np.ndarray:
        """bool [N, dim] with exactly k True per row: the k largest |x|, ties to the lower dimension.

        Each value gets one exact integer key, (bits of |x| as int32, which order like the floats) * 2^s
        + (dim - 1 - i): keys are distinct within a row, so the k-th largest key (a partial sort) splits
        the row exactly and deterministically, without a full stable argsort."""
        k, d = self.topk, self.dim
        if k == d:
            return np.ones(x.shape, bool)
        shift = max(1, int(d - 1).bit_length())
        key = (np.abs(x).astype(np.float32).view(np.int32).astype(np.int64) << shift) | (d - 1 - np.arange(d))
        kth = np.partition(key, d - k, axis=1)[:, d - k]
        return key >= kth[:, None]

    def check_ready(self):
        if not self.fitted:
            raise PayloadError(f"payload format {self.name} needs channel scales: call fit(sample) first "
                               f"(the export calibrates them on the training split)")

    def encode(self, x) -> np.ndarray:
        """float [N, dim] (or [dim]) -> records uint8 [N, nbytes]."""
        self.check_ready()
        x = _as_float2d(x, "x", self.dim)
        n = len(x)
        parts = []
        idx = None
        if self.topk is not None:
            mask = self._topk_mask(x)
            flat = np.flatnonzero(mask)  # row-major: ascending dimension within each row
            vals = x.ravel()[flat].reshape(n, self.topk)
            idx = flat.reshape(n, self.topk) % self.dim
            enc = self.index_encoding
            if enc == "bitmask":
                parts.append(np.packbits(mask, axis=1, bitorder="little"))
            else:
                parts.append(idx.astype("<u2" if enc == "u16" else np.uint8).view(np.uint8).reshape(n, -1))
        else:
            vals = x
        if self.kind == "fp32":
            parts.append(vals.astype("<f4").view(np.uint8).reshape(n, -1))
        elif self.kind == "fp16":
            with np.errstate(over="ignore"):
                v16 = vals.astype("<f2")
            if not np.isfinite(v16).all():
                raise PayloadError("values too large for fp16 (|x| > 65504); use kind='fp32'")
            parts.append(v16.view(np.uint8).reshape(n, -1))
        elif self.scale == "group":
            s16 = _group_scales(vals, self.group_size)
            parts.append(s16.astype("<f2").view(np.uint8).reshape(n, -1))
            inv = _expand_groups(_inverse(s16), self.group_size, self.length)
            parts.append(_nibbles_pack(_quantize(vals, inv)))
        else:
            s = self.channel_scales[idx] if idx is not None else self.channel_scales[None, :]
            parts.append(_nibbles_pack(_quantize(vals, _inverse(s))))
        out = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        return np.ascontiguousarray(out, dtype=np.uint8).reshape(n, self.nbytes)

    def check_records(self, records, name: str = "records") -> np.ndarray:
        if not isinstance(records, np.ndarray) or records.dtype != np.uint8:
            raise PayloadError(f"{name} must be a uint8 numpy array [N, {self.nbytes}] ({self.name}); "
                               f"got {type(records).__name__} {getattr(records, 'dtype', '')}")
        if records.ndim == 1:
            records = records[None]
        if records.ndim != 2 or records.shape[1] != self.nbytes:
            raise PayloadError(f"{name} must be uint8 [N, {self.nbytes}] for payload format {self.name} on "
                               f"{self.dim}-d vectors; got shape {records.shape}")
        return np.ascontiguousarray(records)

    def decode(self, records) -> np.ndarray:
        """records uint8 [N, nbytes] -> float32 [N, dim] (zeros outside the kept top-k)."""
        self.check_ready()
        return self.decode_unchecked(self.check_records(records))

    def decode_unchecked(self, records: np.ndarray, copy: bool = True) -> np.ndarray:
        """`decode` without the argument checks, for records known to be C-contiguous uint8 [N, nbytes] of
        this (fitted) format: the cache's own entries. Corrupt sparse positions are still refused. copy=False
        lets fp32 records come back as a view of `records`."""
        r = records
        n, length = len(r), self.length
        o = 0
        if self.topk is not None:
            ib = self.index_bytes
            raw = r[:, :ib]
            o = ib
            enc = self.index_encoding
            if enc == "bitmask":
                mask = np.unpackbits(raw, axis=1, count=self.dim, bitorder="little").view(bool)
                counts = mask.sum(axis=1)
                if n and (counts != self.topk).any():
                    bad = int(np.flatnonzero(counts != self.topk)[0])
                    raise PayloadError(f"corrupt payload record {bad}: bitmask has {int(counts[bad])} positions, "
                                       f"format {self.name} stores {self.topk}")
            else:
                idx = np.ascontiguousarray(raw).view("<u2" if enc == "u16" else np.uint8).astype(np.int64)
                if n and (idx >= self.dim).any():
                    raise PayloadError(f"corrupt payload records: index >= dim={self.dim}")
                mask = np.zeros((n, self.dim), bool)
                np.put_along_axis(mask, idx, True, axis=1)
                if n and (mask.sum(axis=1) != self.topk).any():
                    raise PayloadError("corrupt payload records: repeated indices")
        if self.kind in _VALUE_BYTES:
            dt = "<f4" if self.kind == "fp32" else "<f2"
            vals = np.ascontiguousarray(r[:, o:o + self.value_bytes]).view(dt).astype(np.float32, copy=copy)
        elif self.scale == "group":
            vals = _int4_group_values(r, o, o + self.scale_bytes, length, self.group_size)
        else:
            vals = _nibbles_unpack(r[:, o:o + self.value_bytes], length).astype(np.float32)
            if self.topk is None:
                vals *= self.channel_scales[None, :]
        if self.topk is None:
            return vals  # fresh and C-contiguous in every path, unless copy=False on fp32 (a view)
        # values are in ascending dimension order, and boolean assignment fills row-major: no index arrays
        out = np.zeros(n * self.dim, np.float32)
        out[np.flatnonzero(mask)] = vals.ravel()  # (7x faster than out[mask] = ... on numpy 2.4)
        out = out.reshape(n, self.dim)
        if self.uses_channel_scales:
            out *= self.channel_scales[None, :]
        return out

    def roundtrip(self, x) -> np.ndarray:
        return self.decode(self.encode(x))

    # ------------------------------------------------------------------ operations (ushash.serving.payload.scoring)
    def cosine(self, query, records) -> np.ndarray:
        """Row-wise cosine float32 [N] between query [N, dim] (or one [dim] for all) and decoded records [N]."""
        return scoring.cosine(self, query, records)

    def scores(self, q_unit: np.ndarray, records: np.ndarray, checked: bool = True) -> np.ndarray:
        """Cosines float32 [N] of one unit-norm query [dim] (or one per record, [N, dim]) with records
        [N, nbytes] (scoring.scores). The dense int4 group-scaled format decodes and scores in one compiled
        pass (the cache's default image payload)."""
        if self.kind == "int4" and self.scale == "group" and self.topk is None:
            if checked:
                self.check_ready()
                records = self.check_records(records)
                q_unit = scoring.check_query(self, q_unit, len(records))
            q = np.asarray(q_unit, np.float32)
            return _int4_group_cosines(records, 0, self.scale_bytes, self.length, self.group_size,
                                       q if q.ndim == 2 else q[None], q.ndim == 2)
        return scoring.scores(self, q_unit, records, checked)

    def verify(self, query, records, threshold: float) -> np.ndarray:
        """bool [N]: cosine(query, decoded record) >= threshold (the cache's hit check)."""
        return scoring.verify(self, query, records, threshold)

    def rerank(self, query, candidates, records, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Candidate lists re-ranked by cosine with their decoded payloads (scoring.rerank)."""
        return scoring.rerank(self, query, candidates, records, k)


def memory_bytes(n_entries: int, fmt: PayloadFormat, bits: int = 64) -> int:
    """Bytes that n_entries cache entries need for code + payload (no index or key overhead)."""
    return int(n_entries) * fmt.entry_bytes(bits)


def describe(fmt: PayloadFormat) -> str:
    """Human-readable layout, e.g. 'bitmask 16 B + fp16 scales 2 B + int4 values 16 B = 34 B'."""
    parts = []
    if fmt.index_bytes:
        parts.append(f"{fmt.index_encoding} {fmt.index_bytes} B")
    if fmt.scale_bytes:
        parts.append(f"fp16 scales {fmt.scale_bytes} B")
    parts.append(f"{fmt.kind} values {fmt.value_bytes} B")
    return " + ".join(parts) + f" = {fmt.nbytes} B"
