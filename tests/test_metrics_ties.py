"""Tie-aware metrics (McSherry & Najork): the closed form against naive averages over tie orderings."""

import itertools
import math

import numpy as np
import pytest

from ushash.core.metrics import expected_report, hamming_blocks, relevance_matrix, tie_blocks


def _ap(rel_row, n_rel, k, denominator):
    hits, total = 0, 0.0
    for i, r in enumerate(rel_row[:k], start=1):
        if r:
            hits += 1
            total += hits / i
    z = {"min": min(k, n_rel), "all": n_rel}[denominator]
    return total / z if z > 0 else 0.0


def _metrics(rel_row, n_rel, k, ks, denominator):
    out = {f"tie_map@{k}": _ap(rel_row, n_rel, k, denominator)}
    for K in ks:
        out[f"tie_R@{K}"] = float(any(rel_row[:K]))
        out[f"tie_P@{K}"] = sum(rel_row[:K]) / K
    return out


def _orderings(scores, descending):
    """Every ranking consistent with the scores: the tie groups in score order, each in every order."""
    vals = sorted(set(scores), reverse=descending)
    groups = [[j for j, s in enumerate(scores) if s == v] for v in vals]
    for perms in itertools.product(*(itertools.permutations(g) for g in groups)):
        yield [j for p in perms for j in p]


def naive_expectation(scores, rel, k, ks, denominator, descending):
    """Mean over queries of the mean over every tie ordering (exhaustive)."""
    per_query = []
    for srow, rrow in zip(scores, rel):
        n_rel = int(sum(rrow))
        acc, n = {}, 0
        for order in _orderings(list(srow), descending):
            for key, v in _metrics([bool(rrow[j]) for j in order], n_rel, k, ks, denominator).items():
                acc[key] = acc.get(key, 0.0) + v
            n += 1
        per_query.append({key: v / n for key, v in acc.items()})
    return {key: float(np.mean([q[key] for q in per_query])) for key in per_query[0]}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("denominator", ["min", "all"])
def test_closed_form_equals_exhaustive_average_over_tie_orders(seed, denominator):
    """Integer scores in a small range (heavy ties), 7 items per query: every consistent ordering is
    enumerated and averaged; the closed form matches to 1e-12, for distances and for similarities."""
    rng = np.random.default_rng(seed)
    m, n, k, ks = 12, 7, 4, (1, 2, 3, 5)
    scores = rng.integers(0, 3, size=(m, n))
    rel = rng.random((m, n)) < 0.35
    rel[0] = False                      # a query with no relevant item
    scores[1] = 1                       # one block holding every item
    n_rel = rel.sum(axis=1)
    for descending in (False, True):
        want = naive_expectation(scores, rel, k, ks, denominator, descending)
        count, relevant = tie_blocks(scores, rel, depth=max(k, *ks), descending=descending)
        got = expected_report(count, relevant, n_rel, k=k, ks=ks, denominator=denominator)
        for key in want:
            assert got[key] == pytest.approx(want[key], abs=1e-12), (key, descending)


def test_without_ties_the_expectation_is_the_plain_metric():
    rng = np.random.default_rng(1)
    scores = rng.permutation(40).reshape(4, 10).astype(float)
    rel = rng.random((4, 10)) < 0.3
    count, relevant = tie_blocks(scores, rel, depth=10)
    assert count.max() == 1
    got = expected_report(count, relevant, rel.sum(1), k=5, ks=(1, 5))
    order = np.argsort(-scores, axis=1)
    want = [_metrics([bool(rel[i, j]) for j in order[i]], int(rel[i].sum()), 5, (1, 5), "min") for i in range(4)]
    for key in got:
        assert got[key] == pytest.approx(np.mean([w[key] for w in want]), abs=1e-12)


def test_hamming_blocks_match_the_generic_blocks_and_a_random_tie_average():
    """Random 16-bit codes against 200 items: the distance histogram gives the same expectation as the
    sorted blocks, and it agrees with the mean over 3,000 random tie orders within sampling error."""
    rng = np.random.default_rng(3)
    dist = rng.integers(0, 17, size=(5, 200))
    rel = rng.random((5, 200)) < 0.05
    n_rel = rel.sum(axis=1)
    a = expected_report(*hamming_blocks(dist, rel, 16), n_rel, k=10, ks=(1, 10))
    b = expected_report(*tie_blocks(dist, rel, depth=10, descending=False), n_rel, k=10, ks=(1, 10))
    for key in a:
        assert a[key] == pytest.approx(b[key], abs=1e-12)
    draws = []
    for _ in range(3000):
        order = np.argsort(dist + 0.5 * rng.random(dist.shape), axis=1)  # a random order within each tie
        draws.append(np.mean([_metrics([bool(rel[i, j]) for j in order[i][:10]], int(n_rel[i]), 10, (1, 10), "min")
                              ["tie_map@10"] for i in range(5)]))
    se = np.std(draws) / math.sqrt(len(draws))
    assert abs(np.mean(draws) - a["tie_map@10"]) < 4 * se + 1e-9


def test_relevance_matrix_protocols():
    g = np.array([1, 2, 2])
    assert relevance_matrix(g, np.array([2, 1, 3]), "paired").tolist() == [[False, True, False], [True, False, False],
                                                                          [True, False, False]]
    ql = np.array([[1, 0], [0, 0]], bool)
    dl = np.array([[1, 1], [0, 1]], bool)
    assert relevance_matrix(None, None, "label", ql, dl).tolist() == [[True, False], [False, False]]
    with pytest.raises(ValueError, match="protocol"):
        relevance_matrix(g, g, "nope")


def test_found_denominator_is_refused():
    with pytest.raises(ValueError, match="'min' or 'all'"):
        expected_report(np.ones((1, 1)), np.ones((1, 1)), np.ones(1), denominator="found")


def test_evaluate_reports_the_tie_aware_value_beside_the_tie_broken_one(tmp_path):
    """8-bit codes of 150 items: heavy ties. The tie-broken mAP@10 moves when the database rows are shuffled;
    the tie-aware value does not, and it is the mean of the tie-broken value over shuffles (within error)."""
    from ushash.core import codes
    from ushash.evaluation import retrieval
    from ushash.data import synthetic
    from ushash.data.store import FeatureSplit, Table

    sp = synthetic.write_synthetic(tmp_path, sizes={"train": 10, "val": 10, "test": 150}, n_classes=6,
                                   dims={"image": 8, "text": 8})["test"]
    planes = np.random.default_rng(0).normal(size=(8, 8))

    def method(m, x):
        return "codes", codes.pack(np.asarray(x) @ planes > 0)

    def shuffled(seed):
        rng = np.random.default_rng(seed)
        tables = {}
        for m, t in sp.tables.items():
            p = rng.permutation(len(t))
            tables[m] = Table(m, np.asarray(t.x)[p], [t.ids[i] for i in p], t.groups[p], [t.labels[i] for i in p])
        return FeatureSplit(sp.path, dict(sp.meta), tables)

    runs = [retrieval.evaluate(sp, {"lsh": method}, database=shuffled(s)) for s in range(300)]
    key = lambda r: (r["direction"], r["protocol"])
    for i, row in enumerate(runs[0]):
        broken = np.array([run[i]["map@10"] for run in runs])
        ties = {run[i]["tie_map@10"] for run in runs}
        assert max(ties) - min(ties) < 1e-9, key(row)            # independent of the database order
        assert broken.std() > 0                                   # the tie-broken value is not
        assert abs(broken.mean() - row["tie_map@10"]) < 4 * broken.std() / np.sqrt(len(broken)) + 1e-6, key(row)
    # floats without ties: the two agree
    rows = retrieval.evaluate(sp, {"f": lambda m, x: ("float", np.asarray(x, np.float32))})
    for r in rows:
        assert r["tie_map@10"] == pytest.approx(r["map@10"], abs=1e-9)
        assert r["tie_R@1"] == pytest.approx(r["R@1"], abs=1e-9)


def test_radius_curves_match_a_naive_loop():
    """Hamming-radius precision / recall / retrieved and P@H<=2 (metrics.CURVES_DOC) against plain loops over
    queries and radii; ties need no rule here (a radius takes every item at that distance)."""
    from ushash.core.metrics import radius_counts, radius_curves
    rng = np.random.default_rng(7)
    bits, m, n = 8, 25, 40
    dist = rng.integers(0, bits + 1, size=(m, n))
    rel = rng.random((m, n)) < 0.2
    rel[0] = False
    dist[1] = 7                                   # a query that retrieves nothing within small radii
    got = radius_curves(*radius_counts(*hamming_blocks(dist, rel, bits)))
    prec, rec, ret = [], [], []
    for r in range(bits + 1):
        p_vals, r_vals, n_got = [], [], 0
        for i in range(m):
            inside = [j for j in range(n) if dist[i, j] <= r]
            hits = sum(rel[i, j] for j in inside)
            if inside:
                n_got += 1
                p_vals.append(hits / len(inside))
            if rel[i].sum():
                r_vals.append(hits / rel[i].sum())
        prec.append(sum(p_vals) / len(p_vals) if p_vals else 0.0)
        rec.append(sum(r_vals) / len(r_vals))
        ret.append(n_got / m)
    np.testing.assert_allclose(got["precision"], prec, atol=1e-12)
    np.testing.assert_allclose(got["recall"], rec, atol=1e-12)
    np.testing.assert_allclose(got["retrieved"], ret, atol=1e-12)
    p2 = [sum(rel[i, j] for j in range(n) if dist[i, j] <= 2) / max(1, sum(dist[i] <= 2)) for i in range(m)]
    assert got["p_h2"] == pytest.approx(np.mean(p2), abs=1e-12)
    assert got["p_h2_retrieved"] == pytest.approx(np.mean([(dist[i] <= 2).any() for i in range(m)]), abs=1e-12)


def test_mean_curves_average_each_radius_over_the_directions_where_it_is_defined():
    """The sweep's PR curve over directions and seeds (`sweep._mean_curves`): at each radius, the mean of the
    directions whose precision is defined there (some query retrieves something within r) and, for recall,
    of those with a query that has a relevant item. A direction that retrieves nothing within r counted as
    precision 0, halving here a curve that is 1 at every radius in every direction that retrieves."""
    from ushash.core.metrics import radius_counts, radius_curves
    from ushash.evaluation.sweep import _mean_curves

    bits = 8
    exact = np.array([[0, 5, 6, 7], [5, 0, 6, 7], [5, 6, 0, 7], [5, 6, 7, 0]])   # each query's own item at 0
    far = exact + 3 * np.eye(4, dtype=int)                                        # ... at 3: nothing within 0-2
    none = np.zeros((4, 4), bool)                                                 # no query has a relevant item
    curves = []
    for direction, dist, rel in (("I→T", exact, np.eye(4, dtype=bool)), ("T→I", far, np.eye(4, dtype=bool)),
                                 ("I→A", exact, none)):
        c = radius_curves(*radius_counts(*hamming_blocks(dist, rel, bits)))
        curves.append({"method": "m", "bits": bits, "direction": direction, "protocol": "paired", "n_queries": 4,
                       "n_no_relevant": int((~rel.any(1)).sum()), "p_at_k": {"1": 0.5},
                       "pr": {k: c[k] for k in ("precision", "recall", "retrieved")}})
    pr = _mean_curves([{"bits": bits, "curves": curves}], "m", bits, "paired")["pr"]
    # precision: I→T is 1 everywhere, T→I undefined below 3 then 1, I→A 0 everywhere (it retrieves, wrongly)
    assert pr["precision"][:4] == [0.5, 0.5, 0.5, pytest.approx(2 / 3, abs=1e-4)]
    # recall: I→A has no relevant item anywhere and is left out; I→T 1 everywhere, T→I 0 below radius 3
    assert pr["recall"][:4] == [0.5, 0.5, 0.5, 1.0]
    assert pr["retrieved"][:4] == [pytest.approx(2 / 3, abs=1e-4)] * 3 + [1.0]


def test_group_ids_compare_exactly_across_int_types_and_never_int_with_str():
    """Paired relevance with int64 query groups and uint64 database groups (64-bit hash ids): numpy compared
    them through float64 in `relevance`'s count, so ids above 2**53 counted no relevant item (n_rel 0 beside
    relevant hits); and `relevance_matrix` (the tie-aware path) scored int against str groups as all
    irrelevant where `relevance` refuses them."""
    from ushash.core.metrics import relevance

    big = 2 ** 60
    qg = np.array([big + 1, big + 3], np.int64)
    dg = np.array([big, big + 1, big + 2, big + 3, big + 3], np.uint64)
    I = np.array([[0, 1, 2, 3, 4]] * 2)
    rel, n_rel = relevance(I, qg, dg)
    assert rel.astype(int).tolist() == [[0, 1, 0, 0, 0], [0, 0, 0, 1, 1]] and n_rel.tolist() == [1, 2]
    np.testing.assert_array_equal(relevance_matrix(qg, dg), relevance_matrix(qg, dg.astype(np.int64)))
    huge = np.array([2 ** 63 + 5, 7], np.uint64)
    assert relevance(np.array([[0, 1]]), np.array([7], np.int64), huge)[1].tolist() == [1]   # as uint64
    with pytest.raises(ValueError, match="negative ids"):
        relevance(np.array([[0, 1]]), np.array([-1], np.int64), huge)
    for fn in (lambda: relevance(np.array([[0, 1]]), [1], ["1", "2"]), lambda: relevance_matrix([1, 2], ["1", "2"])):
        with pytest.raises(ValueError, match="both be int or both be str"):
            fn()
