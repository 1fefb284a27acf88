"""SemanticCache on a real export (ushash.export / ushash.serving.artifact): raw image, text and audio inputs
through the export's frozen encoder, and refusals of bad media."""

import io

import numpy as np
import pytest
from conftest import write_tiny_export
import soundfile as sf
from PIL import Image

from ushash.serving.cache import RequestError, SemanticCache



@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    return write_tiny_export(tmp_path_factory.mktemp("export") / "tiny-64b")


def _png(color, size=40) -> bytes:
    buf = io.BytesIO()
    img = Image.new("RGB", (size, size), color)
    for i in range(0, size, 4):
        img.putpixel((i, i), (255 - color[0], 0, 0))
    img.save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(png: bytes, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _wav(freq, sr=16000, seconds=1.0, noise=0.0, seed=0) -> bytes:
    t = np.arange(int(sr * seconds)) / sr
    w = 0.5 * np.sin(2 * np.pi * freq * t) + noise * np.random.default_rng(seed).normal(size=t.shape)
    buf = io.BytesIO()
    sf.write(buf, w.astype(np.float32), sr, format="WAV")
    return buf.getvalue()


def test_raw_inputs_through_the_exports_encoder(export_dir):
    cache = SemanticCache.from_export(export_dir, {"radius": 6, "payload_threshold": 0.9})
    assert cache.revision == cache.head.revision and cache.bits == 64
    cache.put("text", "a red fox jumps", value="fox")
    assert cache.get("text", "a red fox jumps").value == "fox"
    assert cache.get("text", "  a red fox jumps  ").distance == 0  # normalised like the feature store

    png = _png((200, 30, 30))
    cache.put("image", png, value="red square")
    hit = cache.get("image", _jpeg(png, 70))  # re-encoded: different bytes, same picture
    assert hit is not None and hit.value == "red square"
    assert cache.get("image", Image.open(io.BytesIO(png))).distance == 0

    cache.put("audio", _wav(440), value="A4")
    hit = cache.get("audio", _wav(440, noise=0.01, seed=1))
    assert hit is not None and hit.value == "A4"
    # precomputed features and raw inputs give the same code
    enc = cache.encoder.encoder()
    f = enc.encode("text", enc.collate("text", [enc.preprocess("text", "a red fox jumps")])).numpy()[0]
    assert cache.get("text", features=f).distance == 0


def test_bad_media_is_refused_with_a_clear_message(export_dir):
    cache = SemanticCache.from_export(export_dir, {})
    with pytest.raises(RequestError, match="undecodable image"):
        cache.get("image", b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(RequestError, match="undecodable audio"):
        cache.get("audio", b"RIFF....WAVEfmt garbage")
    with pytest.raises(RequestError, match="empty image"):
        cache.get("image", b"")
    with pytest.raises(RequestError, match="UTF-8"):
        cache.get("text", b"\xff\xfe\xfa")
    with pytest.raises(RequestError, match="empty caption"):
        cache.get("text", "   ")


def test_a_text_over_the_encoders_window_is_refused_not_cut(export_dir):
    """The tiny encoder reads 64 tokens: two texts that share their first 64 words would get one code, and a
    question after a long system prompt would be served the first question's answer. A text over the window
    is refused (the proxy passes such a request through); one at it is keyed as before."""
    cache = SemanticCache.from_export(export_dir, {})
    enc = cache.encoder.encoder()
    assert enc.text_tokens("a red fox") == (3, 64)
    prompt = " ".join(f"rule{i}" for i in range(58))
    assert enc.text_tokens(prompt + " what is the capital of france") == (64, 64)
    cache.put("text", prompt + " what is the capital of france", value="paris")
    assert cache.get("text", prompt + " what is the capital of france").value == "paris"
    with pytest.raises(RequestError, match="text of 65 tokens is over the text encoder's window of 64"):
        cache.get("text", prompt + " how do i delete all my files")


def test_hugging_face_tokenizers_count_what_they_would_cut():
    """HFTokenizer counts a text's tokens before its cut to max_length (special tokens included), without
    the tokenizer's warning about a sequence over the model's length."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from ushash.encoders.tokenizing import HFTokenizer

    model = tokenizers.models.WordLevel({"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "a": 4, "fox": 5},
                                        unk_token="[UNK]")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                                  special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", model_max_length=8)
    t = HFTokenizer(hf, max_length=8)
    assert t.n_tokens("a fox") == 4 and t.n_tokens("a fox " * 10) == 22
    assert t(["a fox " * 10])["input_ids"].shape == (1, 8)


def test_export_expectations_are_checked(export_dir):
    from ushash.serving.artifact import IncompatibleExport

    with pytest.raises(IncompatibleExport):
        SemanticCache.from_export(export_dir, {}, expect_bits=32)
