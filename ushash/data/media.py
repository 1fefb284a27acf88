"""Decoding: the one place where a row's media become the raw value an encoder preprocesses.

    load_image(path)                        -> PIL.Image, mode "RGB"
    load_audio(path, sample_rate, seconds)  -> np.float32 mono waveform at `sample_rate`
    load_text(s)                            -> str, stripped
    load(modality, source, ...)             -> one of the above, from a row's source (a path, or the caption)
    decode_bytes(modality, data, source, ...) -> the same from encoded file bytes (a member of a tar, an image
                                               inside a Hugging Face dataset, a request body), same rules
    decode_text(data)                       -> str from UTF-8 bytes, invalid bytes replaced

Every decoding failure (missing, unreadable, corrupt, truncated, empty, non-finite, over a limit) raises
`MediaError(source, reason, code)`: `source` names what was decoded, `reason` says what went wrong for
people and `code` for programs (one of `CODES`), so a caller can drop the row and count it: a row that
fails to decode is simply absent from its modality's table (see docs/design.md).

What a decode may cost is bounded before the expensive part (`MediaLimits`; every loader takes `limits=`):
raster images are opened with Pillow restricted to `IMAGE_FORMATS` (no EPS, which would reach Ghostscript)
and their width x height and aspect ratio are checked from the header, before any pixel is decoded; SVG is
bounded in bytes (after gunzip and entity expansion), in XML elements and stylesheet size before it is
parsed, and in nodes drawn and CPU seconds while cairosvg renders it (`<use>`, patterns and markers expand
to more draws), at the output size only (the intrinsic size is read, never rendered); it never fetches
anything but `data:` URIs, whose raster images are checked like any image. Audio is bounded in channels,
sample rate and samples read; captions in characters. Decoding is from memory (`io.BytesIO`): no
temporary files, and no buffer address or path of the caller's in an error message. `FILE_LIMITS` is what
the dataset loaders use (generous: only the bombs are refused); `MediaLimits()` is the stricter default of
a service (the cache's `cache.media`).
"""

from __future__ import annotations

import io
import math
import mmap
import os
import re
import stat
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

SVG_SUFFIXES = (".svg", ".svgz")
# SVG stamps often declare tiny intrinsic sizes (Tux Paint: ~70x110 px); rasterise them so the longer
# side has this many pixels, which leaves encoders (224-384 px inputs) real detail to work with.
SVG_SIZE = 512
#: raised with any change to what decoding makes of a file that the settings (FILE_LIMITS, SVG_SIZE) do not
#: show: it is part of every feature store's rows fingerprint (ushash.data.store.decode_identity)
DECODE_VERSION = 2  # 2: 16-bit grayscale scaled to 8 bits (was clipped: white), colour-key transparency of
                    # L/RGB images composited on white (was the key's colour)
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
OVER_LIMIT = "over_limit"
UNREADABLE = "unreadable"
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
    OVER_LIMIT: "over a size or cost limit",          # MediaLimits: pixels, aspect, SVG cost, audio length
    UNREADABLE: "cannot read file (an I/O error)",    # the system failed a read (EIO, EACCES, a stale NFS
                                                      # handle ...): not the file's content; may pass
}


def _failure_code(e: BaseException) -> str:
    """The code of a failure while reading and decoding a file: UNREADABLE for an error of the system (an
    OSError with an errno: EIO, EACCES, ESTALE ...), UNDECODABLE for one of the content (a decoder's errors,
    Pillow's OSErrors among them, carry no errno)."""
    return UNREADABLE if isinstance(e, OSError) and e.errno is not None else UNDECODABLE


#: Raster formats Pillow may open (Image.open(formats=...)): what datasets and clients send. Anything else
#: (EPS and PDF, which Pillow hands to Ghostscript; PSD, ICNS, TIFF, ...) is refused as undecodable.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
#: libsndfile container formats accepted (checked from the header, before any sample is read).
AUDIO_FORMATS = ("WAV", "WAVEX", "RF64", "W64", "FLAC", "OGG", "MP3", "AIFF")


def _unreadable(source, e: Exception) -> "MediaError":
    """The failure to read a file (`e` from the system, or a ValueError of mmap): UNREADABLE when `e` carries
    an errno (`_failure_code`)."""
    return MediaError(source, f"cannot read file ({type(e).__name__}: {e})", _failure_code(e))


@dataclass
class MediaLimits:
    """What decoding one input may cost. None: no limit. The defaults are a service's (the cache's
    `cache.media` settings): every bound is checked before the work it bounds."""
    max_pixels: Optional[int] = 4_194_304      # raster width x height, from the header (2048 x 2048)
    max_aspect: Optional[float] = 16.0         # longer side / shorter side (encoders resize the shorter side up)
    max_svg_bytes: Optional[int] = 1 << 20     # SVG source after gunzip and entity expansion
    max_svg_elements: Optional[int] = 20_000   # XML elements of an SVG (stylesheets are matched against each)
    max_svg_style_bytes: Optional[int] = 65_536  # <style> text of an SVG
    max_svg_draws: Optional[int] = 50_000      # nodes cairosvg draws (<use>, patterns, markers draw again)
    max_svg_cpu_s: Optional[float] = 0.5       # CPU seconds to parse and rasterise an SVG
    max_image_segments: Optional[int] = 16_384  # JPEG markers before the scan, PNG chunks, GIF blocks before the
                                               # first frame (Pillow reads each in Python; a photo holds tens)
    max_jpeg_scans: Optional[int] = 32         # a JPEG's scans: each is a pass over every block of the image (a
                                               # progressive photo holds about 10)
    max_exif_bytes: Optional[int] = 65_535     # EXIF metadata (what a JPEG's APP1 holds): a PNG's or WebP's is one
                                               # chunk of any size, parsed and written back in Python to orient it
    max_audio_seconds: Optional[float] = 600.0  # samples decoded when the encoder does not crop
    max_audio_channels: Optional[int] = 16
    max_sample_rate: Optional[int] = 384_000
    max_text_chars: Optional[int] = 20_000     # caption length
    # an image whose shorter side is longer than this is decoded reduced to about it (the encoders need 224):
    # JPEG inside the decoder (1/2 to 1/8 scale, so memory follows the reduced size), others resized after
    # decoding; max_pixels bounds the pixels actually decoded
    decode_side: Optional[int] = 448
    # a JPEG over max_pixels that decode_side reduces is decoded reduced (True) or refused before any work
    # (False); None: reduced when max_aspect is None (what this meant before it could be said)
    reduce_large_jpeg: Optional[bool] = None

    def __post_init__(self):
        for name in ("max_pixels", "max_svg_bytes", "max_svg_elements", "max_svg_style_bytes", "max_svg_draws",
                     "max_image_segments", "max_jpeg_scans", "max_exif_bytes", "max_audio_channels", "max_sample_rate", "max_text_chars",
                     "decode_side"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise ValueError(f"media limit {name} must be a positive integer or None; got {v!r}")
        for name in ("max_aspect", "max_svg_cpu_s", "max_audio_seconds"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"media limit {name} must be a positive finite number or None; got {v!r}")
        if self.max_aspect is not None and self.max_aspect < 1:
            raise ValueError(f"media limit max_aspect is longer / shorter side, >= 1; got {self.max_aspect!r}")


#: The dataset loaders' limits: only what no dataset needs is refused (more decoded pixels than Pillow's
#: decompression-bomb warning size, SVG bombs); nothing a real data set holds (tested on every Tux Paint
#: SVG). A photo larger than that is decoded reduced (a JPEG up to 64 times that size in the decoder).
#: max_aspect: the encoders resize the shorter side to 224-256 before cropping, so a 1 x 6000 PNG of 97 bytes
#: once took 2.3 GB and 5 s in the image transform (1 x 60000: ten times that, an out-of-memory kill of the
#: extraction); 256 is far beyond any data set image (Tux Paint's longest: 7) and bounds that to ~17M pixels.
FILE_LIMITS = MediaLimits(max_pixels=Image.MAX_IMAGE_PIXELS, max_aspect=256.0, max_svg_bytes=16 << 20,
                          max_svg_elements=1_000_000, max_svg_style_bytes=4 << 20, max_svg_draws=5_000_000,
                          max_svg_cpu_s=60.0, max_image_segments=None, max_jpeg_scans=None, max_exif_bytes=None,
                          max_audio_seconds=None,
                          max_audio_channels=64, max_sample_rate=768_000, max_text_chars=None, reduce_large_jpeg=True)


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
def load_image(path: str | os.PathLike, svg_size: int = SVG_SIZE, limits: MediaLimits = FILE_LIMITS) -> Image.Image:
    """Decode an image file to RGB, fully (not lazily).

    Transparency (RGBA, LA, palette with a transparent index, the colour key of an L or RGB PNG) is composited
    on white; 16-bit grayscale is scaled to 8 bits. SVG files are
    rasterised with cairosvg (an optional dependency) so that the longer side is `svg_size` pixels.
    JPEG EXIF orientation is applied. Formats other than IMAGE_FORMATS and SVG are refused.
    """
    p = Path(path)
    _check_file(p)
    if p.suffix.lower() in SVG_SUFFIXES:
        cap = limits.max_svg_bytes   # read whole below: a file of gigabytes was read into memory, then refused
        if cap is not None and p.stat().st_size > cap + cap // 1000 + 1024:  # (gzip adds at most that)
            raise MediaError(p, f"SVG file of {p.stat().st_size} bytes is over max_svg_bytes={cap}", OVER_LIMIT)
        return _flatten(_rasterise_svg(_read(p), p, svg_size, limits), p)
    if limits.max_image_segments is not None or limits.max_jpeg_scans is not None:   # mapped, not read into memory
        try:
            with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                check_image_segments(mapped, p, limits)
        except (OSError, ValueError) as e:
            raise _unreadable(p, e) from e
    return _decode_image(p, p, limits)


def _image_from_bytes(data: bytes, source, svg_size: int = SVG_SIZE, limits: MediaLimits = FILE_LIMITS) -> Image.Image:
    """load_image for encoded bytes; SVG is recognised by the source's suffix or by its first bytes."""
    if Path(str(source or "")).suffix.lower() in SVG_SUFFIXES or _looks_like_svg(data):
        return _flatten(_rasterise_svg(data, source, svg_size, limits), source)
    check_image_segments(data, source, limits)
    return _decode_image(io.BytesIO(data), source, limits)


def _looks_like_svg(data: bytes) -> bool:
    """An XML document, or markup with an <svg element early on (no binary image format starts with "<")."""
    head = data[:4096].removeprefix(b"\xef\xbb\xbf").lstrip().lower()
    return head.startswith(b"<?xml") or (head.startswith(b"<") and b"<svg" in head)


def check_image_size(width: int, height: int, source, limits: MediaLimits) -> None:
    """Refuse a width x height (read from a header, or of a rendering to be made) over `limits`."""
    if width <= 0 or height <= 0:
        raise MediaError(source, f"empty image ({width}x{height})", EMPTY)
    if limits.max_pixels is not None and width * height > limits.max_pixels:
        raise MediaError(source, f"image of {width}x{height} = {width * height} pixels is over "
                                 f"max_pixels={limits.max_pixels}", OVER_LIMIT)
    if limits.max_aspect is not None and max(width, height) > limits.max_aspect * min(width, height):
        raise MediaError(source, f"image of {width}x{height} has an aspect ratio of "
                                 f"{max(width, height) / min(width, height):.1f}, over max_aspect={limits.max_aspect:g}",
                         OVER_LIMIT)


def check_image_segments(data: bytes, source, limits: MediaLimits) -> None:
    """Refuse an image whose header holds more than `limits.max_image_segments` segments: JPEG markers (and
    stray bytes between them) before the scan, PNG chunks, GIF extension blocks and their sub-blocks before
    the first frame. Pillow reads these one at a time in Python before the pixels can be checked: a 5.6 MB
    JPEG of 1.4 million empty APP1 markers around 8 x 8 pixels cost 1.8 s of CPU and ~200 MB, a GIF of a
    million comment blocks 0.7 s and ~270 MB. A real image holds tens. Counted on the bytes, stopping at the
    limit; what is not one of these formats, or malformed, is left to the decoder to judge.

    And a JPEG of more than `limits.max_jpeg_scans` scans: the decoder makes a pass over every block of the
    image per scan, so a 61 KB file of 2048 x 2048 pixels and a thousand tiny scans cost seconds of CPU.
    Counted as the FF DA markers in the whole file (in entropy-coded data a 0xFF byte is followed by 0x00
    or a restart marker, so each one is a scan)."""
    limit, scans = limits.max_image_segments, limits.max_jpeg_scans
    with memoryview(data) as view:   # released on return (a mapped file can then be closed)
        n = _segments(view, limit) if limit is not None else 0
        jpeg = view[:3] == b"\xff\xd8\xff"
        k = (data if isinstance(data, bytes) else bytes(view)).count(b"\xff\xda") if scans is not None and jpeg else 0
    if limit is not None and n > limit:
        raise MediaError(source, f"image header of more than {limit} segments (markers, chunks or blocks) is over "
                                 f"max_image_segments={limit}", OVER_LIMIT)
    if scans is not None and k > scans:
        raise MediaError(source, f"JPEG of {k} scans is over max_jpeg_scans={scans}", OVER_LIMIT)


def _segments(b: memoryview, limit: int) -> int:
    """How many segments `check_image_segments` counts in `b` (at most a little over `limit`: it stops there)."""
    n, end = 0, len(b)
    if b[:3] == b"\xff\xd8\xff":                         # JPEG: markers up to the start of scan
        pos = 2
        while pos + 1 < end and n <= limit:
            if b[pos] != 0xFF:                          # stray bytes: Pillow steps over them one by one
                nxt = bytes(b[pos:pos + limit + 1]).find(b"\xff")
                step = nxt if nxt >= 0 else min(limit + 1, end - pos)
                n, pos = n + step, pos + step
                continue
            marker = b[pos + 1]
            n += 1
            if marker == 0xDA:                          # start of scan: the rest is the decoder's, in C
                break
            if marker in (0x00, 0x01, 0xFF) or 0xD0 <= marker <= 0xD9:   # fill, escaped or standalone
                pos += 1 if marker == 0xFF else 2
                continue
            if pos + 4 > end:
                break
            pos += 2 + int.from_bytes(b[pos + 2:pos + 4], "big")
    elif b[:8] == b"\x89PNG\r\n\x1a\n":                 # PNG: every chunk (those after the image data too)
        pos = 8
        while pos + 8 <= end and n <= limit:
            n += 1
            if b[pos + 4:pos + 8] == b"IEND":
                break
            pos += 12 + int.from_bytes(b[pos:pos + 4], "big")
    elif b[:6] in (b"GIF87a", b"GIF89a") and end > 13:  # GIF: blocks up to the first image
        pos = 13 + (3 << ((b[10] & 7) + 1) if b[10] & 0x80 else 0)
        while pos < end and n <= limit:
            kind = b[pos]
            n += 1
            if kind in (0x2C, 0x3B):                    # the first image, or the trailer
                break
            pos += 1
            if kind == 0x21:                            # an extension: its label, then sub-blocks to a 0
                pos += 1
                while pos < end and n <= limit:
                    size = b[pos]
                    n, pos = n + 1, pos + 1 + size
                    if size == 0:
                        break
    return n


_PILLOW_LIMIT_LOCK = threading.Lock()


def _open_raster(fp, source, limits: MediaLimits) -> Image.Image:
    """Image.open restricted to IMAGE_FORMATS (the header only), with the size checked before decoding.

    Pillow's own decompression-bomb check is replaced by `limits` (it would refuse a large photo that is
    decoded reduced, see `decode_side`), so it is lifted while the header is read."""
    try:
        with _PILLOW_LIMIT_LOCK:
            old, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                img = Image.open(fp, formats=IMAGE_FORMATS)
            finally:
                Image.MAX_IMAGE_PIXELS = old
    except Image.UnidentifiedImageError as e:  # its message names a temporary path or a BytesIO address
        raise MediaError(source, f"cannot decode image (not one of the accepted formats: {', '.join(IMAGE_FORMATS)}, "
                                 f"SVG)") from e
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError ...; the system an OSError with an errno
        raise MediaError(source, f"cannot decode image ({type(e).__name__}: {e})", _failure_code(e)) from e
    reducible = img.format == "JPEG" and bool(limits.decode_side)
    reduce = limits.reduce_large_jpeg if limits.reduce_large_jpeg is not None else limits.max_aspect is None
    if not reducible or not reduce:  # a service's limits refuse a large JPEG before any work
        check_image_size(img.width, img.height, source, limits)
    elif limits.max_aspect is not None and max(img.size) > limits.max_aspect * min(img.size):
        check_image_size(img.width, img.height, source, limits)  # raises: the aspect ratio, before any work
    if reducible and min(img.size) > limits.decode_side:
        s = limits.decode_side / min(img.size)
        img.draft("RGB", (max(1, round(img.width * s)), max(1, round(img.height * s))))  # DCT scaling: >= asked
    check_image_size(img.width, img.height, source, limits)  # what will be decoded
    return img


def _decode_image(fp, source, limits: MediaLimits = FILE_LIMITS) -> Image.Image:
    img = _open_raster(fp, source, limits)
    try:
        img.load()  # force a full decode: truncated data fails here, not later in a worker
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError ...; the system an OSError with an errno
        raise MediaError(source, f"cannot decode image ({type(e).__name__}: {e})", _failure_code(e)) from e
    exif = img.info.get("exif") or b""   # orienting parses it and writes it back in Python: 7 MB of it in a
    if limits.max_exif_bytes is not None and len(exif) > limits.max_exif_bytes:   # 1 x 1 PNG cost 6 s of CPU
        raise MediaError(source, f"image metadata (EXIF) of {len(exif)} bytes is over max_exif_bytes="
                                 f"{limits.max_exif_bytes}; strip the metadata", OVER_LIMIT)
    try:
        img = ImageOps.exif_transpose(img)
    except Exception as e:  # a malformed EXIF block
        raise MediaError(source, f"cannot decode image ({type(e).__name__}: {e})", _failure_code(e)) from e
    if limits.decode_side and min(img.size) > limits.decode_side:
        img = _keyed_to_alpha(img)  # before resampling blends a colour key into its neighbours
        s = limits.decode_side / min(img.size)
        img = img.resize((max(1, round(img.width * s)), max(1, round(img.height * s))), Image.Resampling.BICUBIC,
                         reducing_gap=2.0)
    return _flatten(img, source)


#: Pillow's modes of 16-bit grayscale (a 16-bit grayscale PNG opens as "I;16", as "I" in older Pillows):
#: `convert` clips them to 0..255 instead of scaling, so every value above 255 (almost all) came out white
_WIDE_GRAY = ("I;16", "I;16B", "I;16L", "I;16N", "I")


def _gray8(img: Image.Image) -> Image.Image:
    """A 16-bit grayscale image as 8-bit "L" (0..65535 scaled to 0..255), or "LA" when a tRNS colour key
    marks a gray value transparent (Pillow's own conversion of these modes drops the key)."""
    a = np.asarray(img).astype(np.int64)
    gray = Image.fromarray(np.clip((a + 128) // 257, 0, 255).astype(np.uint8), "L")
    key = img.info.get("transparency")
    if isinstance(key, int) and not isinstance(key, bool):
        return Image.merge("LA", (gray, Image.fromarray(np.where(a == key, 0, 255).astype(np.uint8), "L")))
    return gray


def _keyed_to_alpha(img: Image.Image) -> Image.Image:
    """16-bit grayscale as 8 bits (`_gray8`), and a colour key (the tRNS chunk of an L or RGB PNG) as an alpha
    channel: its pixels once kept the key's colour instead of being composited on white (Tux Paint's
    chick-hatched.png: a third of it near-black). Other images are returned as they are."""
    if img.mode in _WIDE_GRAY:
        img = _gray8(img)
    if img.mode in ("1", "L", "RGB") and "transparency" in img.info:
        img = img.convert("RGBA")
    return img


def _flatten(img: Image.Image, source) -> Image.Image:
    if img.width == 0 or img.height == 0:
        raise MediaError(source, f"empty image ({img.width}x{img.height})", EMPTY)
    img = _keyed_to_alpha(img)
    has_alpha = img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        img.mode == "P" and "transparency" in img.info
    )
    if has_alpha:
        rgba = img.convert("RGBA")
        out = Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE + (255,)), rgba)
        return out.convert("RGB")
    return img.convert("RGB")


# ------------------------------------------------------------------------------------------------ SVG
class _SvgBudget:
    """Nodes drawn and CPU seconds spent by this thread's rasterisation (see `_count_draws`)."""

    def __init__(self, source, limits: MediaLimits):
        self.source, self.limits = source, limits
        self.draws, self.t0 = 0, time.thread_time()

    def check_cpu(self) -> None:
        cpu = self.limits.max_svg_cpu_s
        if cpu is not None and time.thread_time() - self.t0 > cpu:
            raise MediaError(self.source, f"SVG took more than max_svg_cpu_s={cpu:g} s of CPU to render", OVER_LIMIT)

    def tick(self) -> None:
        self.draws += 1
        if self.limits.max_svg_draws is not None and self.draws > self.limits.max_svg_draws:
            raise MediaError(self.source, f"SVG draws more than max_svg_draws={self.limits.max_svg_draws} nodes "
                                          f"(<use>, patterns and markers each draw their content again)", OVER_LIMIT)
        if not self.draws & 63:
            self.check_cpu()


_budget = threading.local()
_draw_guard_lock = threading.Lock()


def _count_draws(cairosvg) -> None:
    """Make cairosvg's one drawing entry point (`Surface.draw`: every node, every <use> and marker
    instance, the content of every pattern and mask, nested SVG images) charge this thread's budget, if
    one is set, and the surfaces of masks and patterns keep to its max_pixels. cairosvg has no such limit of its own; the wrapper is installed once and does nothing for
    renderings made outside `_rasterise_svg`."""
    surface = cairosvg.surface.Surface
    with _draw_guard_lock:
        if getattr(surface.draw, "_ushash_budget", False):
            return
        draw = surface.draw

        def counted(self, node):
            b = getattr(_budget, "current", None)
            if b is not None:
                b.tick()
            return draw(self, node)

        counted._ushash_budget = True
        surface.draw = counted

        # a mask's or pattern's own surface (cairo rasterises it whole when it is painted: a 30000-unit mask
        # in a 64 x 64 SVG once cost 3.4 GB) is held to max_pixels as the rendering itself is
        vector = cairosvg.surface.SVGSurface
        create = vector._create_surface

        def bounded(self, width, height):
            b = getattr(_budget, "current", None)
            if b is not None and b.limits.max_pixels is not None and width * height > b.limits.max_pixels:
                raise MediaError(b.source, f"SVG has a mask or pattern of {width:.0f}x{height:.0f} = "
                                           f"{width * height:.0f} pixels, over max_pixels={b.limits.max_pixels}",
                                 OVER_LIMIT)
            return create(self, width, height)

        vector._create_surface = bounded


def _gunzip(data: bytes, source, limit: int | None) -> bytes:
    """An .svgz body, decompressed to at most `limit` bytes (cairosvg's own gunzip has no bound)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, (limit + 1) if limit is not None else 0)
    except zlib.error as e:
        raise MediaError(source, f"cannot decompress SVGZ ({e})") from e
    if limit is not None and (len(out) > limit or d.unconsumed_tail):
        raise MediaError(source, f"SVG is over max_svg_bytes={limit} bytes once decompressed", OVER_LIMIT)
    return out


def _data_url_fetcher(source, limits: MediaLimits):
    """cairosvg's url_fetcher: `data:` URIs only, as cairosvg's own `safe_fetch` (anything else renders as
    an empty 1x1 SVG, so nothing is ever read from a file or the network), and a raster image inside one
    must be of IMAGE_FORMATS and within `limits` (cairosvg would hand anything else to Pillow unchecked),
    an SVG inside one within the source limits (`_check_svg_source`)."""
    from urllib.request import urlopen

    def fetch(url, resource_type):
        if not (url and url.startswith("data:")):
            return b'<svg width="1" height="1"></svg>'
        data = urlopen(url).read()  # a data: URI decodes in memory
        if data.startswith(b"\x1f\x8b"):
            raise MediaError(source, "SVG embeds a compressed data: URI (refused: no bound on its size)", OVER_LIMIT)
        if not (data.startswith((b"<svg ", b"<?xml", b"<!DOC")) or b"<svg" in data) and len(data) >= 5:
            check_image_segments(data, source, limits)   # a JPEG of thousands of scans costs seconds in Pillow
            with _open_raster(io.BytesIO(data), source, limits):
                pass
        else:  # an SVG inside: held to the outer document's limits (its stylesheet once cost 38 s of CPU)
            _check_svg_source(data, source, limits)
        return data

    return fetch


def _check_svg_source(data: bytes, source, limits: MediaLimits) -> None:
    """Parse with defusedxml (no entities, no external references) and count what cairosvg will work
    through: elements (a character of text counts as one: a single <text> of 900k characters once took 16 s
    of CPU, all in one node, where the CPU budget is not checked) and stylesheet text."""
    import defusedxml.ElementTree as DET
    from defusedxml import DefusedXmlException

    try:
        root = DET.fromstring(data, forbid_dtd=False, forbid_entities=True, forbid_external=True)
    except DefusedXmlException as e:
        raise MediaError(source, f"cannot rasterise SVG (it declares XML entities or external references: "
                                 f"{type(e).__name__})") from e
    except Exception as e:  # xml.etree.ElementTree.ParseError ...
        raise MediaError(source, f"cannot rasterise SVG ({type(e).__name__}: {e})") from e
    n, style = 0, 0
    for el in root.iter():
        n += 1
        tag = el.tag.rpartition("}")[2] if isinstance(el.tag, str) else ""
        if tag == "style":
            style += len(el.text or "")
        elif tag in ("text", "tspan", "textPath"):  # cairosvg lays out each character on its own, as a node
            n += len(el.text or "") + len(el.tail or "")
    if limits.max_svg_elements is not None and n > limits.max_svg_elements:
        raise MediaError(source, f"SVG has {n} elements and characters of text, over max_svg_elements="
                                 f"{limits.max_svg_elements}", OVER_LIMIT)
    if limits.max_svg_style_bytes is not None and style > limits.max_svg_style_bytes:
        raise MediaError(source, f"SVG has {style} characters of <style>, over max_svg_style_bytes="
                                 f"{limits.max_svg_style_bytes}", OVER_LIMIT)


class _IntrinsicSize(Exception):
    pass


def _rasterise_svg(data: bytes, source, size: int, limits: MediaLimits = FILE_LIMITS) -> Image.Image:
    try:
        import cairosvg
        import cairosvg.surface
        from cairosvg.parser import Tree
    except ImportError as e:  # cairosvg itself, or the cairo C library it loads
        raise MediaError(source, f"SVG needs cairosvg (pip install cairosvg; it uses the cairo library): {e}",
                         NEEDS_DEPENDENCY) from e
    if size <= 0:
        raise ValueError(f"svg_size must be positive, got {size}")
    if not data.strip():
        raise MediaError(source, "empty SVG file", EMPTY)
    cap = limits.max_svg_bytes
    if data.startswith(b"\x1f\x8b"):
        data = _gunzip(data, source, cap)
    if cap is not None and len(data) > cap:
        raise MediaError(source, f"SVG of {len(data)} bytes is over max_svg_bytes={cap}", OVER_LIMIT)
    data = _inline_entities(data, source, cap)
    _check_svg_source(data, source, limits)
    _count_draws(cairosvg)

    class Measure(cairosvg.surface.PNGSurface):
        """Reads the intrinsic size cairosvg would render at, and stops before allocating or drawing."""
        def _create_surface(self, width, height):
            raise _IntrinsicSize(int(round(width)), int(round(height)))

    class Render(cairosvg.surface.PNGSurface):
        def _create_surface(self, width, height):
            w, h = int(round(width)), int(round(height))
            if w > 0 and h > 0:
                check_image_size(w, h, source, limits)
            return super()._create_surface(width, height)

    url = str(source) if isinstance(source, Path) else None  # resolves references relative to a file
    fetch = _data_url_fetcher(source, limits)
    budget = _budget.current = _SvgBudget(source, limits)
    try:
        try:
            Measure(Tree(bytestring=data, url=url, url_fetcher=fetch), None, 96)
            raise MediaError(source, "cannot rasterise SVG (no size)")
        except _IntrinsicSize as e:
            width, height = e.args
        if 0 in (width, height):
            raise MediaError(source, "cannot rasterise SVG (ValueError: The SVG size is undefined)")
        if limits.max_aspect is not None and max(width, height) > limits.max_aspect * min(width, height):
            check_image_size(width, height, source, limits)  # raises: the aspect ratio
        # rendered once, so that the longer side is `size` pixels (the intrinsic size is never rendered)
        longest = max(width, height)
        scale = size / longest if longest != size else 1
        budget.check_cpu()
        out = io.BytesIO()
        Render(Tree(bytestring=data, url=url, url_fetcher=fetch), out, 96, scale=scale).finish()
        img = Image.open(io.BytesIO(out.getvalue()), formats=["PNG"])
        img.load()
    except MediaError:
        raise
    except Exception as e:  # XML syntax errors, cairo errors, bad units ...
        raise MediaError(source, f"cannot rasterise SVG ({type(e).__name__}: {e})") from e
    finally:
        _budget.current = None
    return img


_DOCTYPE_SUBSET = re.compile(rb"<!DOCTYPE[^\[>]*\[(.*?)\]\s*>", re.S)
_ENTITY = re.compile(rb"""<!ENTITY\s+([A-Za-z_][\w.-]*)\s+(["'])([^"'&<%]*)\2\s*>""")
_COMMENT = re.compile(rb"<!--.*?-->", re.S)


def _inline_entities(data: bytes, source=None, limit: int | None = None) -> bytes:
    """Expand plain internal entities (`<!ENTITY ns_svg "http://...">`, as Illustrator writes them).

    cairosvg parses with entities forbidden (XXE / entity-expansion safety) and rejects such files.
    Only literal values without markup or references are expanded, once, and the DOCTYPE is dropped;
    a DOCTYPE holding anything else (external or parameter entities) is left for the parser to refuse.
    The expanded document must stay within `limit` bytes (computed before expanding anything).
    """
    m = _DOCTYPE_SUBSET.search(data)
    if m is None:
        return data
    entities = {name: value for name, _, value in _ENTITY.findall(m.group(1))}
    if _COMMENT.sub(b"", _ENTITY.sub(b"", m.group(1))).strip():
        return data
    body = data[: m.start()] + data[m.end():]
    if limit is not None:
        grown = len(body) + sum(body.count(b"&" + name + b";") * (len(value) - len(name) - 2)
                                for name, value in entities.items())
        if grown > limit:
            raise MediaError(source, f"SVG entities expand it to {grown} bytes, over max_svg_bytes={limit}",
                             OVER_LIMIT)
    for name, value in entities.items():
        body = body.replace(b"&" + name + b";", value)
    return body


# ---------------------------------------------------------------------------------------------- audio
def load_audio(path: str | os.PathLike, sample_rate: int, seconds: float | None = None,
               limits: MediaLimits = FILE_LIMITS) -> np.ndarray:
    """Decode an audio file (anything libsndfile reads: ogg/vorbis, wav, flac, ...) to mono float32.

    Channels are averaged; the signal is resampled to `sample_rate` with librosa when the file's rate
    differs; with `seconds`, the result is cropped to its first `seconds` or zero-padded at the end
    to exactly round(seconds * sample_rate) samples.
    """
    _check_audio_args(sample_rate, seconds)
    p = Path(path)
    _check_file(p)
    try:
        return _decode_audio(str(p), p, sample_rate, seconds, limits)
    except MediaError as e:
        if e.code == UNDECODABLE:   # libsndfile reads the file itself and reports the system's errors as its own
            _read_through(p)
        raise


def _read_through(p: Path) -> None:
    """Read the file `p` to its end, a block at a time, and drop what was read: a MediaError (UNREADABLE) if
    the system fails the read."""
    try:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass
    except OSError as e:
        raise _unreadable(p, e) from e


def _check_audio_args(sample_rate, seconds) -> None:
    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"load_audio: sample_rate must be a positive int, got {sample_rate!r}")
    if seconds is not None and seconds <= 0:
        raise ValueError(f"load_audio: seconds must be positive or None, got {seconds!r}")


def _decode_audio(file, source, sample_rate: int, seconds: float | None,
                  limits: MediaLimits = FILE_LIMITS) -> np.ndarray:
    """`file`: a path or a file object (libsndfile reads both). The container format, channels and sample
    rate are checked from the header, and at most max_audio_seconds (or the crop) of samples are read."""
    import soundfile as sf

    try:
        with sf.SoundFile(file) as f:
            native = int(f.samplerate)
            if f.format not in AUDIO_FORMATS:
                raise MediaError(source, f"audio container {f.format} is not accepted (accepted: "
                                         f"{', '.join(AUDIO_FORMATS)})")
            if limits.max_audio_channels is not None and f.channels > limits.max_audio_channels:
                raise MediaError(source, f"audio has {f.channels} channels, over max_audio_channels="
                                         f"{limits.max_audio_channels}", OVER_LIMIT)
            if native <= 0 or (limits.max_sample_rate is not None and native > limits.max_sample_rate):
                raise MediaError(source, f"audio sample rate {native} Hz is outside 1..max_sample_rate="
                                         f"{limits.max_sample_rate}", OVER_LIMIT)
            frames = -1
            if seconds is not None:
                # Read only what the crop needs (plus a little for the resampler's edge).
                frames = int(math.ceil(seconds * native)) + 64
            elif limits.max_audio_seconds is not None:
                frames = int(math.ceil(limits.max_audio_seconds * native)) + 1
            wave, bad = _read_mono(f, frames)
            if seconds is None and limits.max_audio_seconds is not None and len(wave) == frames:
                raise MediaError(source, f"audio is longer than max_audio_seconds={limits.max_audio_seconds:g}",
                                 OVER_LIMIT)
    except MediaError:
        raise
    except Exception as e:  # soundfile.LibsndfileError (RuntimeError), TypeError on odd headers ...
        # libsndfile's own words, without the path or file object it prefixes them with
        why = getattr(e, "error_string", None) or e
        raise MediaError(source, f"cannot decode audio ({type(e).__name__}: {why})") from e
    if wave.size == 0:
        raise MediaError(source, "empty audio (no samples)", EMPTY)
    if bad:
        raise MediaError(source, f"audio has {bad} non-finite (NaN/inf) samples", NON_FINITE)
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


def _read_mono(f, frames: int) -> tuple[np.ndarray, int]:
    """Up to `frames` frames of the open SoundFile `f` (-1: all) averaged over its channels, and how many of
    its samples are not finite. Read a block at a time, so that memory follows the mono wave, not frames x
    channels (a 32 KB FLAC of 8 channels at 384 kHz holds 123 MB of float32 samples per 10 s)."""
    parts, bad = [], 0
    with np.errstate(invalid="ignore", over="ignore"):
        for block in f.blocks(blocksize=1 << 16, frames=frames, dtype="float32", always_2d=True):
            bad += int((~np.isfinite(block)).sum())
            parts.append(block.mean(axis=1, dtype=np.float32))
    return (np.concatenate(parts) if parts else np.zeros(0, np.float32)), bad


def fit_length(wave: np.ndarray, n: int) -> np.ndarray:
    """Crop to the first `n` samples or zero-pad at the end to exactly `n`."""
    if len(wave) >= n:
        return wave[:n]
    return np.pad(wave, (0, n - len(wave)))


# ----------------------------------------------------------------------------------------------- text
def load_text(s: str, limits: MediaLimits = FILE_LIMITS) -> str:
    """A caption, stripped of surrounding whitespace; empty captions, lone surrogates (not encodable as
    UTF-8) and captions over max_text_chars raise MediaError."""
    if not isinstance(s, str):
        raise MediaError(None, f"caption is not a string: {type(s).__name__} {s!r:.80}", NOT_TEXT)
    if limits.max_text_chars is not None and len(s) > limits.max_text_chars:
        raise MediaError(None, f"caption of {len(s)} characters is over max_text_chars={limits.max_text_chars}",
                         OVER_LIMIT)
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise MediaError(None, f"caption holds a lone surrogate at character {e.start} (not valid Unicode text)",
                         NOT_TEXT) from None
    t = s.strip()
    if not t:
        raise MediaError(None, "empty caption", EMPTY)
    return t


def decode_text(data: bytes) -> str:
    """A caption stored as bytes (a `.txt` member): UTF-8, invalid bytes replaced; not yet stripped."""
    return data.decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------- dispatch
def load(modality: str, source, sample_rate: int | None = None, seconds: float | None = None,
         limits: MediaLimits = FILE_LIMITS):
    """Decode a row's `source` for `modality` ("image", "text" or "audio"): a file path, or the caption."""
    if modality == "image":
        return load_image(source, limits=limits)
    if modality == "text":
        return load_text(source, limits)
    if modality == "audio":
        if sample_rate is None:
            raise ValueError("load('audio', ...) needs sample_rate")
        return load_audio(source, sample_rate, seconds, limits)
    raise ValueError(f"unknown modality {modality!r}; expected 'image', 'text' or 'audio'")


def decode_bytes(modality: str, data: bytes, source=None, sample_rate: int | None = None,
                 seconds: float | None = None, limits: MediaLimits = FILE_LIMITS):
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
        return _image_from_bytes(data, source, limits=limits)
    if modality == "text":
        return load_text(decode_text(data), limits)
    if sample_rate is None:
        raise ValueError("decode_bytes('audio', ...) needs sample_rate")
    _check_audio_args(sample_rate, seconds)
    return _decode_audio(io.BytesIO(data), source, sample_rate, seconds, limits)


def _read(p: Path) -> bytes:
    try:
        return p.read_bytes()
    except OSError as e:
        raise _unreadable(p, e) from e


def _check_file(p: Path) -> None:
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):   # (what Path.exists said False for)
        raise MediaError(p, "file not found", NOT_FOUND) from None
    except OSError as e:   # EACCES on a folder above it, EIO, ELOOP ...: the system's, not the file's content
        raise _unreadable(p, e) from e
    if not stat.S_ISREG(st.st_mode):
        raise MediaError(p, "not a regular file", NOT_A_FILE)
    if st.st_size == 0:
        raise MediaError(p, "empty file (0 bytes)", EMPTY)
