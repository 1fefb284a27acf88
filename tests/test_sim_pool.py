"""The request pool, its variants and the stream (ushash/sim/pool.py, augment.py, stream.py): seeded,
and each transformation does what the report says it does."""

import numpy as np
import pytest
from PIL import Image

from ushash.sim.augment import add_noise, jpeg_crop, perturb_features, recase
from ushash.sim.pool import Pool, bytes_key, feature_key, media_members, text_key
from ushash.sim.stream import SimClock, make_stream, revision_change_index


def test_feature_perturbation_has_the_stated_relative_norm():
    rng = np.random.default_rng(0)
    x = rng.normal(size=32).astype(np.float32)
    xp = perturb_features(x, np.random.default_rng(1), 0.1)
    assert np.linalg.norm(xp - x) == pytest.approx(0.1 * np.linalg.norm(x), rel=1e-5)
    assert np.array_equal(xp, perturb_features(x, np.random.default_rng(1), 0.1))


def test_exact_keys_normalise_what_they_should():
    x = np.arange(1, 9, dtype=np.float32)
    assert feature_key("image", x) == feature_key("image", 3 * x)  # scale-free
    assert feature_key("image", x) != feature_key("text", x)
    s = "A stamp of colour number 3."
    assert {text_key(recase(s, k)) for k in range(4)} == {text_key(s)}  # re-casings share the caption's key
    assert recase(s, 0) == "a stamp of colour number 3" and recase(s, 1) == "A STAMP OF COLOUR NUMBER 3"
    assert bytes_key(b"a") != bytes_key(b"b")


def test_image_variant_is_a_same_size_jpeg():
    img = Image.new("RGB", (40, 30), (200, 30, 30))
    out, jpeg = jpeg_crop(img, np.random.default_rng(0), crop_frac=0.5, quality=40)
    assert out.size == img.size and out.mode == "RGB" and jpeg[:2] == b"\xff\xd8"
    assert jpeg == jpeg_crop(img, np.random.default_rng(0), crop_frac=0.5, quality=40)[1]


def test_audio_variant_is_attenuated_and_noised_at_the_snr():
    t = np.arange(16000) / 16000
    a = (0.4 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    noisy = add_noise(a, np.random.default_rng(0), snr_db=20)
    assert noisy.dtype == np.float32 and noisy.shape == a.shape
    noise = noisy - 0.5 * a
    assert 10 * np.log10(np.mean(a ** 2) / np.mean(noise ** 2)) == pytest.approx(20, abs=0.5)


def test_media_members_of_each_modality():
    rng = np.random.default_rng(0)
    kinds = lambda m, raw: [k for _, _, _, k, _, _ in media_members(m, raw, 5, 2, rng, 40, 0.8, 20.0)]  # noqa: E731
    assert kinds("text", "A caption.") == ["original", "recased", "recased"]
    assert kinds("image", Image.new("RGB", (16, 16))) == ["original", "jpeg+crop", "jpeg+crop"]
    assert kinds("audio", np.ones(100, np.float32)) == ["original", "noised", "noised"]
    assert {c for _, _, c, _, _, _ in media_members("text", "x", 5, 1, rng, 40, 0.8, 20.0)} == {5}


def test_pool_counts_and_a_seeded_stream():
    pool = Pool()
    for i in range(12):
        pool.add("text" if i % 3 else "image", np.zeros(2), i % 4, "original" if i < 8 else "perturbed", bytes([i]))
    assert pool.counts("kind") == {"original": 8, "perturbed": 4} and pool.counts("modality") == {"image": 4, "text": 8}
    s = make_stream(pool, 1000, zipf_s=1.0, seed=3)
    assert s.dtype == np.int64 and s.min() >= 0 and s.max() < len(pool)
    assert np.array_equal(s, make_stream(pool, 1000, zipf_s=1.0, seed=3))
    assert not np.array_equal(s, make_stream(pool, 1000, zipf_s=1.0, seed=4))


def test_revision_change_index_and_clock():
    assert revision_change_index(1000, 0.5) == 500
    assert revision_change_index(1000, 0) == revision_change_index(1000, 1.0) == -1  # never
    clock = SimClock(5.0)
    clock.t += 1
    assert clock() == 6.0


def test_a_pool_with_no_request_is_refused_in_one_line_saying_why(tmp_path):
    """Every row's media failing to decode left an empty pool, and make_stream crashed in numpy ("a must be a
    positive integer unless no samples are taken")."""
    from types import SimpleNamespace as NS

    from ushash.sim.pool import pool_from_media

    rows = [NS(modality="image", source=str(tmp_path / f"missing{i}.png"), group=f"g{i}") for i in range(3)]
    enc = NS(sample_rate=16000, audio_seconds=5.0, modalities=("image", "text"))
    with pytest.raises(ValueError, match=r"^no request can be made from emoji split test: every one of its 3 rows "
                                         r"failed to decode \(first: .*missing0.png") as e:
        pool_from_media(rows, enc, name="emoji split test")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^make_stream: the pool is empty .*no request can be made"):
        make_stream(Pool(), 10)
