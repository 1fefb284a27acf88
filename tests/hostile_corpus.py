"""Hostile inputs, generated in code (no binary fixtures): media that costs more than it weighs, malformed
files, and bad JSON request bodies. `tests/test_hostile.py` sends each through the Python API and over
HTTP; `tests/test_media.py` decodes the media ones under the service limits."""

from __future__ import annotations

import base64
import functools
import io
import math
import struct
import zlib

import numpy as np
from PIL import Image


def png_header_only(width: int, height: int, mode: int = 0, depth: int = 1) -> bytes:
    """A valid PNG of width x height (colour type `mode`, `depth` bits a sample) whose pixels are all zero,
    compressed: tiny on the wire, width * height pixels once decoded (a decompression bomb when large)."""
    raw_row = b"\x00" + b"\x00" * (((width * (3 if mode == 2 else 1)) * depth + 7) // 8)
    comp = zlib.compressobj(9)
    idat = b""
    # compress row by row so that building the bomb stays cheap for big sizes
    chunk = raw_row * max(1, min(height, (1 << 20) // len(raw_row)))
    rows_per = len(chunk) // len(raw_row)
    left = height
    while left > 0:
        n = min(rows_per, left)
        idat += comp.compress(chunk if n == rows_per else raw_row * n)
        left -= n
    idat += comp.flush()

    def part(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, depth, mode, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + part(b"IHDR", ihdr) + part(b"IDAT", idat) + part(b"IEND", b"")


def png(width=8, height=8, seed=0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, "PNG")
    return out.getvalue()


def saved(fmt: str, width=8, height=8, **kw) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(out, fmt, **kw)
    return out.getvalue()


def wav(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    import soundfile as sf

    out = io.BytesIO()
    sf.write(out, np.zeros((int(seconds * rate), channels), np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def wav_header(rate: int, channels: int, frames: int) -> bytes:
    """A WAV header claiming `frames` frames (and no data behind it)."""
    block = 2 * channels
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * block, block, 16)
    return (b"RIFF" + struct.pack("<I", 36 + frames * block) + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt
            + b"data" + struct.pack("<I", frames * block))


SVG_NS = 'xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"'


def svg_entity_bomb(levels=6, fan=10) -> bytes:
    ents = ['<!ENTITY e0 "' + "x" * 50 + '">']
    for i in range(1, levels):
        ents.append(f'<!ENTITY e{i} "' + f"&e{i - 1};" * fan + '">')
    return ('<?xml version="1.0"?>\n<!DOCTYPE svg [\n' + "\n".join(ents) + f"\n]>\n"
            f'<svg {SVG_NS} width="10" height="10"><text>&e{levels - 1};</text></svg>').encode()


def svg_flat_entity_bomb(copies=20000) -> bytes:
    """Plain internal entities (the kind the decoder expands itself) referenced many times."""
    return ('<?xml version="1.0"?>\n<!DOCTYPE svg [\n<!ENTITY big "' + "y" * 1000 + '">\n]>\n'
            f'<svg {SVG_NS} width="10" height="10"><text>' + "&big;" * copies + "</text></svg>").encode()


def svg_use_bomb(levels=5, fan=10) -> bytes:
    defs = ['<rect id="l0" width="1" height="1"/>']
    for i in range(1, levels + 1):
        defs.append(f'<g id="l{i}">' + "".join(f'<use xlink:href="#l{i - 1}"/>' for _ in range(fan)) + "</g>")
    return (f'<svg {SVG_NS} width="64" height="64"><defs>' + "".join(defs) + f'</defs><use xlink:href="#l{levels}"/>'
            "</svg>").encode()


def svg_sized(width, height) -> bytes:
    return f'<svg {SVG_NS} width="{width}" height="{height}"><rect width="10" height="10"/></svg>'.encode()


def svg_many_elements(n=40000) -> bytes:
    return (f'<svg {SVG_NS} width="10" height="10">' + '<rect width="1" height="1"/>' * n + "</svg>").encode()


def svg_embedded_bomb() -> bytes:
    return svg_embedding(png_header_only(10000, 10000), "image/png")


def progressive_with_scans(extra: int, side: int = 512) -> tuple[bytes, int]:
    """A progressive JPEG of `side` x `side` with its last scan repeated `extra` times (each repeat one more
    pass of the decoder over every block: a scan bomb), and the scans it then holds, counted by walking its
    segments (a reference independent of the marker count)."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(out, "JPEG", progressive=True, quality=90)
    data, pos, scans, last = out.getvalue(), 2, 0, None
    while data[pos + 1] != 0xD9:
        start, marker = pos, data[pos + 1]
        pos += 2 + int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker == 0xDA:   # the scan's entropy-coded data runs to the next marker that is not stuffing or RSTn
            while not (data[pos] == 0xFF and data[pos + 1] != 0x00 and not 0xD0 <= data[pos + 1] <= 0xD7):
                pos += 1
            scans, last = scans + 1, data[start:pos]
    return data[:pos] + last * extra + data[pos:], scans + extra


def png_with_exif(n_values: int) -> bytes:
    """A 1 x 1 PNG whose eXIf chunk says Orientation 6 and holds a tag of `n_values` RATIONALs (8 bytes each):
    orienting it parses the chunk and writes it back in Python."""
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    ifd = struct.pack(">H", 2) + struct.pack(">HHI", 0x0112, 3, 1) + struct.pack(">HH", 6, 0)
    ifd += struct.pack(">HHII", 0xC6FF, 5, n_values, 8 + 2 + 24 + 4) + struct.pack(">I", 0)
    exif = b"MM\x00\x2a" + struct.pack(">I", 8) + ifd + struct.pack(">II", 1, 1) * n_values
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"eXIf", exif) + chunk(b"IDAT", zlib.compress(b"\x00\x00\x00\x00")) + chunk(b"IEND", b""))


def svg_embedding(data: bytes, mime: str = "image/svg+xml", side: int = 10) -> bytes:
    """An SVG drawing `data` (an SVG, or a raster of `mime`) from a data: URI: what it embeds is checked like
    any image."""
    b64 = base64.b64encode(data).decode()
    return (f'<svg {SVG_NS} width="{side}" height="{side}"><image width="{side}" height="{side}" '
            f'xlink:href="data:{mime};base64,{b64}"/></svg>').encode()


def svg_external(url: str) -> bytes:
    return f'<svg {SVG_NS} width="10" height="10"><image width="10" height="10" xlink:href="{url}"/></svg>'.encode()


def svg_xxe() -> bytes:
    return (b'<?xml version="1.0"?>\n<!DOCTYPE svg [<!ENTITY x SYSTEM "file:///etc/passwd">]>\n'
            b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><text>&x;</text></svg>')


def svgz(data: bytes) -> bytes:
    import gzip

    return gzip.compress(data)


def svgz_bomb(mb=64) -> bytes:
    import gzip

    body = f'<svg {SVG_NS} width="10" height="10"><desc>'.encode() + b" " * (mb << 20) + b"</desc></svg>"
    return gzip.compress(body, 1)


EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto 10 10 lineto stroke\n"
       b"showpage\n%%EOF\n")


@functools.lru_cache(maxsize=None)
def image_cases() -> list[tuple[str, bytes]]:
    """(name, bytes) of image bodies a service must refuse with a clear error, quickly and cheaply."""
    ok_png = png()
    return [
        ("png_1x30000", png_header_only(1, 30000)),
        ("png_30000x1", png_header_only(30000, 1)),
        ("png_1x2000", png_header_only(1, 2000)),
        ("png_10000x10000", png_header_only(10000, 10000)),
        ("png_5000x5000_rgb", png_header_only(5000, 5000, mode=2, depth=8)),
        ("png_truncated", ok_png[: len(ok_png) // 2]),
        ("png_header_only", ok_png[:33]),
        ("png_bad_crc", ok_png[:29] + b"\x00\x00\x00\x00" + ok_png[33:]),
        ("png_zero_width", png_header_only(1, 1)[:16] + struct.pack(">II", 0, 1) + png_header_only(1, 1)[24:]),
        ("eps", EPS),
        ("eps_binary_header", b"\xc5\xd0\xd3\xc6" + b"\x00" * 28 + EPS),
        ("pdf", b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF"),
        ("tiff", saved("TIFF")),
        ("ico", saved("ICO")),
        ("psd_magic", b"8BPS" + b"\x00" * 64),
        ("random_bytes", bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8))),
        ("zeros", b"\x00" * 1024),
        ("text_not_image", b"hello, this is not an image"),
        ("html", b"<html><body>hi</body></html>"),
        ("gif_huge_screen", b"GIF89a" + struct.pack("<HH", 65535, 65535) + b"\x00\x00\x00" + b";"),
        ("jpeg_truncated", saved("JPEG")[:40]),
        ("bmp_huge_header", b"BM" + struct.pack("<IHHI", 0, 0, 0, 54) + struct.pack("<IiiHHIIiiII", 40, 50000, 50000, 1, 24,
                                                                                      0, 0, 0, 0, 0, 0)),
        ("webp_garbage", b"RIFF\x10\x00\x00\x00WEBPVP8 " + b"\x00" * 8),
        ("svg_entity_bomb", svg_entity_bomb()),
        ("svg_flat_entity_bomb", svg_flat_entity_bomb()),
        ("svg_10000x10000", svg_sized(10000, 10000)),
        ("svg_1x5000", svg_sized(1, 5000)),
        ("svg_huge_units", svg_sized("1e9", "1e9")),
        ("svg_negative", svg_sized(-10, -10)),
        ("svg_zero", svg_sized(0, 0)),
        ("svg_use_bomb", svg_use_bomb()),
        ("svg_use_bomb_wide", svg_use_bomb(levels=3, fan=60)),
        ("svg_many_elements", svg_many_elements()),
        ("svg_embedded_png_bomb", svg_embedded_bomb()),
        ("svg_xxe", svg_xxe()),
        ("svgz_bomb", svgz_bomb()),
        ("svgz_truncated", svgz(svg_sized(10, 10))[:20]),
        ("svg_unclosed", f"<svg {SVG_NS} width='10' height='10'><rect".encode()),
        ("svg_mask_bomb", (f'<svg {SVG_NS} width="64" height="64"><defs><mask id="m" maskUnits="userSpaceOnUse" '
                           'x="0" y="0" width="30000" height="30000"><rect width="30000" height="30000" fill="white"/>'
                           '</mask></defs><rect width="64" height="64" mask="url(#m)"/></svg>').encode()),
        ("svg_long_text", f'<svg {SVG_NS} width="10" height="10"><text>{"x" * 200_000}</text></svg>'.encode()),
        ("svg_embedded_style_bomb", svg_embedding((f'<svg {SVG_NS} width="10" height="10"><style>'
                                                   + "rect{fill:red}" * 20000 + "</style></svg>").encode())),
        ("svg_style_bomb", (f'<svg {SVG_NS} width="10" height="10"><style>' + "rect{fill:red}" * 20000
                            + "</style><rect width='1' height='1'/></svg>").encode()),
        ("svg_embedding_a_scan_bomb", svg_embedding(progressive_with_scans(60, side=64)[0], "image/jpeg", side=64)),
        ("png_exif_over_the_limit", png_with_exif(9000)),
        *header_floods(),
    ]


def header_floods(size: int = 1_400_000) -> list[tuple[str, bytes]]:
    """(name, bytes) of images of 8 x 8 pixels whose headers hold `size` bytes of empty segments, each of
    which Pillow reads in Python before the pixels can be checked (at 5.6 MB, the size an 8 MB body carries,
    a JPEG of empty APP1 markers cost 1.8 s of CPU and ~200 MB)."""
    jpeg, png_, gif = saved("JPEG"), saved("PNG"), saved("GIF")
    text = struct.pack(">I", 3) + b"tEXt" + b"a\x00b" + struct.pack(">I", zlib.crc32(b"tEXta\x00b") & 0xFFFFFFFF)
    gif_body = 13 + (3 << ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0)
    return [
        ("jpeg_app_marker_flood", jpeg[:2] + b"\xff\xe1\x00\x02" * (size // 4) + jpeg[2:]),
        ("jpeg_fill_byte_flood", jpeg[:2] + b"\xff" * size + jpeg[2:]),
        ("png_text_chunk_flood", png_[:33] + text * (size // len(text)) + png_[33:]),
        ("png_chunks_after_the_image", png_[:-12] + text * (size // len(text)) + png_[-12:]),
        ("gif_comment_flood", gif[:gif_body] + b"\x21\xfe\x01a\x00" * (size // 5) + gif[gif_body:]),
        ("gif_sub_block_flood", gif[:gif_body] + b"\x21\xfe" + b"\x01a" * (size // 2) + b"\x00" + gif[gif_body:]),
    ]


def image_ok_but_external() -> list[tuple[str, bytes]]:
    """SVGs that reference files or the network: rendered without fetching anything (an empty image in
    their place), so these may succeed, but must never read a file or open a socket."""
    return [("svg_file_href", svg_external("file:///etc/passwd")),
            ("svg_http_href", svg_external("http://10.255.255.1/x.png"))]


def audio_cases() -> list[tuple[str, bytes]]:
    return [
        ("wav_header_only", wav_header(16000, 1, 0)),
        ("wav_claims_hours", wav_header(16000, 1, 16000 * 3600 * 10)),
        ("wav_too_many_channels", wav_header(16000, 1000, 10)),
        ("wav_absurd_rate", wav_header(2_000_000_000, 1, 10)),
        ("wav_zero_rate", wav_header(0, 1, 10)),
        ("riff_garbage", b"RIFF....WAVEfmt garbage"),
        ("not_audio", b"\x00" * 2048),
        ("png_as_audio", png()),
        ("ogg_magic_garbage", b"OggS" + b"\x00" * 200),
        ("flac_magic_garbage", b"fLaC" + b"\x00" * 200),
    ]


def flac_silence(channels: int, rate: int, seconds: int) -> bytes:
    """A valid FLAC of silence: a few KB on the wire, channels x rate x seconds float32 samples decoded."""
    import soundfile as sf

    out = io.BytesIO()
    with sf.SoundFile(out, "w", samplerate=rate, channels=channels, format="FLAC") as f:
        for _ in range(seconds):
            f.write(np.zeros((rate, channels), np.float32))
    return out.getvalue()


def long_wav() -> bytes:
    """A real, valid WAV of 20 minutes of silence at 8 kHz (~19 MB): over the service's max_audio_seconds."""
    return wav(20 * 60, 8000)


def text_cases() -> list[tuple[str, str]]:
    """Captions that must be refused (or served) without a 5xx."""
    return [
        ("lone_surrogate", "a \ud800 b"),
        ("lone_low_surrogate", "\udfff"),
        ("only_whitespace", " \t\n "),
        ("empty", ""),
        ("nul_bytes", "a\x00b"),
        ("very_long", "word " * 50_000),
        ("rtl_override", "\u202eabc"),
        ("combining_flood", "a" + "\u0301" * 5000),
        ("emoji", "\U0001f600" * 100),
        ("private_use", "\ue000\uf8ff"),
    ]


def nonfinite_features(dim: int) -> list[tuple[str, list]]:
    base = [0.1] * dim
    return [
        ("overflow_3e38", [3e38] * dim),
        ("one_3e38", [3e38] + base[1:]),
        ("huge_mixed", [3.4e38, -3.4e38] * (dim // 2) + [0.0] * (dim % 2)),
        ("tiny_denormal", [1e-45] * dim),
        ("all_zero", [0.0] * dim),
        ("wrong_dim_short", base[:-1]),
        ("wrong_dim_long", base + [0.1]),
        ("empty", []),
    ]


def finite(x: float) -> bool:
    return math.isfinite(x)
