"""The ```python blocks of docs/cache.md, docs/export.md and docs/payloads.md, run as written: they are the
API examples a newcomer copies, so a renamed method, a wrong argument or a wrong promised shape in them fails
here instead of drifting from the code.

Each block is compiled as it stands in the doc (top-level `await` allowed) and run in a namespace this test
fills with real objects: a tiny export (tests/conftest.py) in a temporary working directory where the doc's
paths exist (exports/tuxpaint64, cat.png, calibration.json), real PNG and WAV bytes, encoder features of
the export's in_dim, a small labelled pool and stream, and langchain-core's fake chat model. The blocks of
one doc run in document order and share names where the doc's reader would (an earlier block's `cache`).
The only change made to a block's text is the placeholder `<name>` of `exports/<name>`, replaced by the
folder this test wrote (PLACEHOLDERS); API calls are never rewritten.

docs/datasets.md's block is left out: it needs the COCO annotations and a trained checkpoint
(tests/test_datasets_coco.py runs its steps on a fixture instead)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import io
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from conftest import ENC_CFG, write_tiny_export

DOCS = Path(__file__).resolve().parents[1] / "docs"
EXPORT = "tuxpaint64"                  # the export folder the docs name, written by the test
PLACEHOLDERS = {"<name>": EXPORT}      # exports/<name>: "an export of yours"; the one substitution made
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def python_blocks(doc: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) of every ```python fence of docs/`doc`, in order."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


class DocBlocks:
    """The ```python blocks of one doc, run one after another in one namespace; `done` checks that every
    block was run (a block added to the doc needs its names and checks here)."""

    def __init__(self, doc: str):
        self.doc, self.blocks, self.next = doc, python_blocks(doc), 0
        assert self.blocks, f"no ```python block in docs/{doc}"

    def run(self, ns: dict) -> str:
        """Run the next block in `ns`; returns its name, docs/<doc>:<line>."""
        assert self.next < len(self.blocks), f"docs/{self.doc} has only {len(self.blocks)} python blocks"
        line, src = self.blocks[self.next]
        self.next += 1
        for k, v in PLACEHOLDERS.items():
            src = src.replace(k, v)
        name = f"docs/{self.doc}:{line}"
        # blank lines in front: a traceback's line numbers are the doc's own
        code = compile("\n" * (line - 1) + src, name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        out = eval(code, ns)   # the doc's own example, in the namespace the test filled
        if inspect.iscoroutine(out):
            asyncio.run(out)
        return name

    def done(self) -> None:
        assert self.next == len(self.blocks), (
            f"docs/{self.doc} has {len(self.blocks)} python blocks; this test runs {self.next}: give the new "
            f"ones their names and checks here")


# ------------------------------------------------------------------------------------------ real inputs

def png_bytes(color=(200, 30, 30), size=40) -> bytes:
    img = Image.new("RGB", (size, size), color)
    for i in range(0, size, 4):
        img.putpixel((i, i), (255 - color[0], 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(freq=440.0, sr=16000, seconds=0.5) -> bytes:
    t = np.arange(int(sr * seconds)) / sr
    buf = io.BytesIO()
    sf.write(buf, (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def image_features(png: bytes) -> np.ndarray:
    """The tiny encoder's features of one image [in_dim]: what the cache computes from the bytes."""
    from ushash.encoders import build_encoder

    enc = build_encoder({**ENC_CFG, "device": "cpu"})
    img = Image.open(io.BytesIO(png))
    return enc.encode("image", enc.collate("image", [enc.preprocess("image", img)])).detach().numpy()[0]


def stand_in_export(out: Path) -> Path:
    """A tiny stand-in for the shipped Tux Paint export that docs/export.md and docs/payloads.md load: 64-bit
    codes, 128-d z, and the encoder identity docs/export.md expects (`("offline", "463bf89e901cf9ea")`), so
    `expect_encoder` is checked as written. Its heads take 16-d features (only features are fed to it, never
    raw media)."""
    return write_tiny_export(out, {"image": 16, "text": 16, "audio": 16}, dim=128,
                             encoder={"name": "offline", "fingerprint": "463bf89e901cf9ea", "config": {"name": "offline"}})


def text_pool(head, rng, n_classes: int, near: float | None):
    """A labelled sim Pool of text features of the head's in_dim, two near-identical members per item;
    with `near`, items come in pairs whose centres are `near` apart (confusable: serving one to the other is
    a false hit), else every item has its own centre."""
    from ushash.sim.pool import Pool, feature_key

    d = head.in_dims["text"]
    centres = rng.normal(size=(n_classes, d)).astype(np.float32)
    if near is not None:
        centres[1::2] = centres[::2] + near * rng.normal(size=centres[1::2].shape).astype(np.float32)
    pool = Pool()
    for c in range(n_classes):
        for _ in range(2):
            x = centres[c] + 0.02 * rng.normal(size=d).astype(np.float32)
            pool.add("text", x, c, "original", feature_key("text", x))
    return pool


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory for the blocks' relative paths."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ------------------------------------------------------------------------------------------ docs/cache.md

def test_cache_md(workdir, capsys):
    """docs/cache.md: from_export / put / get / get_or_compute on raw image, text and audio; calibrate,
    save, load and measure; the shadow check; the RedisVL-style check / store (sync and async); the
    LangChain adapter. Every call as the doc writes it, on the tiny export's real encoder."""
    from ushash.serving.artifact import load_export
    from ushash.serving.cache import SemanticCache
    from ushash.serving.calibration import Calibration
    from ushash.sim.stream import make_stream

    write_tiny_export(workdir / "exports" / EXPORT)
    blocks = DocBlocks("cache.md")
    ns: dict = {}

    # 1. the semantic cache on an export: raw media, a compute function, precomputed features
    calls = []
    png = png_bytes()
    ns.update(png_bytes=png, wav_bytes=wav_bytes(), f=image_features(png),
              answer=lambda: calls.append(1) or "an A4 tone")
    blocks.run(ns)
    cache, res = ns["cache"], ns["res"]
    assert cache.config.capacity_bytes == 64 << 20 and cache.config.radius == 3
    assert res.computed and res.value == "an A4 tone" and len(calls) == 1
    assert ns["hit"] is None                               # get(features=f) asks the default tenant, not acme
    hit = cache.get("text", "A frog.", tenant="acme")      # the put / get round trip
    assert hit is not None and hit.value == {"answer": "..."} and hit.distance == 0
    assert cache.get("audio", ns["wav_bytes"], tenant="acme").value == "an A4 tone"
    assert cache.query("image", features=ns["f"]).code == cache.query("image", png).code   # f: the image's features

    # 2. a false-hit budget: calibrate on a labelled val stream, save, load into a cache, measure on test.
    # Val items come in confusable pairs, so looser points meet false hits and the walks end early (quick)
    head = load_export(f"exports/{EXPORT}")
    rng = np.random.default_rng(0)
    val_pool, test_pool = text_pool(head, rng, 20, near=0.1), text_pool(head, rng, 20, near=None)
    ns.update(head=head, val_pool=val_pool, val_stream=make_stream(val_pool, 800, 1.0, 0),
              test_pool=test_pool, test_stream=make_stream(test_pool, 400, 1.0, 1))
    capsys.readouterr()
    blocks.run(ns)
    cal, res = ns["cal"], ns["res"]
    assert cal.revision == head.revision and cal.target_false_hit_rate == 0.01
    p = cal.pairs["text>text"]
    assert p.on and p.hits >= 299 and p.upper <= 0.01, cal.table()
    assert "| text>text | on |" in capsys.readouterr().out                     # the printed table
    saved = Calibration.load(workdir / "exports" / EXPORT / "calibration.json")
    assert (saved.revision, saved.pairs) == (cal.revision, cal.pairs)
    assert ns["cache"].radius == cal.search_radius                             # the cache loaded the file
    assert res["requests"] == 400 and res["hits"] > 0 and set(res["pairs"]) == {"text>text"}
    assert res["pairs"]["text>text"]["max_distance"] <= p.radius               # served at the calibrated point
    assert res["false_hits"] == 0 and res["false_per_hit_upper"] < 0.05        # test items are all distinct
    assert 0.0 <= res["headroom_captured"] <= 1.0

    # 3. online shadow checks on a calibrated cache (the calibration the block above wrote)
    shutil.copy(workdir / "exports" / EXPORT / "calibration.json", "calibration.json")
    answers = []
    ns.update(model=lambda: answers.append(1) or "frogs are amphibians")
    blocks.run(ns)
    cache, res = ns["cache"], ns["res"]
    assert cache.config.shadow.fraction == 0.02 and cache.radius == cal.search_radius
    assert res.computed and res.verified is None and res.value == "frogs are amphibians" and len(answers) == 1
    assert cache.get("text", "a frog").value == "frogs are amphibians"         # stored on the miss

    # 4. check / store. The tiny encoder's features carry no meaning ("a frog" is not near "A frog." in
    # them), so this cache serves the nearest entry at any distance and cosine: the doc's paraphrase hits
    Image.open(io.BytesIO(png_bytes((30, 30, 200)))).save("cat.png")
    ns.update(cache=SemanticCache.from_export(f"exports/{EXPORT}", {"radius": 64, "payload_threshold": -1.0}))
    blocks.run(ns)
    cache, hits = ns["cache"], ns["hits"]
    assert isinstance(ns["key"], str) and len(ns["key"]) == 32
    assert hits and hits[0]["entry_id"] == ns["key"] and hits[0]["response"] == "a tree frog"
    assert hits[0]["prompt"] == "A frog." and hits[0]["metadata"] == {"user": "ann"}
    assert {"vector_distance", "hamming_distance", "cosine", "tier", "key"} <= set(hits[0])
    assert cache.check("a frog", num_results=3, filters={"user": "ann"}) == []    # dropped
    assert cache.check("a cat")[0]["response"] == "cat" and cache.check("a dog")[0]["response"] == "dog"
    assert cache.get("text", "a frog").value == "an amphibian"                    # the positional put
    with pytest.raises(ValueError, match="tenant"):                                # InvalidTenant
        cache.put("text", "a frog", "an amphibian", tenant="no spaces allowed")

    # 5. LangChain: a repeat of the prompt is served from the cache, the model runs once
    pytest.importorskip("langchain_core")
    from langchain_core.globals import get_llm_cache, set_llm_cache
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    ns.update(llm=FakeListChatModel(responses=["Frogs are amphibians.", "a second answer"]))
    before = get_llm_cache()
    try:
        blocks.run(ns)
        assert get_llm_cache().tenant == "acme"
        assert ns["llm"].invoke("What is a frog?").content == "Frogs are amphibians."
        assert ns["llm"].i == 1
    finally:
        set_llm_cache(before)
    blocks.done()


# ------------------------------------------------------------------------------------------ docs/export.md

def test_export_md(workdir):
    """docs/export.md: load_export with the expectations the doc passes, the head's attributes, codes /
    embed / encode on features with the shapes and dtypes the comments promise."""
    from ushash.serving.artifact import EncoderId
    from ushash.serving.payload import PayloadCodec

    stand_in_export(workdir / "exports" / EXPORT)
    blocks = DocBlocks("export.md")
    rng = np.random.default_rng(0)
    ns = {f"{m}_feats": rng.normal(size=(5, 16)).astype(np.float32) for m in ("image", "text", "audio")}
    blocks.run(ns)
    head, codes, z = ns["head"], ns["codes"], ns["z"]
    assert (head.bits, head.dim) == (64, 128)
    assert head.encoder == EncoderId("offline", "463bf89e901cf9ea")
    assert head.in_dims == {"image": 16, "text": 16, "audio": 16}
    image_codes, text_z = head.codes("image", ns["image_feats"]), head.embed("text", ns["text_feats"])   # the earlier lines
    assert image_codes.dtype == np.uint8 and image_codes.shape == (5, 8)
    assert text_z.dtype == np.float32 and text_z.shape == (5, 128)
    assert codes.dtype == np.uint8 and codes.shape == (5, 64 // 8)
    assert z.dtype == np.float32 and z.shape == (5, 128)
    np.testing.assert_allclose(np.linalg.norm(z, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(codes, head.codes("audio", ns["audio_feats"]))      # encode: both in one pass
    np.testing.assert_allclose(z, head.embed("audio", ns["audio_feats"]), atol=1e-6)
    assert isinstance(head.payload, PayloadCodec) and head.manifest["revision"] == head.revision
    blocks.done()


# ------------------------------------------------------------------------------------------ docs/payloads.md

def test_payloads_md(workdir):
    """docs/payloads.md: encode / decode / cosine / scores / verify / rerank and the export round trip on
    an export's codec (image: INT4, group 32), with the shapes, dtypes and rules the comments promise."""
    from ushash.core.index import HammingIndex
    from ushash.serving.artifact import load_export
    from ushash.serving.payload import PayloadCodec, PayloadFormat

    head = load_export(stand_in_export(workdir / "exports" / EXPORT))
    rng = np.random.default_rng(0)
    feats, store = rng.normal(size=(6, 16)).astype(np.float32), rng.normal(size=(40, 16)).astype(np.float32)
    codes, z = head.encode("image", feats)
    records = head.payload.encode("image", head.embed("image", store))       # the whole store
    candidates = HammingIndex(head.codes("image", store)).search(codes[:3], 6)[1]
    candidates[2, 4:] = -1                                                   # a short row, padded
    blocks = DocBlocks("payloads.md")
    ns = {"head": head, "z": z, "z_query": z[0], "z_unit": z[0], "rec_rows": records[:5],
          "z_queries": z[:3], "candidates": candidates, "records": records,
          "settings": head.payload.settings(), "tensors": head.payload.tensors()}
    blocks.run(ns)
    codec = ns["codec"]
    n = codec.nbytes("image")
    assert codec is head.payload and codec["image"].kind == "int4" and isinstance(codec["image"], PayloadFormat)
    assert ns["rec"].dtype == np.uint8 and ns["rec"].shape == (6, n)
    assert ns["z_hat"].dtype == np.float32 and ns["z_hat"].shape == (6, 128)
    assert (np.einsum("nd,nd->n", ns["z_hat"], z) / np.linalg.norm(ns["z_hat"], axis=1) > 0.95).all()
    cos = codec.cosine(z[0], "image", records[:5])
    assert cos.dtype == np.float32 and cos.shape == (5,)
    assert np.allclose(codec.cosine(z[:5], "image", records[:5])[0], cos[0], atol=1e-6)   # or one query per row
    assert ns["cos"].shape == (5,) and np.allclose(ns["cos"], cos, atol=1e-6)   # scores: the same cosine
    assert ns["ok"].dtype == bool and np.array_equal(ns["ok"], cos >= 0.8)
    S, I = ns["S"], ns["I"]
    assert S.dtype == np.float32 and S.shape == (3, 10) and I.dtype == np.int64 and I.shape == (3, 10)
    for m in range(3):
        valid = candidates[m][candidates[m] >= 0]
        assert sorted(I[m][I[m] >= 0].tolist()) == sorted(valid.tolist())
        assert (I[m][len(valid):] == -1).all() and np.isneginf(S[m][len(valid):]).all()
        assert (np.diff(S[m][:len(valid)]) <= 0).all()                       # cosine descending
        np.testing.assert_allclose(S[m][:len(valid)], codec.cosine(z[m], "image", records[I[m][:len(valid)]]),
                                   atol=1e-6)
    assert codec.entry_bytes("image", 64) == 64 // 8 + n
    assert np.array_equal(codec["image"].encode(z), ns["rec"])               # the format, without the modality
    other = PayloadCodec.default(128, ("image", "text")).settings()["modalities"]   # the comment's alternative
    assert other["image"] == codec.settings()["modalities"]["image"] and n == 72    # INT4 group 32: 72 B
    assert PayloadCodec.from_settings(ns["settings"], ns["tensors"]).settings() == codec.settings()
    blocks.done()
