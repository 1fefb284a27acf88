"""Decoding: the one place where a row's media become the raw value an encoder preprocesses.

    load_image(path)                        -> PIL.Image, mode "RGB"
    load_audio(path, sample_rate, seconds)  -> np.float32 mono waveform at `sample_rate`
    load_text(s)                            -> str, stripped
    load(modality, source, ...)             -> one of the above, from a row's source (a path, or the caption)
    decode_bytes(modality, data, source, ...) -> the same from encoded file bytes (a member of a tar, an image
                                               inside a Hugging Face dataset, a request body), same rules
    decode_text(data)                       -> str from UTF-8 bytes, invalid bytes replaced

Every decoding failure (missing, unreadable, corrupt, truncated, empty, non-finite) raises
`MediaError(source, reason, code)`: `source` names what was decoded, `reason` says what went wrong for
people and `code` for programs (one of `CODES`), so a caller can drop the row and count it: a row that
fails to decode is simply absent from its modality's table (see docs/design.md).
"""

from __future__ import annotations

import io
import math
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

SVG_SUFFIXES = (".svg", ".svgz")
# SVG stamps often declare tiny intrinsic sizes (Tux Paint: ~70x110 px); rasterise them so the longer
# side has this many pixels, which leaves encoders (224-384 px inputs) real detail to work with.
SVG_SIZE = 512
_WHITE = (255, 255, 255)

# MediaError.code: what went wrong, for programs (failure reports, a cache's 4xx). Each with the short
# phrase a summary of many failures uses.
NOT_FOUND = "not_found"
NOT_A_FILE = "not_a_file"
EMPTY = "empty"
UNDECODABLE = "undecodable"
NON_FINITE = "non_finite"
NEEDS_DEPENDENCY = "needs_dependency"
NOT_TEXT = "not_text"
NOT_IN_CONTAINER = "not_in_container"
UNREADABLE_CONTAINER = "unreadable_container"
CODES = {
    NOT_FOUND: "file not found",
    NOT_A_FILE: "not a regular file",
    EMPTY: "empty",
    UNDECODABLE: "cannot decode",
    NON_FINITE: "non-finite (NaN/inf) samples",
    NEEDS_DEPENDENCY: "needs an optional dependency",
    NOT_TEXT: "caption is not a string",
    NOT_IN_CONTAINER: "not found in its container",   # a tar member or dataset cell that is not there
    UNREADABLE_CONTAINER: "unreadable container",     # a truncated tar: its remaining members
}


class MediaError(Exception):
    """A source could not be decoded.

    source: what was decoded: a path, a container member, None for a caption or a request body
    reason: what went wrong, for people ("empty audio (no samples)", "cannot decode image (OSError: ...)")
    code:   what went wrong, for programs: a key of CODES
    str(e) is "<source>: <reason>", or the reason alone when there is no source.
    """

    def __init__(self, source, reason: str, code: str = UNDECODABLE):
        self.source = None if source is None else str(source)
        self.reason, self.code = reason, code
        super().__init__(self.source, reason, code)  # (pickles through DataLoader workers as it is)

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}" if self.source else self.reason


# ---------------------------------------------------------------------------------------------- image
def load_image(path: str | os.PathLike, svg_size: int = SVG_SIZE) -> Image.Image:
    """Decode an image file to RGB, fully (not lazily).

    Transparency (RGBA, LA, palette with a transparent index) is composited on white. SVG files are
    rasterised with cairosvg (an optional dependency) so that the longer side is `svg_size` pixels.
    JPEG EXIF orientation is applied.
    """
    p = Path(path)
    _check_file(p)
    if p.suffix.lower() in SVG_SUFFIXES:
        return _flatten(_rasterise_svg(_read(p), p, svg_size), p)
    return _decode_image(p, p)


def _image_from_bytes(data: bytes, source, svg_size: int = SVG_SIZE) -> Image.Image:
    """load_image for encoded bytes; SVG is recognised by the source's suffix or by its first bytes."""
    if Path(str(source or "")).suffix.lower() in SVG_SUFFIXES or _looks_like_svg(data):
        return _flatten(_rasterise_svg(data, source, svg_size), source)
    return _decode_image(io.BytesIO(data), source)


def _looks_like_svg(data: bytes) -> bool:
    """An XML document, or markup with an <svg element early on (no binary image format starts with "<")."""
    head = data[:4096].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    return head.startswith(b"<?xml") or (head.startswith(b"<") and b"<svg" in head)


def _decode_image(fp, source) -> Image.Image:
    try:
        img = Image.open(fp)
        img.load()  # force a full decode: truncated data fails here, not later in a worker
        img = ImageOps.exif_transpose(img)
    except Image.UnidentifiedImageError as e:  # its message names a temporary path or a BytesIO address
        raise MediaError(source, "cannot decode image (UnidentifiedImageError: not a known image format)") from e
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError ...
        raise MediaError(source, f"cannot decode image ({type(e).__name__}: {e})") from e
    return _flatten(img, source)


def _flatten(img: Image.Image, source) -> Image.Image:
    if img.width == 0 or img.height == 0:
        raise MediaError(source, f"empty image ({img.width}x{img.height})", EMPTY)
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    if has_alpha:
        rgba = img.convert("RGBA")
        out = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE + (255,)), rgba)
        return out.convert("RGB")
    return img.convert("RGB")


def _rasterise_svg(data: bytes, source, size: int) -> Image.Image:
    try:
        import cairosvg
    except ImportError as e:  # cairosvg itself, or the cairo C library it loads
        raise MediaError(source, f"SVG needs cairosvg (pip install cairosvg; it uses the cairo library): {e}",
                         NEEDS_DEPENDENCY) from e
    if size <= 0:
        raise ValueError(f"svg_size must be positive, got {size}")
    if not data.strip():
        raise MediaError(source, "empty SVG file", EMPTY)
    url = str(source) if isinstance(source, Path) else None  # resolves references relative to a file
    try:
        data = _inline_entities(data)
        # First pass at the intrinsic size gives the aspect ratio; the second renders at `size`.
        img = Image.open(io.BytesIO(cairosvg.svg2png(bytestring=data, url=url)))
        img.load()
        longest = max(img.size)
        if longest and longest != size:
            scale = size / longest
            img = Image.open(io.BytesIO(cairosvg.svg2png(bytestring=data, url=url, scale=scale)))
            img.load()
    except Exception as e:  # XML syntax errors, cairo errors, bad units ...
        raise MediaError(source, f"cannot rasterise SVG ({type(e).__name__}: {e})") from e
    return img


_DOCTYPE_SUBSET = re.compile(rb"<!DOCTYPE[^\[>]*\[(.*?)\]\s*>", re.S)
_ENTITY = re.compile(rb"""<!ENTITY\s+([A-Za-z_][\w.-]*)\s+(["'])([^"'&<%]*)\2\s*>""")
_COMMENT = re.compile(rb"<!--.*?-->", re.S)


def _inline_entities(data: bytes) -> bytes:
    """Expand plain internal entities (`<!ENTITY ns_svg "http://...">`, as Illustrator writes them).

    cairosvg parses with entities forbidden (XXE / entity-expansion safety) and rejects such files.
    Only literal values without markup or references are expanded, once, and the DOCTYPE is dropped;
    a DOCTYPE holding anything else (external or parameter entities) is left for the parser to refuse.
    """
    m = _DOCTYPE_SUBSET.search(data)
    if m is None:
        return data
    entities = {name: value for name, _, value in _ENTITY.findall(m.group(1))}
    if _COMMENT.sub(b"", _ENTITY.sub(b"", m.group(1))).strip():
        return data
    body = data[: m.start()] + data[m.end():]
    for name, value in entities.items():
        body = body.replace(b"&" + name + b";", value)
    return body


# ---------------------------------------------------------------------------------------------- audio
def load_audio(path: str | os.PathLike, sample_rate: int, seconds: float | None = None) -> np.ndarray:
    """Decode an audio file (anything libsndfile reads: ogg/vorbis, wav, flac, ...) to mono float32.

    Channels are averaged; the signal is resampled to `sample_rate` with librosa when the file's rate
    differs; with `seconds`, the result is cropped to its first `seconds` or zero-padded at the end
    to exactly round(seconds * sample_rate) samples.
    """
    _check_audio_args(sample_rate, seconds)
    p = Path(path)
    _check_file(p)
    return _decode_audio(str(p), p, sample_rate, seconds)


def _check_audio_args(sample_rate, seconds) -> None:
    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"load_audio: sample_rate must be a positive int, got {sample_rate!r}")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"load_audio: seconds must be positive or None, got {seconds!r}")


def _decode_audio(file, source, sample_rate: int, seconds: float | None) -> np.ndarray:
    """`file`: a path or a file object (libsndfile reads both)."""
    import soundfile as sf

    try:
        with sf.SoundFile(file) as f:
            native = int(f.samplerate)
            frames = -1
            if seconds is not None:
                # Read only what the crop needs (plus a little for the resampler's edge).
                frames = int(math.ceil(seconds * native)) + 64
            data = f.read(frames=frames, dtype="float32", always_2d=True)
    except Exception as e:  # soundfile.LibsndfileError (RuntimeError), TypeError on odd headers ...
        # libsndfile's own words, without the path or file object it prefixes them with
        why = getattr(e, "error_string", None) or e
        raise MediaError(source, f"cannot decode audio ({type(e).__name__}: {why})") from e
    if data.size == 0:
        raise MediaError(source, "empty audio (no samples)", EMPTY)
    if not np.isfinite(data).all():
        bad = int((~np.isfinite(data)).sum())
        raise MediaError(source, f"audio has {bad} non-finite (NaN/inf) samples", NON_FINITE)
    wave = data.mean(axis=1, dtype=np.float32)
    if native != sample_rate:
        import librosa

        try:
            wave = librosa.resample(wave, orig_sr=native, target_sr=sample_rate)
        except Exception as e:
            raise MediaError(source, f"cannot resample {native} Hz -> {sample_rate} Hz ({e})") from e
    wave = np.asarray(wave, dtype=np.float32)
    if seconds is not None:
        wave = fit_length(wave, int(round(seconds * sample_rate)))
    return np.ascontiguousarray(wave)


def fit_length(wave: np.ndarray, n: int) -> np.ndarray:
    """Crop to the first `n` samples or zero-pad at the end to exactly `n`."""
    if len(wave) >= n:
        return wave[:n]
    return np.pad(wave, (0, n - len(wave)))


# ----------------------------------------------------------------------------------------------- text
def load_text(s: str) -> str:
    """A caption, stripped of surrounding whitespace; empty captions raise MediaError."""
    if not isinstance(s, str):
        raise MediaError(None, f"caption is not a string: {type(s).__name__} {s!r:.80}", NOT_TEXT)
    t = s.strip()
    if not t:
        raise MediaError(None, "empty caption", EMPTY)
    return t


def decode_text(data: bytes) -> str:
    """A caption stored as bytes (a `.txt` member): UTF-8, invalid bytes replaced; not yet stripped."""
    return data.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------- dispatch
def load(modality: str, source, sample_rate: int | None = None, seconds: float | None = None):
    """Decode a row's `source` for `modality` ("image", "text" or "audio"): a file path, or the caption."""
    if modality == "image":
        return load_image(source)
    if modality == "text":
        return load_text(source)
    if modality == "audio":
        if sample_rate is None:
            raise ValueError("load('audio', ...) needs sample_rate")
        return load_audio(source, sample_rate, seconds)
    raise ValueError(f"unknown modality {modality!r}; expected 'image', 'text' or 'audio'")


def decode_bytes(modality: str, data: bytes, source=None, sample_rate: int | None = None,
                 seconds: float | None = None):
    """Decode encoded file bytes for `modality` with the same rules (and errors) as `load` on a file.

    `source` names the bytes in errors (a tar member's row source; None for a request body); an image
    source ending in .svg/.svgz, or bytes that start like SVG, are rasterised as SVG.
    """
    data = bytes(data)
    if modality not in ("image", "text", "audio"):
        raise ValueError(f"unknown modality {modality!r}; expected 'image', 'text' or 'audio'")
    if not data:
        raise MediaError(source, "no data (0 bytes)", EMPTY)
    if modality == "image":
        return _image_from_bytes(data, source)
    if modality == "text":
        return load_text(decode_text(data))
    if sample_rate is None:
        raise ValueError("decode_bytes('audio', ...) needs sample_rate")
    _check_audio_args(sample_rate, seconds)
    return _decode_audio(io.BytesIO(data), source, sample_rate, seconds)


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise MediaError(p, f"cannot read file ({type(e).__name__}: {e})") from e


def _check_file(p: Path) -> None:
    if not p.exists():
        raise MediaError(p, "file not found", NOT_FOUND)
    if not p.is_file():
        raise MediaError(p, "not a regular file", NOT_A_FILE)
    if p.stat().st_size == 0:
        raise MediaError(p, "empty file (0 bytes)", EMPTY)
