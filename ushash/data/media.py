"""Decoding: turn a row's `source` into the raw value an encoder preprocesses.

    load_image(path)                      -> PIL.Image, mode "RGB"
    load_audio(path, sample_rate, seconds) -> np.float32 mono waveform at `sample_rate`
    load_text(s)                          -> str, stripped
    load(modality, source, ...)           -> one of the above

Every decoding failure (missing, unreadable, corrupt, truncated, empty, non-finite) raises
`MediaError` naming the source and the reason, so a caller can drop the row and count it: a row that
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


class MediaError(Exception):
    """A source could not be decoded; the message names the source and the reason."""


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
        return _flatten(_rasterise_svg(p, svg_size), p)
    try:
        img = Image.open(p)
        img.load()  # force a full decode: truncated data fails here, not later in a worker
        img = ImageOps.exif_transpose(img)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, UnidentifiedImageError ...
        raise MediaError(f"{p}: cannot decode image ({type(e).__name__}: {e})") from e
    return _flatten(img, p)


def _flatten(img: Image.Image, p: Path) -> Image.Image:
    if img.width == 0 or img.height == 0:
        raise MediaError(f"{p}: empty image ({img.width}x{img.height})")
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    if has_alpha:
        rgba = img.convert("RGBA")
        out = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE + (255,)), rgba)
        return out.convert("RGB")
    return img.convert("RGB")


def _rasterise_svg(p: Path, size: int) -> Image.Image:
    try:
        import cairosvg
    except ImportError as e:  # cairosvg itself, or the cairo C library it loads
        raise MediaError(f"{p}: SVG needs cairosvg (pip install cairosvg; it uses the cairo library): {e}") from e
    if size <= 0:
        raise ValueError(f"svg_size must be positive, got {size}")
    try:
        data = p.read_bytes()
        if not data.strip():
            raise MediaError(f"{p}: empty SVG file")
        data = _inline_entities(data)
        # First pass at the intrinsic size gives the aspect ratio; the second renders at `size`.
        img = Image.open(io.BytesIO(cairosvg.svg2png(bytestring=data, url=str(p))))
        img.load()
        longest = max(img.size)
        if longest and longest != size:
            scale = size / longest
            img = Image.open(io.BytesIO(cairosvg.svg2png(bytestring=data, url=str(p), scale=scale)))
            img.load()
    except MediaError:
        raise
    except Exception as e:  # XML syntax errors, cairo errors, bad units ...
        raise MediaError(f"{p}: cannot rasterise SVG ({type(e).__name__}: {e})") from e
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
    import soundfile as sf

    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"load_audio: sample_rate must be a positive int, got {sample_rate!r}")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"load_audio: seconds must be positive or None, got {seconds!r}")
    p = Path(path)
    _check_file(p)
    try:
        with sf.SoundFile(str(p)) as f:
            native = int(f.samplerate)
            frames = -1
            if seconds is not None:
                # Read only what the crop needs (plus a little for the resampler's edge).
                frames = int(math.ceil(seconds * native)) + 64
            data = f.read(frames=frames, dtype="float32", always_2d=True)
    except Exception as e:  # soundfile.LibsndfileError (RuntimeError), TypeError on odd headers ...
        raise MediaError(f"{p}: cannot decode audio ({type(e).__name__}: {e})") from e
    if data.size == 0:
        raise MediaError(f"{p}: empty audio (no samples)")
    if not np.isfinite(data).all():
        bad = int((~np.isfinite(data)).sum())
        raise MediaError(f"{p}: audio has {bad} non-finite (NaN/inf) samples")
    wave = data.mean(axis=1, dtype=np.float32)
    if native != sample_rate:
        import librosa

        try:
            wave = librosa.resample(wave, orig_sr=native, target_sr=sample_rate)
        except Exception as e:
            raise MediaError(f"{p}: cannot resample {native} Hz -> {sample_rate} Hz ({e})") from e
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
        raise MediaError(f"caption is not a string: {type(s).__name__} {s!r:.80}")
    t = s.strip()
    if not t:
        raise MediaError("empty caption")
    return t


# ------------------------------------------------------------------------------------------- dispatch
def load(modality: str, source, sample_rate: int | None = None, seconds: float | None = None):
    """Decode `source` for `modality` ("image", "text" or "audio")."""
    if modality == "image":
        return load_image(source)
    if modality == "text":
        return load_text(source)
    if modality == "audio":
        if sample_rate is None:
            raise ValueError("load('audio', ...) needs sample_rate")
        return load_audio(source, sample_rate, seconds)
    raise ValueError(f"unknown modality {modality!r}; expected 'image', 'text' or 'audio'")


def _check_file(p: Path) -> None:
    if not p.exists():
        raise MediaError(f"{p}: file not found")
    if not p.is_file():
        raise MediaError(f"{p}: not a regular file")
    if p.stat().st_size == 0:
        raise MediaError(f"{p}: empty file (0 bytes)")
