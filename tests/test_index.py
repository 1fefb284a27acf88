import zlib

import numpy as np
import pytest

from ushash.core import index as index_mod
from ushash.core.codes import hamming
from ushash.core.index import PAD_DISTANCE, HammingIndex, cosine_search


def _popcount_dist(a, b):
    return sum(bin(int(x) ^ int(y)).count("1") for x, y in zip(a, b))


def _brute_knn(q, db, k):
    """Pure-Python reference: sort every item by (distance, index), keep k, pad with (INT32_MAX, -1)."""
    D, I = [], []
    for row in q:
        ranked = sorted((_popcount_dist(row, c), j) for j, c in enumerate(db))[:k]
        ranked += [(PAD_DISTANCE, -1)] * (k - len(ranked))
        D.append([d for d, _ in ranked])
        I.append([j for _, j in ranked])
    return np.array(D, np.int32).reshape(len(q), k), np.array(I, np.int64).reshape(len(q), k)


def _brute_range(q, db, radius):
    lims, D, I = [0], [], []
    for row in q:
        hits = sorted((d, j) for j, c in enumerate(db) if (d := _popcount_dist(row, c)) <= radius)
        D += [d for d, _ in hits]
        I += [j for _, j in hits]
        lims.append(len(D))
    return np.array(lims), np.array(D, np.int32), np.array(I, np.int64)


def _few_values(rng, n, nbytes, nvalues):
    palette = rng.integers(0, 256, (nvalues, nbytes), dtype=np.uint8)
    return palette[rng.integers(0, nvalues, n)]


@pytest.fixture
def count_fallback(monkeypatch):
    """Count calls of the tie-overflow path so tests can assert which path they exercised."""
    calls = []
    orig = HammingIndex._fill_ties

    def wrapped(self, q, dk, need):
        calls.append(len(q))
        return orig(self, q, dk, need)

    monkeypatch.setattr(HammingIndex, "_fill_ties", wrapped)
    return calls


@pytest.mark.parametrize(
    "name, nbytes, n, m, k",
    [
        ("random64", 8, 300, 40, 10),
        ("ties16", 2, 400, 40, 10),
        ("ties16_k1", 2, 400, 40, 1),
        ("few_values", 4, 300, 30, 10),
        ("few_values_k50", 4, 300, 30, 50),
        ("k_eq_n", 2, 37, 10, 37),
        ("k_gt_n", 2, 37, 10, 50),
        ("tiny", 1, 3, 5, 2),
    ],
)
def test_search_equals_brute_force(name, nbytes, n, m, k, count_fallback):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if name.startswith("few_values"):
        db = _few_values(rng, n, nbytes, 4)
        q = np.concatenate([_few_values(rng, m // 2, nbytes, 4), rng.integers(0, 256, (m - m // 2, nbytes), dtype=np.uint8)])
    else:
        db = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
        db[n // 2 :: 3] = db[: len(db[n // 2 :: 3])]  # duplicate codes
        q = rng.integers(0, 256, (m, nbytes), dtype=np.uint8)
        q[:3] = db[:3]
    idx = HammingIndex(db)
    D, I = idx.search(q, k)
    assert D.dtype == np.int32 and I.dtype == np.int64 and D.shape == I.shape == (m, k)
    Dr, Ir = _brute_knn(q, db, k)
    np.testing.assert_array_equal(D, Dr)
    np.testing.assert_array_equal(I, Ir)
    if name.startswith("few_values"):
        assert count_fallback, "the tie-overflow path should have been exercised"


def test_search_ties_at_k_boundary_and_order_independence(count_fallback):
    # Big tie groups (196 zeros, 33 ones): the top-k boundary falls inside a tie group, sometimes
    # after a few strictly nearer items (query [3, 0]: one item at 0, then 33 at distance 1).
    db = np.zeros((230, 2), np.uint8)
    db[::7] = [1, 0]
    db[5] = [3, 0]
    q = np.array([[1, 0], [0, 0], [3, 0], [7, 0]], np.uint8)
    idx = HammingIndex(db)
    D, I = idx.search(q, 12)
    Dr, Ir = _brute_knn(q, db, 12)
    np.testing.assert_array_equal(D, Dr)
    np.testing.assert_array_equal(I, Ir)
    assert count_fallback
    # permuting the database permutes the answer exactly (no dependence on heap internals)
    perm = np.random.default_rng(0).permutation(len(db))
    D2, I2 = HammingIndex(db[perm]).search(q, 12)
    Dp, Ip = _brute_knn(q, db[perm], 12)
    np.testing.assert_array_equal(I2, Ip)
    np.testing.assert_array_equal(D2, Dp)


def test_search_larger_random_vs_vectorised_reference(monkeypatch):
    rng = np.random.default_rng(5)
    db = rng.integers(0, 256, (3000, 2), dtype=np.uint8)  # 16 bits: heavy ties
    q = rng.integers(0, 256, (500, 2), dtype=np.uint8)
    monkeypatch.setattr(index_mod, "_BLOCK_CELLS", 40 * 64)  # several query chunks everywhere
    D, I = HammingIndex(db).search(q, 20)
    h = hamming(q, db).astype(np.int64)
    key = np.sort(h * len(db) + np.arange(len(db)), axis=1)[:, :20]
    np.testing.assert_array_equal(D, key // len(db))
    np.testing.assert_array_equal(I, key % len(db))


def test_search_sparse_tie_group_spans_several_scan_blocks(count_fallback):
    # 64-bit random codes (far away) plus, scattered over rows 4000..8999, 2 exact copies of each query
    # and 40 copies with one bit flipped: k=5 -> k2=21 < 42, the tie group at distance 1 overflows
    # and the tie scan has to walk several doubling blocks (256, 512, 1024, ...).
    rng = np.random.default_rng(21)
    n = 9000
    db = rng.integers(0, 256, (n, 8), dtype=np.uint8)
    q = rng.integers(0, 256, (3, 8), dtype=np.uint8)
    for qi in range(3):
        pos = rng.choice(np.arange(4000, n), 42, replace=False)  # none in the first blocks
        db[pos] = q[qi]
        flip = rng.integers(0, 64, 40)
        db[pos[2:], flip // 8] ^= (1 << (flip % 8)).astype(np.uint8)
    D, I = HammingIndex(db).search(q, 5)
    h = hamming(q, db).astype(np.int64)
    key = np.sort(h * n + np.arange(n), axis=1)[:, :5]
    np.testing.assert_array_equal(D, key // n)
    np.testing.assert_array_equal(I, key % n)
    assert D[:, :2].max() == 0 and (D[:, 2:] == 1).all()
    assert count_fallback == [3]


def test_search_empty_database_and_queries():
    idx = HammingIndex(np.zeros((0, 8), np.uint8))
    D, I = idx.search(np.zeros((2, 8), np.uint8), 3)
    assert (I == -1).all() and (D == PAD_DISTANCE).all() and D.shape == (2, 3)
    D, I = HammingIndex(np.zeros((4, 8), np.uint8)).search(np.zeros((0, 8), np.uint8), 3)
    assert D.shape == I.shape == (0, 3)


@pytest.mark.parametrize("radius", [0, 1, 2, 3, 5, 16, 100])
def test_range_search_inclusive_equals_brute(radius):
    rng = np.random.default_rng(radius)
    db = rng.integers(0, 256, (200, 2), dtype=np.uint8)
    db[100:150] = db[:50]
    q = np.concatenate([db[:5], rng.integers(0, 256, (10, 2), dtype=np.uint8)])
    lims, D, I = HammingIndex(db).range_search(q, radius)
    assert lims.dtype == np.int64 and D.dtype == np.int32 and I.dtype == np.int64
    lr, Dr, Ir = _brute_range(q, db, radius)
    np.testing.assert_array_equal(lims, lr)
    np.testing.assert_array_equal(D, Dr)
    np.testing.assert_array_equal(I, Ir)


def test_range_search_radius_boundary_hand_case():
    db = np.array([[0], [1], [3], [7], [255]], np.uint8)  # distances 0, 1, 2, 3, 8 from 0
    idx = HammingIndex(db)
    q = np.zeros((1, 1), np.uint8)
    for r, expect in [(0, [0]), (1, [0, 1]), (2, [0, 1, 2]), (8, [0, 1, 2, 3, 4])]:
        lims, D, I = idx.range_search(q, r)
        assert I.tolist() == expect and lims.tolist() == [0, len(expect)]
        assert D.tolist() == [0, 1, 2, 3, 8][: len(expect)]


def test_multihash_range_search_equals_flat():
    rng = np.random.default_rng(9)
    base = rng.integers(0, 256, (50, 8), dtype=np.uint8)
    # near duplicates: flip a few random bits of base codes
    db = np.repeat(base, 20, axis=0)
    flips = rng.integers(0, 64, (len(db), 3))
    for j in range(3):
        db[np.arange(len(db)), flips[:, j] // 8] ^= (1 << (flips[:, j] % 8)).astype(np.uint8)
    q = base[:20]
    flat, mh = HammingIndex(db), HammingIndex(db, multihash=(4, 16))
    for r in range(0, 8):  # r <= 3 uses the multi-hash index, larger radii fall back to flat
        a, b = flat.range_search(q, r), mh.range_search(q, r)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        lr, Dr, Ir = _brute_range(q, db, r)
        np.testing.assert_array_equal(a[2], Ir)
    assert len(a[2]) > 0


def _exact_tie_vectors(rng, n, dim=16, nvalues=6):
    """Vectors with four +-1 entries (norm 2): normalised entries are +-0.5, dot products are exact."""
    palette = np.zeros((nvalues, dim), np.float32)
    for v in palette:
        pos = rng.choice(dim, 4, replace=False)
        v[pos] = rng.choice([-1.0, 1.0], 4)
    return palette[rng.integers(0, nvalues, n)] * rng.choice([1.0, 3.0], (n, 1)).astype(np.float32)


@pytest.mark.parametrize("k", [1, 7, 40, 60])
def test_cosine_search_exact_ties(k, monkeypatch):
    rng = np.random.default_rng(k)
    db = _exact_tie_vectors(rng, 40)
    db[3] = 0.0  # zero row: cosine 0 with everything
    q = _exact_tie_vectors(rng, 9)
    monkeypatch.setattr(index_mod, "_BLOCK_CELLS", 80)  # several query chunks
    S, I = cosine_search(q, db, k)
    assert S.dtype == np.float32 and I.dtype == np.int64 and S.shape == I.shape == (9, k)
    for qi, row in enumerate(q):
        qn = row / np.linalg.norm(row)
        sims = [float(qn @ (d / n)) if (n := np.linalg.norm(d)) > 0 else 0.0 for d in db]
        ranked = sorted(range(len(db)), key=lambda j: (-sims[j], j))[:k]
        ranked += [-1] * (k - len(ranked))
        assert I[qi].tolist() == ranked
        got = S[qi, : min(k, len(db))]
        np.testing.assert_allclose(got, [sims[j] for j in ranked[: len(got)]], atol=1e-6)
        assert np.isneginf(S[qi, len(db) :]).all()


def test_cosine_search_random_floats():
    rng = np.random.default_rng(3)
    db = rng.standard_normal((500, 32))
    q = rng.standard_normal((20, 32)).astype(np.float32)
    S, I = cosine_search(q, db, 10)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    dbn = db / np.linalg.norm(db, axis=1, keepdims=True)
    ref = qn.astype(np.float64) @ dbn.T
    np.testing.assert_allclose(S, np.take_along_axis(ref, I, 1), atol=1e-5)
    np.testing.assert_allclose(S, -np.sort(-ref, axis=1)[:, :10], atol=1e-5)
    assert (np.diff(S, axis=1) <= 0).all()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: HammingIndex(np.zeros(8, np.uint8)), "codes"),
        (lambda: HammingIndex(np.zeros((3, 8), np.int64)), "codes"),
        (lambda: HammingIndex(np.zeros((3, 0), np.uint8)), "codes"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8), multihash=(3, 16)), "multihash"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8)).search(np.zeros((2, 4), np.uint8), 1), r"queries_packed must be uint8 \[N, 8\]"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8)).search(np.zeros((2, 8), np.float32), 1), "queries_packed"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8)).search(np.zeros((2, 8), np.uint8), 0), "k must"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8)).range_search(np.zeros((2, 8), np.uint8), -1), "radius"),
        (lambda: HammingIndex(np.zeros((3, 8), np.uint8)).range_search(np.zeros((2, 8), np.uint8), 1.5), "radius"),
        (lambda: cosine_search(np.zeros((2, 4)), np.zeros((3, 5)), 1), r"db_float must be float \[N, 4\]"),
        (lambda: cosine_search(np.zeros(4), np.zeros((3, 4)), 1), "queries_float"),
        (lambda: cosine_search(np.full((1, 4), np.nan), np.zeros((3, 4)), 1), "NaN"),
        (lambda: cosine_search(np.zeros((1, 4)), np.zeros((3, 4)), 0), "k must"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_cosine_search_repeated_rows_tie_exactly_in_a_large_database():
    """4099 rows drawn from 13 vectors (128-d): one float32 product rounds a repeated row differently by its
    column, so without scoring each distinct row once the tie order among repeats would be rounding noise.
    Against a reference that ranks by the source vector's float64 cosine (exact ties), ties by index."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((13, 128)).astype(np.float32)
    which = rng.integers(0, 13, 4099)
    db, q = base[which], rng.standard_normal((37, 128)).astype(np.float32)
    k = 600  # deeper than any one group, so the order within and across groups is checked
    S, I = cosine_search(q, db, k)
    bn = base.astype(np.float64) / np.linalg.norm(base, axis=1, keepdims=True)
    qn = q.astype(np.float64) / np.linalg.norm(q, axis=1, keepdims=True)
    ref = qn @ bn.T  # [37, 13]: one score per source vector
    for qi in range(len(q)):
        want = sorted(range(len(db)), key=lambda j: (-ref[qi, which[j]], j))[:k]
        assert I[qi].tolist() == want
        groups = which[I[qi]]
        for g in np.unique(groups):  # every repeat of a vector carries the same bits
            assert len(set(S[qi, groups == g].tolist())) == 1


def test_distinct_rows_round_trip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 6)).astype(np.float32)
    assert index_mod.distinct_rows(x)[1] is None  # nothing repeats: the rows as they are
    y = x[rng.integers(0, 50, 200)]
    unique, inverse = index_mod.distinct_rows(y)
    np.testing.assert_array_equal(unique[inverse], y)
    assert len(unique) == len(np.unique(y, axis=0))
