import faiss
import numpy as np
import pytest

from ushash.core import codes
from ushash.core.codes import bit_balance, hamming, pack, unpack


def _naive_hamming(a, b):
    return [[sum(bin(int(x) ^ int(y)).count("1") for x, y in zip(ra, rb)) for rb in b] for ra in a]


def test_pack_hand_case_bit_order():
    # bit i -> bit (i % 8) of byte i // 8, least significant first
    signs = np.array([[1, -1, -1, -1, -1, -1, -1, -1, 1, 1, -1, -1, -1, -1, -1, -1]], np.float32)
    assert pack(signs).tolist() == [[1, 3]]
    signs = np.zeros((1, 8))
    signs[0, 7] = 0.5
    assert pack(signs).tolist() == [[128]]


@pytest.mark.parametrize("bits", [8, 16, 24, 64, 128, 1024])
def test_pack_matches_faiss_real_to_binary(bits):
    rng = np.random.default_rng(bits)
    x = rng.standard_normal((13, bits)).astype(np.float32)
    ref = np.zeros((13, bits // 8), np.uint8)
    faiss.real_to_binary(x.size, faiss.swig_ptr(x.ravel()), faiss.swig_ptr(ref.ravel()))
    np.testing.assert_array_equal(pack(x), ref)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, bool, np.int8, np.int64])
def test_pack_unpack_round_trip(dtype):
    rng = np.random.default_rng(0)
    bits01 = rng.integers(0, 2, (20, 48)).astype(np.uint8)
    signs = (bits01.astype(np.int64) * 2 - 1).astype(dtype) if dtype is not bool else bits01.astype(bool)
    p = pack(signs)
    assert p.dtype == np.uint8 and p.shape == (20, 6)
    u = unpack(p, 48)
    assert u.dtype == np.uint8 and u.shape == (20, 48)
    np.testing.assert_array_equal(u, bits01)
    np.testing.assert_array_equal(pack(u), p)


def test_pack_zero_is_zero_bit():
    assert pack(np.zeros((2, 8))).tolist() == [[0], [0]]
    assert pack(np.full((1, 8), -0.0)).tolist() == [[0]]


@pytest.mark.parametrize("nbytes", [1, 2, 3, 8, 9, 16])
def test_hamming_matches_naive_and_faiss(nbytes):
    rng = np.random.default_rng(nbytes)
    a = rng.integers(0, 256, (17, nbytes), dtype=np.uint8)
    b = rng.integers(0, 256, (23, nbytes), dtype=np.uint8)
    b[:5] = a[:5]  # duplicates -> distance 0
    h = hamming(a, b)
    assert h.dtype == np.int32 and h.shape == (17, 23)
    assert h.tolist() == _naive_hamming(a, b)
    idx = faiss.IndexBinaryFlat(nbytes * 8)
    idx.add(b)
    D, I = idx.search(a, len(b))
    ref = np.empty_like(h)
    np.put_along_axis(ref, I, D, axis=1)
    np.testing.assert_array_equal(h, ref)


def test_hamming_blocked_and_lut_fallback(monkeypatch):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 256, (40, 8), dtype=np.uint8)
    b = rng.integers(0, 256, (30, 8), dtype=np.uint8)
    ref = _naive_hamming(a, b)
    monkeypatch.setattr(codes, "_BLOCK_CELLS", 64)  # several row blocks
    assert hamming(a, b).tolist() == ref
    monkeypatch.delattr(np, "bitwise_count", raising=False)  # numpy < 2 path
    assert hamming(a, b).tolist() == ref


def test_hamming_empty():
    assert hamming(np.zeros((0, 2), np.uint8), np.zeros((3, 2), np.uint8)).shape == (0, 3)


def test_bit_balance():
    rng = np.random.default_rng(2)
    b01 = rng.integers(0, 2, (50, 16)).astype(bool)
    bal = bit_balance(pack(b01), 16)
    assert bal.shape == (16,)
    np.testing.assert_allclose(bal, [sum(r[i] for r in b01.tolist()) / 50 for i in range(16)])
    assert bit_balance(pack(np.ones((3, 8))), 8).tolist() == [1.0] * 8


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: pack(np.zeros(16)), "signs"),
        (lambda: pack(np.zeros((2, 12))), "multiple of 8"),
        (lambda: pack(np.zeros((2, 1032))), "multiple of 8"),
        (lambda: pack(np.zeros((2, 0))), "multiple of 8"),
        (lambda: pack(np.array([[np.nan] * 8])), "NaN"),
        (lambda: pack(np.array([["a"] * 8])), "signs"),
        (lambda: unpack(np.zeros((2, 3), np.uint8), 16), r"packed must be uint8 \[N, 2\]"),
        (lambda: unpack(np.zeros((2, 2), np.int32), 16), "packed"),
        (lambda: unpack(np.zeros(2, np.uint8), 16), "packed"),
        (lambda: unpack(np.zeros((2, 2), np.uint8), 15), "bits"),
        (lambda: hamming(np.zeros((2, 2), np.uint8), np.zeros((2, 3), np.uint8)), r"b_packed must be uint8 \[N, 2\]"),
        (lambda: hamming(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.uint8)), "a_packed"),
        (lambda: hamming([[1, 2]], np.zeros((2, 2), np.uint8)), "a_packed"),
        (lambda: bit_balance(np.zeros((2, 2), np.uint8), 8), "packed"),
        (lambda: bit_balance(np.zeros((0, 1), np.uint8), 8), "at least one row"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
