import numpy as np
import pytest

from ushash.core.codes import hamming
from ushash.core.index import HammingIndex
from ushash.core.metrics import (
    average_precision_at_k,
    precision_at_k,
    recall_at_k,
    relevance,
    retrieval_report,
)

# ----------------------------------------------------------------- naive pure-Python references


def ref_relevance(I, qg, dg, protocol, ql=None, dl=None):
    def is_rel(q, j):
        if protocol == "paired":
            return qg[q] == dg[j]
        return any(a and b for a, b in zip(ql[q], dl[j]))

    rel = [[j != -1 and is_rel(q, j) for j in row] for q, row in enumerate(I)]
    ndb = len(dg) if protocol == "paired" else len(dl)
    n_rel = [sum(is_rel(q, j) for j in range(ndb)) for q in range(len(I))]
    return rel, n_rel


def ref_ap(rel_row, n_rel, k, denominator):
    hits, total = 0, 0.0
    for i, r in enumerate(rel_row[:k], start=1):
        if r:
            hits += 1
            total += hits / i
    z = {"min": min(k, n_rel), "found": hits, "all": n_rel}[denominator]
    return total / z if z > 0 else 0.0


def ref_recall(rel, K):
    return sum(any(row[:K]) for row in rel) / len(rel)


def ref_precision(rel, K):
    return sum(sum(row[:K]) / K for row in rel) / len(rel)


def ref_knn(q, db, k):
    out = []
    for row in q:
        d = [sum(bin(int(a) ^ int(b)).count("1") for a, b in zip(row, c)) for c in db]
        ranked = sorted(range(len(db)), key=lambda j: (d[j], j))[:k]
        out.append(ranked + [-1] * (k - len(ranked)))
    return np.array(out, np.int64)


# ------------------------------------------------------------------------------ random fixtures


def random_case(seed, m=30, n=60, k=10, protocol="paired", str_groups=False, n_labels=5):
    rng = np.random.default_rng(seed)
    I = np.array([rng.permutation(n)[:k] if k <= n else np.r_[rng.permutation(n), [-1] * (k - n)] for _ in range(m)])
    I[rng.random((m, k)) < 0.05] = -1  # scattered "no result"
    qg = rng.integers(0, 12, m)
    dg = rng.integers(0, 10, n)  # query groups 10 and 11 have no relevant item
    if str_groups:
        qg = np.array([f"g{x}" for x in qg])
        dg = np.array([f"g{x}" for x in dg])
    ql = rng.random((m, n_labels)) < 0.3
    dl = rng.random((n, n_labels)) < 0.2
    ql[:3] = False  # queries with no labels: no relevant item
    return I, qg, dg, ql, dl


CASES = [
    dict(seed=0),
    dict(seed=1, str_groups=True),
    dict(seed=2, protocol="label"),
    dict(seed=3, protocol="label", n_labels=1),
    dict(seed=4, k=80),  # k larger than the database
    dict(seed=5, k=80, protocol="label"),
    dict(seed=6, k=1),
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_relevance_and_metrics_match_reference(case):
    protocol = case.get("protocol", "paired")
    I, qg, dg, ql, dl = random_case(**case)
    k = I.shape[1]
    rel, n_rel = relevance(I, qg, dg, protocol, q_labels=ql, db_labels=dl)
    rrel, rn = ref_relevance(I.tolist(), qg.tolist(), dg.tolist(), protocol, ql.tolist(), dl.tolist())
    assert rel.dtype == np.bool_ and rel.shape == I.shape and n_rel.dtype == np.int64
    assert rel.tolist() == rrel and n_rel.tolist() == rn
    assert (n_rel == 0).any() and (n_rel > 0).any()
    for denom in ("min", "found", "all"):
        for kk in sorted({1, min(5, k), k}):
            ap = average_precision_at_k(rel, n_rel, kk, denom)
            np.testing.assert_allclose(ap, [ref_ap(r, z, kk, denom) for r, z in zip(rrel, rn)], rtol=0, atol=1e-12)
    ks = tuple(sorted({1, min(5, k), k}))
    rec, prec = recall_at_k(rel, n_rel, ks), precision_at_k(rel, ks)
    for K in ks:
        assert rec[K] == pytest.approx(ref_recall(rrel, K), abs=1e-12)
        assert prec[K] == pytest.approx(ref_precision(rrel, K), abs=1e-12)
    rep = retrieval_report(I, qg, dg, protocol, k=k, ks=ks, denominator="found", q_labels=ql, db_labels=dl)
    assert rep[f"map@{k}"] == pytest.approx(np.mean([ref_ap(r, z, k, "found") for r, z in zip(rrel, rn)]), abs=1e-12)
    assert rep["n_queries"] == len(I) and rep["n_no_relevant"] == sum(z == 0 for z in rn)
    assert rep["protocol"] == protocol and rep["denominator"] == "found"


def test_label_relevance_chunked(monkeypatch):
    import ushash.core.metrics as metrics_mod

    I, qg, dg, ql, dl = random_case(seed=7, m=50, n=40, protocol="label")
    full = relevance(I, qg, dg, "label", q_labels=ql, db_labels=dl)
    monkeypatch.setattr(metrics_mod, "_BLOCK_CELLS", 100)  # 2 queries per block
    chunked = relevance(I, None, None, "label", q_labels=ql, db_labels=dl)
    np.testing.assert_array_equal(full[0], chunked[0])
    np.testing.assert_array_equal(full[1], chunked[1])


# --------------------------------------------------------------------------------- hand cases


def test_ap_hand_cases():
    rel = np.array([[True, False, True]])
    for denom in ("min", "found", "all"):
        assert average_precision_at_k(rel, np.array([2]), 3, denom)[0] == pytest.approx((1 + 2 / 3) / 2)
    n5 = np.array([5])
    assert average_precision_at_k(rel, n5, 3, "min")[0] == pytest.approx((1 + 2 / 3) / 3)
    assert average_precision_at_k(rel, n5, 3, "found")[0] == pytest.approx((1 + 2 / 3) / 2)
    assert average_precision_at_k(rel, n5, 3, "all")[0] == pytest.approx((1 + 2 / 3) / 5)
    # only the first k columns count
    assert average_precision_at_k(rel, n5, 1, "min")[0] == 1.0
    assert average_precision_at_k(rel, n5, 2, "min")[0] == pytest.approx(1 / 2)
    # DCASE: one relevant item -> AP@10 = 1 / rank
    rel10 = np.zeros((1, 10), bool)
    rel10[0, 3] = True
    assert average_precision_at_k(rel10, np.array([1]), 10)[0] == pytest.approx(1 / 4)
    # no relevant item at all: 0 (and counted), under every denominator
    none = np.zeros((2, 3), bool)
    for denom in ("min", "found", "all"):
        assert average_precision_at_k(none, np.array([0, 4]), 3, denom).tolist() == [0.0, 0.0]


def test_recall_precision_hand_case():
    rel = np.array([[False, True, False], [False, False, False], [True, True, True]])
    assert recall_at_k(rel, np.array([1, 0, 3]), ks=(1, 2, 3)) == {1: 1 / 3, 2: 2 / 3, 3: 2 / 3}
    assert precision_at_k(rel, ks=(1, 3)) == {1: pytest.approx(1 / 3), 3: pytest.approx(4 / 9)}


def test_report_keys_and_paired_hand_case():
    # db groups: item 0,1 -> a; 2 -> b; 3 -> c. Query 0 (a) gets [2, 0, 1]; query 1 (z) has none.
    I = np.array([[2, 0, 1], [0, 1, -1]])
    rep = retrieval_report(I, np.array(["a", "z"]), np.array(["a", "a", "b", "c"]), "paired", k=3, ks=(1, 3))
    assert set(rep) == {"map@3", "R@1", "R@3", "n_queries", "n_no_relevant", "protocol", "denominator"}
    ap0 = (1 / 2 + 2 / 3) / 2
    assert rep["map@3"] == pytest.approx(ap0 / 2)
    assert rep["R@1"] == 0.0 and rep["R@3"] == 0.5
    assert (rep["n_queries"], rep["n_no_relevant"], rep["protocol"], rep["denominator"]) == (2, 1, "paired", "min")
    rep10 = retrieval_report(np.arange(10)[None], np.array([7]), np.full(12, 7), "paired")
    assert set(rep10) >= {"map@10", "R@1", "R@5", "R@10"} and rep10["map@10"] == 1.0


# ------------------------------------------------------------------- index + metrics end to end


@pytest.mark.parametrize("protocol", ["paired", "label"])
@pytest.mark.parametrize("denominator", ["min", "found", "all"])
def test_end_to_end_with_tied_codes(protocol, denominator):
    rng = np.random.default_rng(11)
    palette = rng.integers(0, 256, (6, 2), dtype=np.uint8)  # 16-bit codes, six distinct values
    db, q = palette[rng.integers(0, 6, 120)], palette[rng.integers(0, 6, 25)]
    q[-3:] = rng.integers(0, 256, (3, 2), dtype=np.uint8)
    dg, qg = rng.integers(0, 8, 120), rng.integers(0, 9, 25)
    dl, ql = rng.random((120, 4)) < 0.15, rng.random((25, 4)) < 0.3
    k = 10
    D, I = HammingIndex(db).search(q, k)
    Iref = ref_knn(q, db, k)
    np.testing.assert_array_equal(I, Iref)
    np.testing.assert_array_equal(D, np.take_along_axis(hamming(q, db), I, 1))
    rep = retrieval_report(I, qg, dg, protocol, k=k, denominator=denominator, q_labels=ql, db_labels=dl)
    rrel, rn = ref_relevance(Iref.tolist(), qg.tolist(), dg.tolist(), protocol, ql.tolist(), dl.tolist())
    assert rep[f"map@{k}"] == pytest.approx(np.mean([ref_ap(r, z, k, denominator) for r, z in zip(rrel, rn)]))
    for K in (1, 5, 10):
        assert rep[f"R@{K}"] == pytest.approx(ref_recall(rrel, K))
    assert rep["n_no_relevant"] == sum(z == 0 for z in rn)


# ------------------------------------------------------------------------------- bad inputs

I0 = np.array([[0, 1, 2], [3, 2, 1]], np.int64)
G2, G4 = np.array([0, 1]), np.array([0, 1, 2, 3])
L2, L4 = np.zeros((2, 5), bool), np.zeros((4, 5), bool)
R = np.zeros((2, 3), bool)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: relevance(np.zeros(3, np.int64), G2, G4), "I must be"),
        (lambda: relevance(np.zeros((2, 3)), G2, G4), "I must be"),
        (lambda: relevance(I0, np.array([0, 1, 2]), G4), r"q_groups must be a 1-D int or str array \[2\]"),
        (lambda: relevance(I0, G2, G4.reshape(2, 2)), "db_groups"),
        (lambda: relevance(I0, G2.astype(float), G4), "q_groups"),
        (lambda: relevance(I0, np.array(["a", "b"]), G4), "both be int or both be str"),
        (lambda: relevance(I0 + 4, G2, G4), r"\[0, 4\)"),
        (lambda: relevance(I0 - 2, G2, G4), "or -1"),
        (lambda: relevance(I0, G2, G4, "labels"), "protocol"),
        (lambda: relevance(I0, None, None, "label", q_labels=L2), "db_labels"),
        (lambda: relevance(I0, None, None, "label", db_labels=L4), "q_labels is required"),
        (lambda: relevance(I0, None, None, "label", q_labels=L2[:, :4], db_labels=L4), r"q_labels must be multi-hot bool \[2, 5\]"),
        (lambda: relevance(I0, None, None, "label", q_labels=L2.astype(float), db_labels=L4), "q_labels"),
        (lambda: average_precision_at_k(R, np.zeros(2, np.int64), 4), "at least k=4 columns"),
        (lambda: average_precision_at_k(R, np.zeros(3, np.int64), 3), r"n_rel must be an int array \[M\] = \[2\]"),
        (lambda: average_precision_at_k(R.astype(int), np.zeros(2, np.int64), 3), "rel must be a bool array"),
        (lambda: average_precision_at_k(R, np.zeros(2, np.int64), 3, "max"), "denominator"),
        (lambda: average_precision_at_k(R, np.zeros(2, np.int64), 0), "k must"),
        (lambda: average_precision_at_k(np.ones((2, 3), bool), np.ones(2, np.int64), 3), "n_rel is smaller"),
        (lambda: recall_at_k(R, np.zeros(2, np.int64), ks=(1, 5)), r"max\(ks\)=5"),
        (lambda: precision_at_k(R, ks=(0,)), "ks must"),
        (lambda: retrieval_report(I0, G2, G4, "paired", k=10), "at least k=10"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()
