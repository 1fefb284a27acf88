"""Payload codecs: byte layout and sizes, INT4/FP16 error bounds, sparse top-k, re-rank, verify, and the
checked and unchecked scoring paths."""

import numpy as np
import pytest

from ushash.core.index import cosine_search
from ushash.serving.payload import DEFAULTS, PayloadCodec, PayloadError, PayloadFormat, describe, memory_bytes


def unit(n, d=128, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rowcos(a, b):
    return np.einsum("nd,nd->n", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# ------------------------------------------------------------------------------------------ sizes / layout

@pytest.mark.parametrize("settings, nbytes", [
    (dict(kind="fp32"), 512),
    (dict(kind="fp16"), 256),
    (dict(kind="int4"), 8 + 64),                       # 4 fp16 group scales + 128 nibbles
    (dict(kind="int4", group_size=128), 2 + 64),       # one scale per vector
    (dict(kind="int4", scale="channel"), 64),          # scales live in the codec
    (dict(kind="int4", topk=32), 16 + 2 + 16),         # bitmask + 1 scale + 32 nibbles
    (dict(kind="int4", topk=8), 8 + 2 + 4),            # 8 uint8 indices beat a 16-byte bitmask
    (dict(kind="fp16", topk=64), 16 + 128),
])
def test_record_sizes(settings, nbytes):
    f = PayloadFormat(128, **settings).fit(unit(50))
    assert f.nbytes == nbytes, describe(f)
    rec = f.encode(unit(10))
    assert rec.dtype == np.uint8 and rec.shape == (10, nbytes)
    assert f.entry_bytes(64) == nbytes + 8
    assert memory_bytes(1_000_000, f, 64) == 1_000_000 * (nbytes + 8)


def test_int4_layout_by_hand():
    # one group of 4 values: absmax 1.4 -> scale 0.2 (fp16), q = [7, -7, 2, 0] -> nibbles 15, 1, 10, 8
    f = PayloadFormat(4, kind="int4", group_size=4)
    rec = f.encode(np.array([[1.4, -1.4, 0.41, 0.0]], np.float32))
    s16 = np.float16(1.4 / 7)
    assert rec[0, :2].tobytes() == np.array([s16], "<f2").tobytes()
    assert list(rec[0, 2:]) == [15 | (1 << 4), 10 | (8 << 4)]
    np.testing.assert_allclose(f.decode(rec)[0], np.array([7, -7, 2, 0]) * np.float32(s16))


def test_fp32_fp16_exact_and_odd_dims():
    x = unit(20, 7)
    np.testing.assert_array_equal(PayloadFormat(7, kind="fp32").roundtrip(x), x)
    np.testing.assert_array_equal(PayloadFormat(7, kind="fp16").roundtrip(x), x.astype(np.float16).astype(np.float32))
    f = PayloadFormat(7, kind="int4", group_size=3)  # 3 groups, 4 bytes of nibbles (last one padded)
    assert f.nbytes == 6 + 4
    assert np.all(rowcos(f.roundtrip(x), x) > 0.95)


def test_int4_error_is_within_half_a_step():
    x = unit(500, 128, seed=1)
    f = PayloadFormat(128, kind="int4", group_size=32)
    y = f.roundtrip(x)
    s = (np.abs(x).reshape(500, 4, 32).max(axis=2) / 7).astype(np.float16).astype(np.float32)
    step = np.repeat(s, 32, axis=1)
    assert np.all(np.abs(y - x) <= step / 2 + 1e-6)
    assert rowcos(y, x).mean() > 0.99
    zero = f.roundtrip(np.zeros((2, 128), np.float32))
    assert np.all(zero == 0)


def test_channel_scales_need_fit_and_saturate():
    f = PayloadFormat(128, kind="int4", scale="channel")
    with pytest.raises(PayloadError, match="fit"):
        f.encode(unit(2))
    x = unit(300, seed=2)
    f.fit(x)
    np.testing.assert_allclose(f.channel_scales, np.abs(x).max(axis=0) / 7, rtol=1e-6)
    assert rowcos(f.roundtrip(x), x).mean() > 0.98
    big = np.zeros((1, 128), np.float32)
    big[0, 0] = 10 * np.abs(x[:, 0]).max()
    assert f.roundtrip(big)[0, 0] == pytest.approx(7 * f.channel_scales[0])   # clipped at +7 steps


# ------------------------------------------------------------------------------------------ sparse

@pytest.mark.parametrize("kind", ["fp32", "fp16", "int4"])
def test_topk_keeps_largest_magnitudes(kind):
    x = unit(40, 128, seed=3)
    f = PayloadFormat(128, kind=kind, topk=16)
    y = f.roundtrip(x)
    assert np.all((y != 0).sum(axis=1) <= 16)
    top = np.argsort(-np.abs(x), axis=1, kind="stable")[:, :16]
    kept = np.zeros(x.shape, bool)
    np.put_along_axis(kept, top, True, axis=1)
    assert np.all(y[~kept] == 0)
    if kind == "fp32":
        np.testing.assert_array_equal(y[kept], x[kept])


def test_topk_ties_go_to_lower_dimension_and_index_encodings():
    x = np.zeros((1, 10), np.float32)
    x[0, [2, 5, 7]] = [0.5, -0.5, 0.5]
    f = PayloadFormat(10, kind="fp32", topk=2)
    assert f.index_encoding == "bitmask"        # 2 bytes either way: the bitmask wins ties
    assert PayloadFormat(128, topk=8).index_encoding == "u8"
    np.testing.assert_array_equal(np.flatnonzero(f.roundtrip(x)[0]), [2, 5])
    assert PayloadFormat(128, topk=32).index_encoding == "bitmask"
    wide = PayloadFormat(1024, kind="fp16", topk=8)
    assert wide.index_encoding == "u16" and wide.index_bytes == 16
    xw = unit(3, 1024, seed=4)
    yw = wide.roundtrip(xw)
    assert np.all((yw != 0).sum(axis=1) == 8)


def test_corrupt_sparse_records_are_refused():
    f = PayloadFormat(128, kind="int4", topk=32)
    rec = f.encode(unit(3))
    rec[1, 0] ^= 0xFF  # flips 8 positions of the bitmask
    with pytest.raises(PayloadError, match="corrupt payload record 1"):
        f.decode(rec)
    with pytest.raises(PayloadError, match=r"uint8 \[N, 34\]"):
        f.decode(rec[:, :-1])
    with pytest.raises(PayloadError, match="uint8"):
        f.decode(rec.astype(np.int16))


def test_bad_settings_and_inputs():
    with pytest.raises(PayloadError, match="kind"):
        PayloadFormat(8, kind="int8")
    with pytest.raises(PayloadError, match="topk"):
        PayloadFormat(8, topk=9)
    with pytest.raises(PayloadError, match="NaN"):
        PayloadFormat(8).encode(np.full((1, 8), np.nan))
    with pytest.raises(PayloadError, match="fp16"):
        PayloadFormat(8, kind="fp16").encode(np.full((1, 8), 1e6))
    with pytest.raises(PayloadError, match=r"\[N, 8\]"):
        PayloadFormat(8).encode(np.zeros((2, 9)))


# ------------------------------------------------------------------------------------------ codec

def test_modality_defaults_and_overrides():
    c = PayloadCodec.default(128, ("image", "text", "audio"))
    assert c["image"].kind == "int4" and c["text"].kind == "fp16" and c["audio"].kind == "fp16"
    assert DEFAULTS["image"]["kind"] == "int4"
    c2 = PayloadCodec.default(128, ("image", "text"), {"all": {"topk": 64}, "text": {"kind": "int4"}})
    assert c2["image"].name == "int4/g32+top64" and c2["text"].name == "int4/g32+top64"
    with pytest.raises(PayloadError, match="audio"):
        PayloadCodec.default(128, ("image",), {"audio": {"kind": "fp32"}})
    c3 = PayloadCodec.from_config(128, ("image",), {"all": {}, "image": {"kind": "fp32"}, "audio": {"kind": "fp16"}})
    assert c3.modalities == ("image",) and c3["image"].kind == "fp32"
    with pytest.raises(PayloadError, match="no payload format"):
        c3["text"]
    with pytest.raises(PayloadError, match="one dim"):
        PayloadCodec({"image": PayloadFormat(8), "text": PayloadFormat(16)})


def test_settings_roundtrip_with_channel_scales():
    z = unit(200, seed=5)
    c = PayloadCodec.default(128, ("image", "text"), {"image": {"scale": "channel", "topk": 48}}).fit({"image": z})
    back = PayloadCodec.from_settings(c.settings(), c.tensors())
    for m in ("image", "text"):
        np.testing.assert_array_equal(back.encode(m, z), c.encode(m, z))
    with pytest.raises(PayloadError, match="channel scales"):
        PayloadCodec.from_settings(c.settings(), {})
    bad = c.settings()
    bad["modalities"]["text"]["nbytes"] += 1
    with pytest.raises(PayloadError, match="nbytes"):
        PayloadCodec.from_settings(bad, c.tensors())


# ------------------------------------------------------------------------------------------ re-rank / verify

def test_fp32_rerank_equals_exact_cosine_over_the_candidates():
    db, q = unit(300, 16, seed=6), unit(20, 16, seed=7)
    rng = np.random.default_rng(8)
    cand = np.stack([rng.permutation(300)[:40] for _ in range(20)])
    f = PayloadFormat(16, kind="fp32")
    S, I = f.rerank(q, cand, f.encode(db), k=10)
    for i in range(20):
        s_ref, i_ref = cosine_search(q[i:i + 1], db[np.sort(cand[i])], 10)
        np.testing.assert_array_equal(I[i], np.sort(cand[i])[i_ref[0]])
        np.testing.assert_allclose(S[i], s_ref[0], rtol=1e-5)


def test_rerank_ties_padding_and_k():
    db = np.zeros((6, 4), np.float32)
    db[[1, 3, 4], 0] = 1.0     # three identical candidates
    db[[0, 2, 5], 1] = 1.0
    f = PayloadFormat(4, kind="fp16")
    q = np.array([[1, 0, 0, 0]], np.float32)
    S, I = f.rerank(q, np.array([[4, -1, 3, 0, 1]]), f.encode(db), k=7)
    assert list(I[0]) == [1, 3, 4, 0, -1, -1, -1]     # equal scores by ascending database index
    assert S[0, 0] == S[0, 2] == pytest.approx(1.0) and np.isneginf(S[0, 4:]).all()
    with pytest.raises(PayloadError, match="candidates"):
        f.rerank(q, np.array([[6]]), f.encode(db))


def test_quantized_rerank_matches_cosine_on_decoded_payloads():
    db, q = unit(500, seed=9), unit(30, seed=10)
    f = PayloadFormat(128, kind="int4", topk=64)
    rec = f.encode(db)
    cand = np.tile(np.arange(500), (30, 1))
    S, I = f.rerank(q, cand, rec, k=20)
    S_ref, I_ref = cosine_search(q, f.decode(rec), 20)
    np.testing.assert_array_equal(I, I_ref)
    np.testing.assert_allclose(S, S_ref, atol=1e-5)


def test_verify_is_a_cosine_threshold_across_modalities():
    z_img = unit(50, seed=11)
    z_txt = z_img + 0.05 * unit(50, seed=12)      # the paired caption, near the image in the shared space
    c = PayloadCodec.default(128, ("image", "text"))
    rec = c.encode("image", z_img)
    cos = c.cosine(z_txt, "image", rec)
    assert cos.dtype == np.float32 and np.all(cos > 0.95)
    assert c.verify(z_txt, "image", rec, 0.95).all()
    assert not c.verify(unit(50, seed=13), "image", rec, 0.5).any()
    one = c.cosine(z_txt[0], "image", rec)          # one query against many records
    assert one.shape == (50,) and one.argmax() == 0


def test_rerank_tie_rule_matches_lexsort_reference():
    # entries in {0, +-1}, four non-zeros per vector: every cosine is an exact multiple of 1/4, so ties abound
    rng = np.random.default_rng(15)

    def sparse_signs(n, d=16):
        x = np.zeros((n, d), np.float32)
        for row in x:
            row[rng.choice(d, 4, replace=False)] = rng.choice([-1.0, 1.0], 4)
        return x

    db, q = sparse_signs(400), sparse_signs(25)
    cand = np.stack([rng.permutation(400)[:60] for _ in range(25)])
    cand[:, -5:] = -1
    f = PayloadFormat(16, kind="fp16")
    S, I = f.rerank(q, cand, f.encode(db), k=30)
    for i in range(25):
        c = cand[i][cand[i] >= 0]
        sc = (db[c] @ q[i]) / 4.0
        ref = c[np.lexsort((c, -sc))][:30]
        np.testing.assert_array_equal(I[i], ref)
        np.testing.assert_array_equal(S[i], np.sort(sc)[::-1][:30])


# ------------------------------------------------------------------------------------------ checked / unchecked

@pytest.mark.parametrize("settings", [dict(kind="fp32"), dict(kind="fp16"), dict(kind="int4"),
                                      dict(kind="int4", topk=32), dict(kind="int4", scale="channel", topk=48)])
def test_unchecked_scores_equal_the_checked_path(settings):
    db, q = unit(40, seed=16), unit(1, seed=17)[0]
    f = PayloadFormat(128, **settings).fit(db)
    rec = f.encode(db)
    checked = f.scores(q, rec)
    np.testing.assert_array_equal(f.scores(q, rec, checked=False), checked)
    np.testing.assert_array_equal(f.decode_unchecked(rec), f.decode(rec))
    np.testing.assert_allclose(checked, f.cosine(q, rec), atol=1e-6)     # one computation, any entry point
    np.testing.assert_allclose(checked, rowcos(f.decode(rec), np.tile(q, (40, 1))), atol=1e-6)
    codec = PayloadCodec({"image": f})
    np.testing.assert_array_equal(codec.scores("image", q, rec, checked=False), checked)
    with pytest.raises(PayloadError, match="uint8"):
        f.scores(q, rec.astype(np.int16))                                 # the checked path refuses bad records
    assert f.scores(q, np.zeros((0, f.nbytes), np.uint8)).shape == (0,)


def test_compiled_int4_group_scores_equal_decode_then_dot():
    """The int4 group-scaled format scores in one compiled pass; it equals decoding then the dot product."""
    from ushash.serving.payload import PayloadCodec, scoring

    rng = np.random.default_rng(0)
    for dim, group in ((128, 32), (100, 32), (7, 3)):
        fmt = PayloadCodec.uniform(dim, ("image",), kind="int4", scale="group", group_size=group)["image"]
        x = rng.normal(size=(40, dim)).astype(np.float32) * rng.uniform(1e-4, 50, size=(40, 1)).astype(np.float32)
        x[0] = 0
        recs = fmt.encode(x)
        q = rng.normal(size=(40, dim)).astype(np.float32)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
        ref_one = scoring.scores(fmt, q[0], recs, checked=True)
        ref_rows = scoring.scores(fmt, q, recs, checked=True)
        np.testing.assert_allclose(fmt.scores(q[0], recs), ref_one, atol=2e-6)
        np.testing.assert_allclose(fmt.scores(q, recs, checked=False), ref_rows, atol=2e-6)
        assert fmt.scores(q[0], recs)[0] == 0.0
