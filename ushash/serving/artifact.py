"""Serving-side loader of exported hash heads (`python -m ushash.export` writes them; docs/export.md).

    head = load_export("exports/tuxpaint-offline-64b", expect_bits=64, expect_encoder=("offline", "463bf8..."))
    codes = head.codes("image", feats)        # packed uint8 [N, bits/8], bit-identical to ushash.eval's
    z = head.embed("text", feats)             # float32 [N, dim], the shared space
    rec = head.payload.encode("image", z)     # the cache entry's payload (ushash.serving.payload)
    code, z1 = head.encode_row("text", row)   # one row, as a cache request: compiled (ushash.serving.rowpass)

An export is a directory with `manifest.json` and `weights.safetensors`, nothing else and no pickle.
This module imports only numpy, torch, safetensors, json and the standard library, plus
ushash.serving.payload (numpy only), ushash.hashing.forward (torch only) and ushash.serving.rowpass
(numba): no Hydra, no Lightning, no training code. The manifest's layer list is rebuilt into the torch
modules it came from and run by the forward pass `USHash` runs (ushash.hashing.forward), so `encode`'s
(and `codes`', `embed`'s) numbers are bit-identical to `USHash.encode` on the same device. `encode_row`,
what a cache's single request runs, is the same layer list compiled for one row: z to float32 rounding
of `encode`'s, the same code unless a logit is within rounding of zero (docs/export.md).

Refusals (all `ExportError`, a ValueError; the class and the message say which):
    CorruptExport       missing or unparsable manifest / weights, missing or malformed fields, wrong tensor
                        shapes or dtypes (float32 only), non-finite weights, a file that is a symlink or
                        not a regular file
    TruncatedExport     a file shorter (or longer) than the manifest records (a CorruptExport)
    TamperedExport      a sha256 that does not match: a file, or the manifest's own canonical hash
    IncompatibleExport  format name / version this loader does not read, or bits / encoder that differ
                        from what the caller expects
"""

from __future__ import annotations

import hashlib
import json
from functools import partial
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ushash.core import codes as codes_lib
from ushash.hashing import forward as fwd
from ushash.hashing.forward import HashHead
from ushash.serving.payload import PayloadCodec, PayloadError
from ushash.serving.rowpass import RowPass

FORMAT = "ushash-export"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
ALLOWED_SUFFIXES = (".json", ".safetensors")  # no pickle anywhere in an export
MAX_MANIFEST_BYTES = 64 << 20                  # manifest.json is read whole: far above any real one


class ExportError(ValueError):
    """An export that cannot be served. Subclasses say why."""


class CorruptExport(ExportError):
    pass


class TruncatedExport(CorruptExport):
    pass


class TamperedExport(ExportError):
    pass


class IncompatibleExport(ExportError):
    pass


class EncoderId(NamedTuple):
    name: str
    fingerprint: str


# ---------------------------------------------------------------------------------------------- hashing

def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own `manifest_sha256` field."""
    return sha256_bytes(canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"}))


def revision_id(weights_sha256: str, manifest: dict) -> str:
    """16 hex digits from the weights file's sha256 and everything that gives the weights a meaning
    (format version, bits, dim, modalities, layer list, payload settings, encoder). Same weights and
    settings -> same revision; any change to a code or a payload byte -> a new one."""
    basis = {k: manifest.get(k) for k in ("format", "format_version", "bits", "dim", "modalities", "head",
                                          "prototypes", "payload")}
    enc = manifest.get("encoder") or {}
    basis["encoder"] = {"name": enc.get("name"), "fingerprint": enc.get("fingerprint")}
    return sha256_bytes(weights_sha256.encode() + b"\0" + canonical_json(basis))[:16]


# ---------------------------------------------------------------------------------------------- head

class ServedHead(HashHead, Protocol):
    """A head the cache can serve: a `HashHead` (bits, dim, in_dims, modalities, encode) that also says
    which model it is (`revision`, `encoder`, `manifest`), how entries store its z (`payload`), and gives
    z and codes alone (`embed`, `codes`). `ExportedHead` and `ushash.serving.cache.lsh.LSHHead` are. A head
    may also offer `encode_row(modality, row) -> (code bytes, z)`, which the cache then runs for a one-row
    request instead of `encode` (ExportedHead's compiled row pass)."""

    revision: str
    encoder: EncoderId
    manifest: dict
    payload: PayloadCodec

    def embed(self, modality: str, features) -> np.ndarray: ...

    def codes(self, modality: str, features) -> np.ndarray: ...


class ExportedHead:
    """A loaded export: per-modality projection heads + prototypes (run by ushash.hashing.forward, the
    forward pass training uses), and the payload codec."""

    def __init__(self, manifest: dict, tensors: dict[str, torch.Tensor], device: str | torch.device = "cpu"):
        self.manifest = manifest
        self.bits = int(manifest["bits"])
        self.dim = int(manifest["dim"])
        self.in_dims = {m: int(v["in_dim"]) for m, v in manifest["modalities"].items()}
        self.revision = str(manifest["revision"])
        enc = manifest["encoder"]
        self.encoder = EncoderId(str(enc["name"]), str(enc["fingerprint"]))
        self.device = torch.device(device)
        on_device = {k: v.to(self.device) for k, v in tensors.items()}
        self.layers = {m: fwd.from_ops(manifest["head"]["layers"][m], on_device) for m in self.in_dims}
        self.prototypes = on_device[manifest["prototypes"]["tensor"]]
        # what is constant in eval, made once here rather than on every request: the layers as one chain
        # of torch ops and the normalised prototypes (ushash.hashing.forward; the same numbers)
        self._embed = {m: partial(fwd.embed, fwd.eval_steps(layers)) for m, layers in self.layers.items()}
        with torch.no_grad():
            self._unit = fwd.unit_prototypes(self.prototypes)
        # one request row on the CPU: the same layers as compiled kernels (ushash.serving.rowpass)
        try:
            self._rows = ({m: RowPass(manifest["head"]["layers"][m], on_device, self._unit) for m in self.in_dims}
                          if self.device.type == "cpu" else {})
        except (ValueError, TypeError, KeyError) as e:
            raise CorruptExport(f"corrupt export: layer list unusable ({e})") from e
        np_tensors = {k: v.cpu().numpy() for k, v in tensors.items() if k.startswith("payload.")}
        try:
            self.payload = PayloadCodec.from_settings(manifest["payload"], np_tensors)
        except (PayloadError, KeyError, TypeError) as e:
            raise CorruptExport(f"corrupt export: payload settings unreadable ({e})") from e
        missing = [m for m in self.in_dims if m not in self.payload.modalities]
        if self.payload.dim != self.dim or missing:
            raise CorruptExport(f"corrupt export: payload formats are {self.payload.dim}-d for "
                                f"{self.payload.modalities}, the head's shared space is {self.dim}-d for "
                                f"{self.modalities}; re-export")

    @property
    def modalities(self) -> tuple[str, ...]:
        return tuple(self.in_dims)

    def __repr__(self) -> str:
        return (f"ExportedHead(revision={self.revision}, bits={self.bits}, dim={self.dim}, "
                f"modalities={self.modalities}, encoder={self.encoder.name}-{self.encoder.fingerprint}, "
                f"payload={self.payload!r})")

    def _check(self, modality: str, features) -> np.ndarray:
        if modality not in self.in_dims:
            raise ValueError(f"no head for modality {modality!r}; this export has {self.modalities}")
        x = np.asarray(features)
        if x.ndim == 1:
            x = x[None]
        d = self.in_dims[modality]
        if x.ndim != 2 or x.shape[1] != d:
            raise ValueError(f"{modality} features: expected [B, {d}] from encoder {self.encoder.name}, "
                             f"got {list(x.shape)}")
        return x

    def encode(self, modality: str, features) -> tuple[np.ndarray, np.ndarray]:
        """(packed codes uint8 [N, bits/8], z float32 [N, dim]) for raw encoder features [N, in_dim]."""
        x = self._check(modality, features)
        return fwd.encode(self._embed[modality], self.prototypes, x, self.bits, self.dim, unit=self._unit)

    def encode_row(self, modality: str, row: np.ndarray) -> tuple[bytes, np.ndarray]:
        """(packed code bytes, z float32 [dim]) of one float32 row [in_dim] of checked, finite features: the
        cache's single requests. On the CPU the compiled row pass (ushash.serving.rowpass: z to float32
        rounding of `encode`'s, the same code unless a logit is within rounding of zero); on a GPU `encode`."""
        rows = self._rows.get(modality)
        if rows is None:
            codes, z = self.encode(modality, row[None])
            return codes[0].tobytes(), z[0]
        code, z = rows(np.ascontiguousarray(row, dtype=np.float32))
        return code.tobytes(), z

    def warm_up(self) -> None:
        """Load the row pass's compiled kernels now rather than during a first request."""
        for rows in self._rows.values():
            rows.warm_up()

    def embed(self, modality: str, features) -> np.ndarray:
        """Shared-space z, float32 [N, dim], L2-normalised: what the payload holds."""
        return self.encode(modality, features)[1]

    def codes(self, modality: str, features) -> np.ndarray:
        """Packed codes uint8 [N, bits/8] (bit i = bit i%8 of byte i//8, LSB first, as ushash.core.codes)."""
        return self.encode(modality, features)[0]


# ---------------------------------------------------------------------------------------------- loading

def _encoder_expectation(expect) -> tuple[str | None, str | None]:
    if expect is None:
        return None, None
    if isinstance(expect, str):
        return expect, None
    if isinstance(expect, dict):
        return expect.get("name"), expect.get("fingerprint")
    if isinstance(expect, (tuple, list)) and len(expect) == 2:
        return expect[0], expect[1]
    if hasattr(expect, "name") and hasattr(expect, "fingerprint"):  # an EncoderId or a built Encoder
        return expect.name, expect.fingerprint
    raise TypeError(f"expect_encoder must be a name, (name, fingerprint), a dict or an encoder; got {expect!r}")


def _require(manifest: dict, keys) -> None:
    missing = [k for k in keys if k not in manifest]
    if missing:
        raise CorruptExport(f"corrupt export: manifest.json lacks {missing}")


def _read_member(path: Path, name: str, size: int | None = None) -> bytes:
    """The bytes of one file of the export folder: a regular file in it, not a symlink (which could point
    out of the folder) nor a FIFO or device (which could block or never end). size: the bytes the manifest
    records, checked before reading (a larger file is never read into memory); None: at most
    MAX_MANIFEST_BYTES."""
    import os
    import stat

    f = path / name
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise CorruptExport(f"corrupt export: {name} is missing from {path}") from None
    if stat.S_ISLNK(st.st_mode):
        raise CorruptExport(f"corrupt export: {name} is a symlink; an export holds its own files (copy them in)")
    if not stat.S_ISREG(st.st_mode):
        raise CorruptExport(f"corrupt export: {name} is not a regular file")
    try:
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise CorruptExport(f"corrupt export: cannot read {name} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        have = os.fstat(fh.fileno()).st_size
        if size is not None and have != size:
            raise TruncatedExport(f"truncated export: {name} has {have} bytes, the manifest records {size}")
        if size is None and have > MAX_MANIFEST_BYTES:
            raise CorruptExport(f"corrupt export: {name} has {have} bytes, more than any manifest "
                                f"({MAX_MANIFEST_BYTES} at most)")
        return fh.read(have + 1)   # a file grown since is seen as such (and refused by its length)


def read_manifest(path: str | Path) -> dict:
    """Parse and integrity-check manifest.json (format, version, its own sha256); no weights read."""
    path = Path(path)
    mf = path / MANIFEST
    if not path.is_dir():
        raise CorruptExport(f"corrupt export: {path} is not a directory (an export is a folder with {MANIFEST})")
    if not mf.exists() and not mf.is_symlink():
        raise CorruptExport(f"corrupt export: {path} has no {MANIFEST}")
    data = _read_member(path, MANIFEST)
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:   # nested past the interpreter's limit
        raise CorruptExport(f"corrupt export: {mf} is not valid JSON ({type(e).__name__}: {e}); truncated or "
                            f"damaged") from e
    if not isinstance(manifest, dict):
        raise CorruptExport(f"corrupt export: {mf} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise IncompatibleExport(f"incompatible export: format {manifest.get('format')!r}, this loader reads {FORMAT!r}")
    if manifest.get("format_version") not in SUPPORTED_VERSIONS:
        raise IncompatibleExport(f"incompatible export: format version {manifest.get('format_version')!r}, this "
                                 f"loader reads versions {SUPPORTED_VERSIONS}; re-export with a matching ushash")
    _require(manifest, ("manifest_sha256", "files", "bits", "dim", "modalities", "head", "prototypes", "encoder",
                        "payload", "revision", "tensors"))
    if manifest_digest(manifest) != manifest["manifest_sha256"]:
        raise TamperedExport(f"tampered export: {mf} does not match its manifest_sha256 (edited after export)")
    _check_shape_of_manifest(manifest)
    return manifest


def _check_shape_of_manifest(m: dict) -> None:
    """The types of the fields a loader reads (a CorruptExport naming the field, never a KeyError or a
    TypeError from deep inside)."""
    def bad(field, want):
        raise CorruptExport(f"corrupt export: manifest {field} must be {want}")

    def posint(v):
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if not posint(m["bits"]):
        bad("bits", "a positive integer")
    if not posint(m["dim"]):
        bad("dim", "a positive integer")
    if not isinstance(m["modalities"], dict) or not m["modalities"]:
        bad("modalities", "an object of modality -> {in_dim}")
    for k, v in m["modalities"].items():
        if not isinstance(v, dict) or not posint(v.get("in_dim")):
            bad(f"modalities.{k}", "{\"in_dim\": a positive integer}")
    if not isinstance(m["encoder"], dict) or not all(isinstance(m["encoder"].get(k), str) for k in ("name", "fingerprint")):
        bad("encoder", "{\"name\": str, \"fingerprint\": str, ...}")
    toks = m["encoder"].get("tokenizers", {})
    if not isinstance(toks, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in toks.items()):
        bad("encoder.tokenizers", "an object of str -> str (tokenizer digests)")
    if not isinstance(m["head"], dict) or not isinstance(m["head"].get("layers"), dict):
        bad("head", "an object with layers")
    for mod, ops in m["head"]["layers"].items():
        if not isinstance(ops, list) or not all(isinstance(op, dict) and isinstance(op.get("op"), str) for op in ops):
            bad(f"head.layers.{mod}", "a list of {\"op\": ...} objects")
    if not isinstance(m["prototypes"], dict) or not isinstance(m["prototypes"].get("tensor"), str):
        bad("prototypes", "an object naming its tensor")
    if not isinstance(m["payload"], dict):
        bad("payload", "an object")
    if not isinstance(m["revision"], str) or not m["revision"]:
        bad("revision", "a string")
    if not isinstance(m["files"], dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in m["files"].values()):
        bad("files", "an object of name -> {sha256: str, bytes: int}")
    if not isinstance(m["tensors"], dict) or not all(
            isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("dtype"), str)
            for v in m["tensors"].values()):
        bad("tensors", "an object of name -> {shape: list, dtype: str}")


def load_export(path: str | Path, expect_bits: int | None = None, expect_encoder=None,
                device: str | torch.device = "cpu") -> ExportedHead:
    """Load and verify an export directory. expect_bits: refuse another code length. expect_encoder: a
    name, (name, fingerprint), {"name", "fingerprint"} or an encoder object: refuse features of another
    encoder (the codes would be meaningless). Raises an `ExportError` subclass naming the problem."""
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    if not isinstance(files, dict) or WEIGHTS not in files:
        raise CorruptExport(f"corrupt export: manifest lists no {WEIGHTS}")
    blobs = {}
    for name, info in files.items():
        if Path(name).name != name or not name.endswith(ALLOWED_SUFFIXES):
            raise CorruptExport(f"corrupt export: manifest lists {name!r}; exports hold only "
                                f"{ALLOWED_SUFFIXES} files in one folder (no pickle)")
        data = _read_member(path, name, max(0, int(info["bytes"])))
        if len(data) != int(info["bytes"]):
            raise TruncatedExport(f"truncated export: {name} has {len(data)} bytes, the manifest records "
                                  f"{info['bytes']}")
        if sha256_bytes(data) != info["sha256"]:
            raise TamperedExport(f"tampered export: sha256 of {name} does not match the manifest (checksum mismatch)")
        blobs[name] = data
    if revision_id(files[WEIGHTS]["sha256"], manifest) != manifest["revision"]:
        raise TamperedExport("tampered export: the revision id does not derive from the weights and settings")
    # compatibility with what the caller expects
    if expect_bits is not None and int(manifest["bits"]) != int(expect_bits):
        raise IncompatibleExport(f"incompatible export: {manifest['bits']}-bit codes, expected {expect_bits} bits")
    want_name, want_fp = _encoder_expectation(expect_encoder)
    enc = manifest["encoder"]
    if want_name is not None and enc.get("name") != want_name:
        raise IncompatibleExport(f"incompatible export: trained on encoder {enc.get('name')!r}, expected {want_name!r}")
    if want_fp is not None and enc.get("fingerprint") != want_fp:
        raise IncompatibleExport(f"incompatible export: encoder {enc.get('name')} weights fingerprint "
                                 f"{enc.get('fingerprint')!r}, expected {want_fp!r} (different encoder weights)")
    # tensors
    from safetensors.torch import load as st_load
    try:
        tensors = st_load(blobs[WEIGHTS])
    except Exception as e:
        raise CorruptExport(f"corrupt export: {WEIGHTS} is not a readable safetensors file ({e})") from e
    want = manifest["tensors"]
    if set(tensors) != set(want):
        raise CorruptExport(f"corrupt export: tensors {sorted(set(tensors) ^ set(want))[:6]} differ between "
                            f"{WEIGHTS} and the manifest")
    for k, t in tensors.items():
        if list(t.shape) != list(want[k]["shape"]) or str(t.dtype).replace("torch.", "") != want[k]["dtype"]:
            raise CorruptExport(f"corrupt export: tensor {k} is {str(t.dtype)} {list(t.shape)}, the manifest says "
                                f"{want[k]['dtype']} {want[k]['shape']}")
        check_tensor(k, t, CorruptExport)
    try:
        _check_layers(manifest, tensors)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ExportError):
            raise
        raise CorruptExport(f"corrupt export: malformed head layers ({type(e).__name__}: {e})") from None
    return ExportedHead(manifest, tensors, device=device)


def check_tensor(name: str, t: torch.Tensor, error=ValueError) -> None:
    """An export's tensors are float32 and finite (NaN weights would give one code for every input)."""
    if t.dtype != torch.float32:
        raise error(f"corrupt export: tensor {name} is {str(t.dtype).replace('torch.', '')}; exports hold float32")
    if not bool(torch.isfinite(t).all()):
        n = int((~torch.isfinite(t)).sum())
        raise error(f"corrupt export: tensor {name} has {n} non-finite (NaN/inf) values")


def _check_layers(manifest: dict, tensors: dict) -> None:
    try:
        codes_lib.check_bits(manifest["bits"])
    except ValueError as e:
        raise CorruptExport(f"corrupt export: manifest bits: {e}") from None
    head, mods = manifest["head"], manifest["modalities"]
    layers = head.get("layers") if isinstance(head, dict) else None
    if not isinstance(layers, dict) or set(layers) != set(mods):
        raise CorruptExport("corrupt export: head.layers must list the layers of every modality")
    for m, ops in layers.items():
        d = int(mods[m]["in_dim"])
        for op in ops:
            kind = op.get("op")
            if kind not in fwd.OPS:
                raise IncompatibleExport(f"incompatible export: {m} head uses op {kind!r}; this loader knows {fwd.OPS}")
            for key in ("weight", "bias"):
                if op.get(key) and op[key] not in tensors:
                    raise CorruptExport(f"corrupt export: {m} {kind} refers to missing tensor {op[key]}")
            if kind == "linear":
                if not op.get("weight"):
                    raise CorruptExport(f"corrupt export: {m} linear has no weight")
                w = tensors[op["weight"]]
                if w.ndim != 2 or w.shape[1] != d:
                    raise CorruptExport(f"corrupt export: {m} linear {op['weight']} is {list(w.shape)}, input is {d}-d")
                d = w.shape[0]
                if op.get("bias") and list(tensors[op["bias"]].shape) != [d]:
                    raise CorruptExport(f"corrupt export: {m} linear bias {op['bias']} is "
                                        f"{list(tensors[op['bias']].shape)}, its output is {d}-d")
            elif kind == "layer_norm":
                shape, eps = op.get("normalized_shape"), op.get("eps")
                if shape != [d]:
                    raise CorruptExport(f"corrupt export: {m} layer_norm normalized_shape is {shape!r}, its input "
                                        f"is {d}-d")
                if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
                    raise CorruptExport(f"corrupt export: {m} layer_norm eps must be a number in (0, 1); got {eps!r}")
                for key in ("weight", "bias"):
                    if op.get(key) and list(tensors[op[key]].shape) != [d]:
                        raise CorruptExport(f"corrupt export: {m} layer_norm {key} {op[key]} is "
                                            f"{list(tensors[op[key]].shape)}, its input is {d}-d")
            elif kind == "gelu" and op.get("approximate", "none") not in ("none", "tanh"):
                raise CorruptExport(f"corrupt export: {m} gelu approximate must be none or tanh")
        if d != int(manifest["dim"]):
            raise CorruptExport(f"corrupt export: {m} head ends at {d}-d, manifest dim is {manifest['dim']}")
    p = tensors.get(manifest["prototypes"].get("tensor", ""))
    if p is None or list(p.shape) != [int(manifest["bits"]), int(manifest["dim"])]:
        raise CorruptExport(f"corrupt export: prototypes must be [bits, dim] = [{manifest['bits']}, {manifest['dim']}]")


__all__ = ["CorruptExport", "EncoderId", "ExportError", "ExportedHead", "FORMAT", "FORMAT_VERSION",
           "IncompatibleExport", "ServedHead", "TamperedExport", "TruncatedExport", "load_export", "read_manifest",
           "revision_id"]
