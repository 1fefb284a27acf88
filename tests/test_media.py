"""Decoding: images (alpha, SVG, corrupt/truncated/missing), audio (mono, resample, crop/pad), text."""

import io
import sys

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from ushash.data import media
from ushash.data.media import MediaError, load, load_audio, load_image, load_text

SVG = """<svg xmlns="http://www.w3.org/2000/svg" width="40" height="20" viewBox="0 0 40 20">
<rect x="0" y="0" width="20" height="20" fill="#ff0000"/></svg>"""

SVG_ENTITIES = """<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE svg PUBLIC '-//W3C//DTD SVG 1.1//EN' 'http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd' [
\t<!ENTITY ns_svg "http://www.w3.org/2000/svg">
]>
<svg xmlns="&ns_svg;" width="10" height="10"><rect width="10" height="10" fill="#0000ff"/></svg>"""


def noise_png(path, size=(128, 128), mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(size[1], size[0], len(mode)), dtype=np.uint8)
    Image.fromarray(arr, mode).save(path)
    return path


# ------------------------------------------------------------------------------------------- images
def test_rgb_png_round_trip(tmp_path):
    p = noise_png(tmp_path / "a.png")
    img = load_image(p)
    assert img.mode == "RGB" and img.size == (128, 128)
    assert np.array_equal(np.asarray(img), np.asarray(Image.open(p)))


def test_alpha_is_composited_on_white(tmp_path):
    arr = np.zeros((2, 3, 4), np.uint8)
    arr[0, 0] = (255, 0, 0, 255)  # opaque red
    arr[0, 1] = (0, 0, 0, 0)  # fully transparent black -> white
    arr[0, 2] = (0, 0, 0, 128)  # half-transparent black -> grey
    Image.fromarray(arr, "RGBA").save(tmp_path / "a.png")
    out = np.asarray(load_image(tmp_path / "a.png"))
    assert tuple(out[0, 0]) == (255, 0, 0)
    assert tuple(out[0, 1]) == (255, 255, 255)
    assert all(abs(int(v) - 127) <= 1 for v in out[0, 2])


@pytest.mark.parametrize("mode", ["LA", "P"])
def test_other_transparent_modes(tmp_path, mode):
    if mode == "LA":
        img = Image.new("LA", (4, 4), (0, 0))  # transparent black
    else:
        img = Image.new("P", (4, 4), 0)
        img.putpalette([0, 0, 0] * 256)
        img.info["transparency"] = 0
    img.save(tmp_path / "a.png")
    out = np.asarray(load_image(tmp_path / "a.png"))
    assert out.shape == (4, 4, 3) and (out == 255).all()


@pytest.mark.parametrize("mode", ["L", "RGB"])
@pytest.mark.parametrize("side", [8, 600])  # 600: decoded reduced (decode_side), the key applied before resampling
def test_a_colour_key_is_transparency_too(tmp_path, mode, side):
    """A grayscale or RGB PNG with a tRNS colour key (Tux Paint's chick-hatched.png): the key's pixels are
    transparent, composited on white like an alpha channel, not left in the key's colour (near-black)."""
    key = 1 if mode == "L" else (0, 0, 1)
    arr = np.zeros((side, side) if mode == "L" else (side, side, 3), np.uint8)
    if mode == "L":
        arr[:] = 1                                    # the key colour everywhere ...
    else:
        arr[..., 2] = 1
    arr[: side // 2, : side // 2] = 200               # ... but an opaque light gray quarter
    Image.fromarray(arr, mode).save(tmp_path / "a.png", transparency=key)
    out = np.asarray(load_image(tmp_path / "a.png")).astype(int)
    h = out.shape[0]
    assert (out[-h // 4:, -h // 4:] == 255).all()     # the keyed part: white, not (0, 0, 1)
    assert (abs(out[: h // 4, : h // 4] - 200) <= 1).all()


def test_16_bit_grayscale_is_scaled_not_clipped(tmp_path):
    """A 16-bit grayscale PNG (Pillow mode I;16): Pillow's convert clips it to 0..255, so mid-gray (and any
    value above 255) decoded as white; it is scaled to 8 bits. A tRNS key on it is transparency."""
    ramp = np.array([[0, 257 * 64, 32768, 65535]], np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g.png")
    assert Image.open(tmp_path / "g.png").mode.startswith("I")
    out = np.asarray(load_image(tmp_path / "g.png"))
    assert out[0, :, 0].tolist() == [0, 64, 128, 255] and (out == out[..., :1]).all()
    Image.fromarray(ramp).save(tmp_path / "k.png", transparency=0)
    assert np.asarray(load_image(tmp_path / "k.png"))[0, :, 0].tolist() == [255, 64, 128, 255]


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF"])
def test_a_sliver_image_is_refused_before_the_encoder_blows_it_up(tmp_path, fmt):
    """A 1 x 6000 PNG is 97 bytes; the encoders' transforms resize its shorter side to 256, which took 2.3 GB
    and 5 s (1 x 60000: an out-of-memory kill of the whole extraction). The dataset limits refuse an aspect
    ratio over 256 from the header, in one line naming the file and the limit; Tux Paint's longest is 7."""
    path = tmp_path / f"sliver.{fmt.lower()}"
    Image.new("RGB", (6000, 1), (10, 20, 30)).save(path, fmt)
    with pytest.raises(MediaError) as e:
        load_image(path)
    assert e.value.code == media.OVER_LIMIT and str(path) in str(e.value) and "max_aspect=256" in str(e.value)
    Image.new("RGB", (2000, 8), (10, 20, 30)).save(path, fmt)   # 250: still read
    assert load_image(path).size[0] > 1


def test_an_svg_file_over_the_byte_limit_is_refused_unread(tmp_path, monkeypatch):
    """SVG files are read whole: a file over max_svg_bytes was read into memory (gigabytes) and only then
    refused. Its size on disk refuses it first, in one line naming the file and the limit."""
    path = tmp_path / "big.svg"
    with open(path, "wb") as f:
        f.write(SVG.encode())
        f.truncate(media.FILE_LIMITS.max_svg_bytes * 2)   # sparse: no disk used
    monkeypatch.setattr(media, "_read", lambda p: pytest.fail("read before its size was checked"))
    with pytest.raises(MediaError) as e:
        load_image(path)
    assert e.value.code == media.OVER_LIMIT and str(path) in str(e.value) and "max_svg_bytes" in str(e.value)


def test_svg_is_rasterised_to_svg_size(tmp_path):
    pytest.importorskip("cairosvg")
    (tmp_path / "a.svg").write_text(SVG)
    img = load_image(tmp_path / "a.svg")
    assert img.mode == "RGB" and img.size == (512, 256)
    arr = np.asarray(img)
    assert tuple(arr[128, 100]) == (255, 0, 0)  # the red square
    assert tuple(arr[128, 400]) == (255, 255, 255)  # transparent background -> white
    assert load_image(tmp_path / "a.svg", svg_size=64).size == (64, 32)


def test_svg_with_internal_entities(tmp_path):
    """Illustrator writes `<!ENTITY ns_svg ...>`; cairosvg refuses entities, we inline plain ones."""
    pytest.importorskip("cairosvg")
    (tmp_path / "e.svg").write_text(SVG_ENTITIES)
    img = load_image(tmp_path / "e.svg", svg_size=10)
    assert tuple(np.asarray(img)[5, 5]) == (0, 0, 255)


def test_svg_with_external_entity_is_refused(tmp_path):
    pytest.importorskip("cairosvg")
    (tmp_path / "secret.txt").write_text("x")
    (tmp_path / "x.svg").write_text(
        f'<?xml version="1.0"?><!DOCTYPE svg [<!ENTITY s SYSTEM "file://{tmp_path}/secret.txt">]>'
        '<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><text>&s;</text></svg>'
    )
    with pytest.raises(MediaError, match="x.svg"):
        load_image(tmp_path / "x.svg")


def test_svg_without_cairosvg(tmp_path, monkeypatch):
    (tmp_path / "a.svg").write_text(SVG)
    monkeypatch.setitem(sys.modules, "cairosvg", None)  # import fails
    with pytest.raises(MediaError, match="SVG needs cairosvg"):
        load_image(tmp_path / "a.svg")


def test_broken_svg(tmp_path):
    pytest.importorskip("cairosvg")
    (tmp_path / "b.svg").write_text("<svg><rect></svg")
    with pytest.raises(MediaError, match="b.svg"):
        load_image(tmp_path / "b.svg")


def test_corrupt_image(tmp_path):
    (tmp_path / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(MediaError, match=r"c\.png.*cannot decode"):
        load_image(tmp_path / "c.png")
    (tmp_path / "t.txt.png").write_bytes(b"not an image at all")
    with pytest.raises(MediaError, match="cannot decode"):
        load_image(tmp_path / "t.txt.png")


def test_truncated_image_fails_on_full_decode(tmp_path):
    data = (noise_png(tmp_path / "full.png", size=(256, 256))).read_bytes()
    (tmp_path / "trunc.png").write_bytes(data[: len(data) // 2])
    Image.open(tmp_path / "trunc.png")  # the lazy open alone succeeds ...
    with pytest.raises(MediaError, match=r"trunc\.png"):  # ... the full decode does not
        load_image(tmp_path / "trunc.png")


@pytest.mark.parametrize("kind", ["missing", "empty", "directory"])
def test_missing_empty_or_not_a_file(tmp_path, kind):
    p = tmp_path / "x.png"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "directory":
        p.mkdir()
    reason = {"missing": "file not found", "empty": "empty file", "directory": "not a regular file"}[kind]
    with pytest.raises(MediaError, match=reason) as e:
        load_image(p)
    assert str(p) in str(e.value)
    with pytest.raises(MediaError, match=reason):
        load_audio(p, 16000)


# -------------------------------------------------------------------------------------------- audio
def tone(sr, seconds, freq=440.0):
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def test_stereo_is_mixed_down_and_resampled(tmp_path):
    sr = 44100
    left = tone(sr, 1.0)
    stereo = np.stack([left, np.zeros_like(left)], axis=1)
    sf.write(tmp_path / "s.wav", stereo, sr, subtype="FLOAT")
    same = load_audio(tmp_path / "s.wav", sr)
    assert same.dtype == np.float32 and same.ndim == 1
    np.testing.assert_allclose(same, left / 2, atol=1e-6)
    down = load_audio(tmp_path / "s.wav", 16000)
    assert down.dtype == np.float32 and down.ndim == 1
    assert abs(len(down) - 16000) <= 1
    # still a 440 Hz tone at half amplitude
    spec = np.abs(np.fft.rfft(down[:16000]))
    assert abs(np.argmax(spec) - 440) <= 1
    assert 0.2 < np.abs(down).max() < 0.3


def test_ogg_and_flac(tmp_path):
    sr = 22050
    x = tone(sr, 0.5)
    sf.write(tmp_path / "a.ogg", x, sr, format="OGG", subtype="VORBIS")
    sf.write(tmp_path / "a.flac", x, sr)
    for name in ("a.ogg", "a.flac"):
        y = load_audio(tmp_path / name, sr)
        assert y.dtype == np.float32 and abs(len(y) - len(x)) < 2048
        assert np.corrcoef(x[:10000], y[:10000])[0, 1] > 0.95


def test_crop_and_pad(tmp_path):
    sr = 16000
    x = tone(sr, 1.0)
    sf.write(tmp_path / "a.wav", x, sr, subtype="FLOAT")
    crop = load_audio(tmp_path / "a.wav", sr, seconds=0.25)
    assert len(crop) == 4000
    np.testing.assert_allclose(crop, x[:4000], atol=1e-6)  # the first `seconds`
    pad = load_audio(tmp_path / "a.wav", sr, seconds=1.5)
    assert len(pad) == 24000
    np.testing.assert_allclose(pad[:16000], x, atol=1e-6)
    assert (pad[16000:] == 0).all()
    resampled = load_audio(tmp_path / "a.wav", 8000, seconds=0.3)
    assert len(resampled) == 2400


def test_audio_errors(tmp_path):
    (tmp_path / "junk.ogg").write_bytes(b"OggS" + bytes(range(200)))
    with pytest.raises(MediaError, match=r"junk\.ogg.*cannot decode"):
        load_audio(tmp_path / "junk.ogg", 16000)
    sf.write(tmp_path / "ok.wav", tone(16000, 0.1), 16000)
    (tmp_path / "head.wav").write_bytes((tmp_path / "ok.wav").read_bytes()[:20])
    with pytest.raises(MediaError, match=r"head\.wav"):
        load_audio(tmp_path / "head.wav", 16000)
    sf.write(tmp_path / "empty.wav", np.zeros(0, np.float32), 16000)
    with pytest.raises(MediaError, match="empty audio"):
        load_audio(tmp_path / "empty.wav", 16000)
    with pytest.raises(ValueError):
        load_audio(tmp_path / "ok.wav", 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_audio(tmp_path, bad):
    x = tone(16000, 0.1)
    x[10] = bad
    sf.write(tmp_path / "n.wav", x, 16000, subtype="FLOAT")
    with pytest.raises(MediaError, match="non-finite"):
        load_audio(tmp_path / "n.wav", 16000)


# --------------------------------------------------------------------------------------------- text
def test_text():
    assert load_text("  A frog.\n") == "A frog."
    for s in ("", "   \n\t"):
        with pytest.raises(MediaError, match="empty caption"):
            load_text(s)
    with pytest.raises(MediaError):
        load_text(None)


# ----------------------------------------------------------------------------------------- dispatch
def test_dispatch(tmp_path):
    noise_png(tmp_path / "a.png", size=(8, 8))
    sf.write(tmp_path / "a.wav", tone(8000, 0.5), 8000)
    assert load("image", str(tmp_path / "a.png")).size == (8, 8)
    assert load("text", " hi ") == "hi"
    assert len(load("audio", tmp_path / "a.wav", sample_rate=8000, seconds=1)) == 8000
    with pytest.raises(ValueError, match="sample_rate"):
        load("audio", tmp_path / "a.wav")
    with pytest.raises(ValueError, match="unknown modality"):
        load("video", "x")
    assert issubclass(media.MediaError, Exception)


def test_image_from_real_bytes_is_independent_of_file(tmp_path):
    """load_image decodes fully: the result survives the file being deleted."""
    p = noise_png(tmp_path / "a.png", size=(16, 16))
    img = load_image(p)
    p.unlink()
    buf = io.BytesIO()
    img.save(buf, "PNG")
    assert buf.tell() > 0


# --------------------------------------------------------------------------------- errors as fields
def test_media_error_carries_source_reason_and_code(tmp_path):
    cases = {"missing": media.NOT_FOUND, "empty": media.EMPTY, "directory": media.NOT_A_FILE}
    for kind, code in cases.items():
        p = tmp_path / kind / "x.png"
        p.parent.mkdir()
        if kind == "empty":
            p.write_bytes(b"")
        elif kind == "directory":
            p.mkdir()
        with pytest.raises(MediaError) as e:
            load_image(p)
        assert e.value.code == code and e.value.source == str(p)
        assert str(e.value) == f"{p}: {e.value.reason}" and str(p) not in e.value.reason
    with pytest.raises(MediaError) as e:
        load_text("  ")
    assert (e.value.source, e.value.code, str(e.value)) == (None, media.EMPTY, "empty caption")
    with pytest.raises(MediaError) as e:
        load_text(3)
    assert e.value.code == media.NOT_TEXT
    x = tone(16000, 0.1)
    x[3] = np.nan
    sf.write(tmp_path / "n.wav", x, 16000, subtype="FLOAT")
    with pytest.raises(MediaError) as e:
        load_audio(tmp_path / "n.wav", 16000)
    assert e.value.code == media.NON_FINITE
    (tmp_path / "c.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    with pytest.raises(MediaError) as e:
        load_image(tmp_path / "c.png")
    assert e.value.code == media.UNDECODABLE and e.value.reason.startswith("cannot decode image")
    assert all(isinstance(v, str) and v for v in media.CODES.values())


def test_a_read_the_system_fails_is_unreadable_not_undecodable(tmp_path, monkeypatch):
    """An OSError with an errno (EIO from a flaky disk, EACCES) while a file is opened, statted or read is the
    system's failure (UNREADABLE: the extraction reads it again), not its content's (UNDECODABLE: Pillow's and
    libsndfile's own errors); a path under a file is not found, as before."""
    import errno

    png = tmp_path / "a.png"
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(png)
    real_open = media.Image.open

    def eio(fp, *a, **k):
        raise OSError(errno.EIO, "Input/output error", str(fp))

    monkeypatch.setattr(media.Image, "open", eio)
    with pytest.raises(MediaError) as e:
        load_image(png)
    assert e.value.code == media.UNREADABLE and "Input/output error" in e.value.reason
    monkeypatch.setattr(media.Image, "open", real_open)
    (tmp_path / "t.png").write_bytes(png.read_bytes()[:40])   # truncated: Pillow's OSError has no errno
    with pytest.raises(MediaError) as e:
        load_image(tmp_path / "t.png")
    assert e.value.code == media.UNDECODABLE
    with pytest.raises(MediaError) as e:
        load_image(png / "b.png")
    assert e.value.code == media.NOT_FOUND
    monkeypatch.setattr(media.Path, "stat", lambda self, **k: eio(self))
    with pytest.raises(MediaError) as e:
        load_image(png)
    assert e.value.code == media.UNREADABLE
    monkeypatch.undo()
    # audio: libsndfile reads the file itself and calls the system's errors its own; the file is read through
    # Python to tell them apart
    wav = tmp_path / "a.wav"
    sf.write(wav, tone(16000, 0.1), 16000)
    wav.write_bytes(wav.read_bytes()[:30])   # a header cut short: libsndfile's error, the file reads fine
    with pytest.raises(MediaError) as e:
        load_audio(wav, 16000)
    assert e.value.code == media.UNDECODABLE
    monkeypatch.setattr(media, "open", eio, raising=False)
    monkeypatch.setattr(media, "_decode_audio", lambda *a, **k: (_ for _ in ()).throw(
        MediaError(wav, "cannot decode audio (LibsndfileError: System error.)")))
    with pytest.raises(MediaError) as e:
        load_audio(wav, 16000)
    assert e.value.code == media.UNREADABLE


def test_media_error_pickles_with_its_fields():
    import pickle

    e = pickle.loads(pickle.dumps(MediaError("/a/b.png", "file not found", media.NOT_FOUND)))
    assert (e.source, e.reason, e.code, str(e)) == ("/a/b.png", "file not found", media.NOT_FOUND,
                                                    "/a/b.png: file not found")


# ------------------------------------------------------------------------------------ from bytes
def test_bytes_decode_like_files(tmp_path):
    png = noise_png(tmp_path / "a.png", size=(16, 12))
    np.testing.assert_array_equal(np.asarray(media.decode_bytes("image", png.read_bytes(), "tar:t.tar#a.png")),
                                  np.asarray(load_image(png)))
    rgba = np.zeros((2, 2, 4), np.uint8)  # transparent: composited on white, as from a file
    Image.fromarray(rgba, "RGBA").save(tmp_path / "t.png")
    assert (np.asarray(media.decode_bytes("image", (tmp_path / "t.png").read_bytes())) == 255).all()
    sf.write(tmp_path / "a.wav", tone(22050, 0.5), 22050)
    sf.write(tmp_path / "a.ogg", tone(22050, 0.5), 22050, format="OGG", subtype="VORBIS")
    for name in ("a.wav", "a.ogg"):
        np.testing.assert_array_equal(media.decode_bytes("audio", (tmp_path / name).read_bytes(), None, 16000, 1.0),
                                      load_audio(tmp_path / name, 16000, 1.0))
    assert media.decode_bytes("text", " caf\u00e9 \n".encode()) == "caf\u00e9"
    assert media.decode_text(b"a\xffb") == "a\ufffdb"
    with pytest.raises(ValueError, match="sample_rate"):
        media.decode_bytes("audio", (tmp_path / "a.wav").read_bytes())
    with pytest.raises(ValueError, match="unknown modality"):
        media.decode_bytes("video", b"x")


def test_svg_bytes_are_recognised(tmp_path):
    pytest.importorskip("cairosvg")
    (tmp_path / "a.svg").write_text(SVG)
    ref = np.asarray(load_image(tmp_path / "a.svg"))
    for data in (SVG.encode(), b"\xef\xbb\xbf\n  " + SVG.encode()):  # sniffed, also after a BOM
        np.testing.assert_array_equal(np.asarray(media.decode_bytes("image", data)), ref)
    assert media.decode_bytes("image", SVG_ENTITIES.encode(), "x.svg").size == (512, 512)


def test_bytes_errors_name_the_source_never_a_buffer():
    src = "tar:/data/00001.tar#k7.png"
    for data, code in ((b"", media.EMPTY), (b"not an image at all", media.UNDECODABLE),
                       (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), media.UNDECODABLE)):
        with pytest.raises(MediaError) as e:
            media.decode_bytes("image", data, src)
        assert e.value.code == code and e.value.source == src and str(e.value).startswith(src + ": ")
        assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)
    with pytest.raises(MediaError) as e:
        media.decode_bytes("audio", b"RIFF....WAVEfmt garbage", None, 16000)
    assert e.value.code == media.UNDECODABLE and e.value.source is None and str(e.value) == e.value.reason
    assert e.value.reason.startswith("cannot decode audio") and "BytesIO" not in e.value.reason


# ------------------------------------------------------------------------------- limits (hostile media)
import time  # noqa: E402

import hostile_corpus as hc  # noqa: E402

SERVICE = media.MediaLimits()


@pytest.mark.parametrize("name,data", hc.image_cases(), ids=[n for n, _ in hc.image_cases()])
def test_hostile_images_are_refused_or_small_and_cheap(name, data):
    t0 = time.thread_time()   # this thread's CPU: the decode runs in it, other threads of the process do not count
    try:
        img = media.decode_bytes("image", data, None, limits=SERVICE)
    except MediaError as e:
        assert e.code in media.CODES and e.reason and "\n" not in e.reason
        assert "BytesIO" not in e.reason and "/tmp" not in e.reason  # no buffer or path in the message
    else:  # rendered at the requested size, never at its own
        assert img.mode == "RGB" and max(img.size) <= media.SVG_SIZE and img.width * img.height <= SERVICE.max_pixels
    assert time.thread_time() - t0 < 1.0


@pytest.mark.parametrize("name", ["png_1x30000", "png_1x2000", "png_10000x10000", "svg_1x5000",
                                  "svg_flat_entity_bomb", "svg_use_bomb", "svg_embedded_png_bomb", "svg_style_bomb",
                                  "svg_mask_bomb", "svg_long_text", "svg_embedded_style_bomb"])
def test_bombs_are_over_limit(name):
    data = dict(hc.image_cases())[name]
    with pytest.raises(MediaError) as e:
        media.decode_bytes("image", data, None, limits=SERVICE)
    assert e.value.code == media.OVER_LIMIT


@pytest.mark.parametrize("name,data", hc.header_floods(5_600_000), ids=[n for n, _ in hc.header_floods(100)])
def test_a_header_flood_is_refused_before_pillow_reads_it(name, data, monkeypatch):
    """At the size an 8 MB request body carries: refused from the bytes, Pillow never opening them."""
    def opened(*a, **k):
        raise AssertionError("Pillow opened the image")

    monkeypatch.setattr(media.Image, "open", opened)
    with pytest.raises(MediaError) as e:
        media.decode_bytes("image", data, None, limits=SERVICE)
    assert e.value.code == media.OVER_LIMIT and "max_image_segments=16384" in e.value.reason


def _pillow_segments(data: bytes) -> int:
    """The segments Pillow itself reports: JPEG APP markers, PNG text chunks, GIF comment lines."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG":
        return len(img.applist)
    if img.format == "PNG":
        return len(img.text)
    return len(img.info.get("comment", b"").split(b"\n")) if img.info.get("comment") else 0


def test_header_segments_are_counted_as_pillow_reads_them():
    """Against Pillow's own count: each added marker, chunk or comment block is counted (a comment block as
    its introducer, its one sub-block and its terminator); the limit refuses one over and takes one at it."""
    import struct
    import zlib

    def text(i):
        d = b"k%d\x00v" % i
        return struct.pack(">I", len(d)) + b"tEXt" + d + struct.pack(">I", zlib.crc32(b"tEXt" + d) & 0xFFFFFFFF)

    jpeg, png, gif = hc.saved("JPEG"), hc.saved("PNG"), hc.saved("GIF")
    body = 13 + (3 << ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0)
    made = {
        "JPEG": (lambda k: jpeg[:2] + b"\xff\xe1\x00\x03x" * k + jpeg[2:], 1),
        "PNG": (lambda k: png[:33] + b"".join(text(i) for i in range(k)) + png[33:], 1),
        "GIF": (lambda k: gif[:body] + b"\x21\xfe\x01a\x00" * k + gif[body:], 3),
    }
    for fmt, (make, per) in made.items():
        base, base_pillow = media._segments(memoryview(make(0)), 1 << 30), _pillow_segments(make(0))
        for k in (1, 7, 300):
            data = make(k)
            n = media._segments(memoryview(data), 1 << 30)
            assert (n - base, _pillow_segments(data) - base_pillow) == (per * k, k), fmt
            media.decode_bytes("image", data, None, limits=media.MediaLimits(max_image_segments=n))
            with pytest.raises(MediaError, match="max_image_segments"):
                media.decode_bytes("image", data, None, limits=media.MediaLimits(max_image_segments=n - 1))


def test_damaged_headers_are_counted_without_an_error_of_their_own():
    """Seeded mutations (bytes changed, cut, inserted) of real and flooded JPEG, PNG and GIF files: the count
    never raises, and decoding them under a low limit gives a decoded image or a MediaError, nothing else."""
    import random

    rng = random.Random(0)
    seeds = [hc.saved("JPEG"), hc.saved("PNG"), hc.saved("GIF"), *(d for _, d in hc.header_floods(3000))]
    limits = media.MediaLimits(max_image_segments=64)
    for _ in range(1500):
        d = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 6)):
            op, at = rng.random(), rng.randrange(len(d) + 1)
            if op < 0.4 and at < len(d):
                d[at] = rng.randrange(256)
            elif op < 0.7:
                d = d[:at]
            else:
                d[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        assert media._segments(memoryview(bytes(d)), 64) >= 0
        try:
            media.decode_bytes("image", bytes(d), None, limits=limits)
        except MediaError:
            pass


def test_dataset_files_have_no_segment_limit(tmp_path):
    """The loaders' limits refuse nothing a data set holds, and a feature store's identity does not name the
    limit they leave unset (stores made before it keep their fingerprint)."""
    from ushash.data.store import decode_identity

    for name, data in hc.header_floods(300_000):   # over 16384 segments each
        f = tmp_path / f"{name}.{name.split('_')[0]}"
        f.write_bytes(data)
        assert media.load_image(f).size == (8, 8)
        with pytest.raises(MediaError, match="max_image_segments"):
            media.load_image(f, limits=SERVICE)
    assert media.FILE_LIMITS.max_image_segments is None and "max_image_segments" not in decode_identity()
    assert media.FILE_LIMITS.max_jpeg_scans is None and "max_jpeg_scans" not in decode_identity()


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding():
    """A progressive JPEG's scans are counted on its bytes: one at the limit decodes, one over it is refused
    (a 61 KB file of 2048 x 2048 pixels and 400 scans cost 1.3 s of CPU); data sets' files have no limit."""
    plain, n = hc.progressive_with_scans(0)
    assert 2 <= n <= SERVICE.max_jpeg_scans
    media.decode_bytes("image", plain, None, limits=SERVICE)
    bomb, n = hc.progressive_with_scans(60)
    media.decode_bytes("image", bomb, None, limits=media.MediaLimits(max_jpeg_scans=n))
    with pytest.raises(MediaError, match=f"JPEG of {n} scans is over max_jpeg_scans={n - 1}") as e:
        media.decode_bytes("image", bomb, None, limits=media.MediaLimits(max_jpeg_scans=n - 1))
    assert e.value.code == media.OVER_LIMIT
    with pytest.raises(MediaError, match="max_jpeg_scans=32"):
        media.decode_bytes("image", bomb, None, limits=SERVICE)
    assert media.decode_bytes("image", bomb, None).size == (448, 448)   # FILE_LIMITS: no scan limit (reduced to decode_side)


def test_a_jpeg_of_too_many_scans_inside_an_svg_is_refused_too():
    """A raster image inside an SVG's data: URI was checked for its size only: the scan bomb refused on its own
    decoded inside the SVG (2,000 scans of 2048 x 2048 pixels: 5 s of CPU; a 1 MiB SVG about 110 s)."""
    bomb, n = hc.progressive_with_scans(60, side=64)
    with pytest.raises(MediaError, match=f"JPEG of {n} scans is over max_jpeg_scans=32") as e:
        media.decode_bytes("image", hc.svg_embedding(bomb, "image/jpeg", side=64), None, limits=SERVICE)
    assert e.value.code == media.OVER_LIMIT
    plain, _ = hc.progressive_with_scans(0, side=64)
    assert media.decode_bytes("image", hc.svg_embedding(plain, "image/jpeg", side=64), None, limits=SERVICE).size[0] > 0


def test_image_metadata_over_what_a_jpeg_holds_is_refused():
    """A PNG's EXIF is one chunk of any size, which the orientation step parsed and wrote back in Python: 7 MB of
    it in a 1 x 1 PNG cost 6 s of CPU and 300 MB, under every other limit."""
    assert media.decode_bytes("image", hc.png_with_exif(16), None, limits=SERVICE).size == (1, 1)
    big = hc.png_with_exif(9000)   # 72 KB of EXIF
    with pytest.raises(MediaError, match=r"EXIF\) of 72044 bytes is over max_exif_bytes=65535") as e:
        media.decode_bytes("image", big, None, limits=SERVICE)
    assert e.value.code == media.OVER_LIMIT
    from ushash.data.store import decode_identity

    assert media.decode_bytes("image", big, None).size == (1, 1)   # FILE_LIMITS: a data set's files, no limit
    assert media.FILE_LIMITS.max_exif_bytes is None and "max_exif_bytes" not in decode_identity()


def test_a_file_is_counted_without_being_read_whole(tmp_path, monkeypatch):
    """Under a service's limits a file is mapped for the count, not read: the pixel limit still refuses a
    large image from its header alone."""
    def read(p):
        raise AssertionError("the whole file was read")

    monkeypatch.setattr(media, "_read", read)
    ok, big = tmp_path / "ok.png", tmp_path / "big.png"
    ok.write_bytes(hc.png())
    big.write_bytes(hc.png_header_only(12000, 12000))
    assert media.load_image(ok, limits=SERVICE).size == (8, 8)
    with pytest.raises(MediaError, match="max_pixels"):
        media.load_image(big, limits=SERVICE)


@pytest.mark.parametrize("name", ["eps", "eps_binary_header", "pdf", "tiff", "psd_magic"])
def test_only_the_encoders_formats_are_opened(name, monkeypatch):
    import PIL.EpsImagePlugin

    def ghostscript(*a, **k):
        raise AssertionError("Ghostscript reached")

    monkeypatch.setattr(PIL.EpsImagePlugin, "Ghostscript", ghostscript, raising=False)
    with pytest.raises(MediaError, match="accepted formats") as e:
        media.decode_bytes("image", dict(hc.image_cases())[name], None, limits=SERVICE)
    assert e.value.code == media.UNDECODABLE


def test_svg_renders_at_the_output_size_never_its_own():
    img = media.decode_bytes("image", hc.svg_sized(10000, 10000), None, limits=SERVICE)
    assert img.size == (media.SVG_SIZE, media.SVG_SIZE)


@pytest.mark.parametrize("name,data", hc.image_ok_but_external(), ids=[n for n, _ in hc.image_ok_but_external()])
def test_svg_references_are_never_fetched(name, data, monkeypatch):
    import socket
    import urllib.request

    def no(*a, **k):
        raise AssertionError("a reference was fetched")

    monkeypatch.setattr(socket, "create_connection", no)
    monkeypatch.setattr(urllib.request, "urlopen", no)  # data: URIs are decoded without it as well
    img = media.decode_bytes("image", data, None, limits=SERVICE)
    assert img.size == (media.SVG_SIZE, media.SVG_SIZE)


def test_file_limits_still_read_what_datasets_hold(tmp_path):
    big = tmp_path / "wide.png"
    Image.new("RGB", (3000, 100), (1, 2, 3)).save(big)  # a banner: aspect 30, fine in a dataset
    assert load_image(big).size == (3000, 100)
    with pytest.raises(MediaError, match="max_aspect"):
        load_image(big, limits=SERVICE)


@pytest.mark.parametrize("name,data", hc.audio_cases(), ids=[n for n, _ in hc.audio_cases()])
def test_hostile_audio_is_refused(name, data):
    t0 = time.thread_time()
    with pytest.raises(MediaError) as e:
        media.decode_bytes("audio", data, None, 16000, None, limits=SERVICE)
    assert e.value.code in media.CODES and "\n" not in e.value.reason
    assert time.thread_time() - t0 < 1.0


def test_audio_longer_than_the_limit_is_refused_unless_cropped():
    data = hc.long_wav()
    with pytest.raises(MediaError, match="max_audio_seconds") as e:
        media.decode_bytes("audio", data, None, 8000, None, limits=SERVICE)
    assert e.value.code == media.OVER_LIMIT
    assert media.decode_bytes("audio", data, None, 8000, 2.0, limits=SERVICE).shape == (16000,)


@pytest.mark.parametrize("name,text", hc.text_cases(), ids=[n for n, _ in hc.text_cases()])
def test_hostile_captions(name, text):
    try:
        out = load_text(text, SERVICE)
    except MediaError as e:
        assert e.code in (media.EMPTY, media.NOT_TEXT, media.OVER_LIMIT)
    else:
        assert out and len(out) <= SERVICE.max_text_chars
        out.encode("utf-8")


@pytest.mark.parametrize("bad", [{"max_pixels": 0}, {"max_aspect": 0.5}, {"max_svg_cpu_s": float("nan")},
                                 {"max_text_chars": "10"}, {"max_audio_seconds": True}])
def test_media_limits_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        media.MediaLimits(**bad)


def test_a_photo_over_pillows_limit_is_decoded_reduced_in_bounded_memory(tmp_path, monkeypatch):
    """A JPEG with more pixels than Pillow's decompression-bomb limit (lowered here, so the file stays small)
    is decoded at a reduced scale inside the decoder, not refused and not decoded at full size; a PNG of the
    same size, which cannot be decoded reduced, is refused with the reason."""
    import tracemalloc

    from PIL import Image

    from ushash.data import media

    rng = np.random.default_rng(0)
    big = Image.fromarray(rng.integers(0, 255, (1800, 2400, 3), dtype=np.uint8))
    big.save(tmp_path / "big.jpg", quality=70)
    big.save(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000_000)  # 4.3 M pixels is then a "bomb" to Pillow
    limits = media.MediaLimits(max_pixels=1_000_000, max_aspect=None, decode_side=448)
    tracemalloc.start()
    img = media.load_image(tmp_path / "big.jpg", limits=limits)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert img.mode == "RGB" and min(img.size) == 448 and img.size[0] == 597  # aspect kept
    assert peak < 1800 * 2400 * 3 / 2  # never held at full size
    assert Image.MAX_IMAGE_PIXELS == 1_000_000  # Pillow's own setting is restored
    with pytest.raises(media.MediaError, match="over max_pixels") as e:
        media.load_image(tmp_path / "big.png", limits=limits)
    assert e.value.code == media.OVER_LIMIT
    # the dataset limits decode it (resized after decoding); a service's limits refuse the JPEG before decoding
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 89_478_485)
    assert min(media.load_image(tmp_path / "big.png").size) == 448
    with pytest.raises(media.MediaError, match="over max_pixels"):
        media.load_image(tmp_path / "big.jpg", limits=media.MediaLimits(max_pixels=1_000_000))
