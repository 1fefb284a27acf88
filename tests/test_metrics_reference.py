"""Evaluation against naive references on seeded data (ties, a one-row database, several captions per group,
a modality with few rows), and the inputs that must be refused rather than turned into a number."""

import itertools
from pathlib import Path

import numpy as np
import pytest

from ushash.core import codes, metrics
from ushash.data.store import FeatureSplit, Table
from ushash.evaluation import retrieval

LETTERS = {"I": "image", "T": "text", "A": "audio"}


def _table(m, x, groups, labels):
    return Table(m, np.asarray(x, np.float32), [f"{m}{i}" for i in range(len(groups))], np.asarray(groups, str), labels)


def _split(seed, n_audio=None):
    """3 groups: one image each, 1-2 captions each, audio for some (n_audio rows); 4-d integer vectors, so
    8-bit codes tie a lot; multi-label sets per group."""
    rng = np.random.default_rng(seed)
    labels = [tuple(sorted({f"c{c}" for c in rng.integers(0, 3, rng.integers(1, 3))})) for _ in range(3)]
    members = {"image": [0, 1, 2], "text": [g for g in range(3) for _ in range(int(rng.integers(1, 3)))],
               "audio": [0, 2][: n_audio if n_audio is not None else 2]}
    tables = {}
    for m, gs in members.items():
        x = rng.integers(-1, 2, size=(len(gs), 4)).astype(np.float32)
        x[:, 0] += 3  # no all-zero row
        tables[m] = _table(m, x, [f"g{g}" for g in gs], [labels[g] for g in gs])
    return FeatureSplit(Path("."), {}, tables)


def _ap(rel_row, n_rel, k):
    hits, total = 0, 0.0
    for i, r in enumerate(rel_row[:k], start=1):
        if r:
            hits += 1
            total += hits / i
    return total / min(k, n_rel) if n_rel else 0.0


def _naive(dist, rel, k, ks):
    """Tie-broken (ascending index) and tie-aware (every order of equal distances) metrics, and P@H<=2."""
    tb, tie = [], []
    for d, r in zip(dist.tolist(), rel.tolist()):
        n_rel = sum(r)
        order = sorted(range(len(d)), key=lambda j: (d[j], j))
        tb.append({f"map@{k}": _ap([r[j] for j in order], n_rel, k),
                   **{f"R@{K}": float(any(r[j] for j in order[:K])) for K in ks}})
        groups = [[j for j in range(len(d)) if d[j] == v] for v in sorted(set(d))]
        per = []
        for perms in itertools.product(*(itertools.permutations(g) for g in groups)):
            o = [j for p in perms for j in p]
            per.append({f"tie_map@{k}": _ap([r[j] for j in o], n_rel, k),
                        **{f"tie_R@{K}": float(any(r[j] for j in o[:K])) for K in ks},
                        **{f"tie_P@{K}": sum(r[j] for j in o[:K]) / K for K in ks}})
        tie.append({key: np.mean([p[key] for p in per]) for key in per[0]})
        within = [j for j in range(len(d)) if d[j] <= 2]
        tie[-1]["p_h2"] = sum(r[j] for j in within) / len(within) if within else 0.0
    per_query = [a | b for a, b in zip(tb, tie)]
    out = {key: float(np.mean([q[key] for q in per_query])) for key in per_query[0]}
    return out | {"n_no_relevant": int((rel.sum(1) == 0).sum()), "n_queries": len(rel)}


@pytest.mark.parametrize("seed", range(4))
def test_every_direction_and_protocol_equals_naive_loops(seed):
    """Six directions x two protocols: map@k, R@K (tie-broken), tie_map@k, tie_R@K, tie_P@K (every tie order),
    P@H<=2, with k larger than the database (one audio row with seed 0)."""
    split = _split(seed, n_audio=1 if seed == 0 else None)
    planes = np.random.default_rng(seed).normal(size=(4, 8))
    bits = lambda x: np.asarray(x) @ planes > 0  # noqa: E731
    k, ks = 3, (1, 2, 5)
    rows = retrieval.evaluate(split, {"m": lambda m, x: ("codes", codes.pack(bits(x)))}, k=k, ks=ks, curves=True)
    assert {(r["direction"], r["protocol"]) for r in rows} == {
        (retrieval.direction_name(a, b), p) for a in LETTERS.values() for b in LETTERS.values() if a != b
        for p in ("paired", "label")}
    for r in rows:
        qt, dt = (split.tables[LETTERS[c]] for c in r["direction"].split("→"))
        dist = (bits(qt.x)[:, None] != bits(dt.x)[None]).sum(-1)
        rel = (qt.groups[:, None] == dt.groups[None] if r["protocol"] == "paired" else
               np.array([[bool(set(a) & set(b)) for b in dt.labels] for a in qt.labels]))
        for key, want in _naive(dist, rel, k, ks).items():
            assert r[key] == pytest.approx(want, abs=1e-12), (r["direction"], r["protocol"], key)


def _lsh(m, x):
    return "codes", codes.pack(np.tile(np.asarray(x), 2) > np.arange(8) % 3 - 1)


@pytest.mark.parametrize("method, match", [
    (lambda m, x: ("code", _lsh(m, x)[1]), r"method 'm' on the query image table must return \('codes'"),
    (lambda m, x: ("float", np.where(np.arange(len(x))[:, None] == 1, np.nan, x)), "method 'm' .* NaN or inf"),
    (lambda m, x: ("float", np.asarray(x)[:-1] if m == "text" else x), r"one row per table row \[\d+, ...\]"),
    (lambda m, x: ("float", np.asarray(x).tolist()), r"got \('float', list\)"),
    (lambda m, x: _lsh(m, x) if m == "image" else ("float", x), "returned codes for image but float for text"),
    (lambda m, x: ("codes", np.asarray(x) > 0), r"must return packed uint8 codes .*; got dtype bool"),
])
def test_bad_representations_are_refused_naming_the_method(method, match):
    """A kind typo was ranked as floats (cosine over packed bytes); a short table or NaN failed deep inside."""
    with pytest.raises(ValueError, match=match):
        retrieval.evaluate(_split(0), {"m": method})


def test_a_short_database_representation_is_refused_not_scored():
    """With denominator "found" (no full ranking) a database method output shorter than its table was ranked
    and scored against the table's groups: n_rel counted rows the ranking never saw."""
    q, d = _split(1), _split(1)
    seen = []

    def short(m, x):
        seen.append(m)
        return "float", (np.asarray(x)[:-1] if m == "text" and seen.count("text") == 2 else np.asarray(x))

    with pytest.raises(ValueError, match="on the database text table must return one row per table row"):
        retrieval.evaluate(q, {"m": short}, database=d, denominator="found", protocols=("paired",))


def test_a_key_error_inside_a_method_propagates():
    """Only KeyError(modality) means "no encoder"; any other KeyError silently dropped the modality's
    directions (and with two modalities every row: the selection score was NaN)."""
    def buggy(m, x):
        return {"image": ("float", x)}[m] if m == "image" else {}["weights"]

    with pytest.raises(KeyError, match="weights"):
        retrieval.evaluate(_split(0), {"m": buggy})
    no_audio = lambda m, x: (_ for _ in ()).throw(KeyError(m)) if m == "audio" else ("float", x)  # noqa: E731
    assert {r["direction"] for r in retrieval.evaluate(_split(0), {"m": no_audio})} == {"I→T", "T→I"}


def test_an_empty_table_has_no_direction_and_does_not_drag_the_mean():
    """An audio table with no rows gave four directions scoring 0 (two with no queries at all) and no tie-aware
    keys; the selection score fell from the mean over I↔T to a third of it."""
    with_empty, without = _split(2, n_audio=0), _split(2)
    del without.tables["audio"]
    method = lambda m, x: ("float", x)  # noqa: E731
    rows = retrieval.evaluate(with_empty, {"m": method})
    assert {r["direction"] for r in rows} == {"I→T", "T→I"}
    assert retrieval.selection(rows) == retrieval.selection(retrieval.evaluate(without, {"m": method}))
    assert all("tie_map@10" in r for r in rows)


def test_selection_without_rows_is_refused():
    with pytest.raises(ValueError, match="at least one direction"):
        retrieval.selection([])


def test_headline_map_with_the_found_denominator():
    """`python -m ushash.eval denominator=found` (docs/baselines.md) wrote its tables, then failed on the missing
    tie_map@10 key; the score is the tie-broken paired mAP then, the tie-aware one otherwise."""
    split = _split(3)
    found = retrieval.evaluate(split, {"m": _lsh}, denominator="found")
    assert retrieval.headline_map(found, 10) == retrieval.mean_map(found, "paired", 10)
    tied = retrieval.evaluate(split, {"m": _lsh})
    assert retrieval.headline_map(tied, 10) == retrieval.mean_map(tied, "paired", key="tie_map@10")


def test_hamming_blocks_refuse_distances_beyond_bits():
    """A distance above `bits` spilled into the next query's blocks: here query 1 counted two items at distance
    0 (it has one) and query 0 none."""
    with pytest.raises(ValueError, match=r"in \[0, bits=8\]"):
        metrics.hamming_blocks(np.array([[9], [0]]), np.array([[True], [False]]), 8)
    with pytest.raises(ValueError, match="one shape"):
        metrics.hamming_blocks(np.zeros((2, 3), int), np.zeros((2, 4), bool), 8)


@pytest.mark.parametrize("args, kw, match", [
    (([[2]], [[2]], [1]), {}, "n_rel >= the relevant"),      # was tie_map@10 = 2.0
    (([[2]], [[3]], [3]), {}, "relevant <= count"),
    (([[2]], [[1]], [1, 1]), {}, r"n_rel \[M\]"),
    (([[2]], [[1]], [1]), {"k": 0}, "k must be a positive int"),  # was 0.0
])
def test_expected_report_refuses_inconsistent_blocks(args, kw, match):
    with pytest.raises(ValueError, match=match):
        metrics.expected_report(*(np.array(a) for a in args), **kw)


def test_relevance_refuses_a_repeated_index():
    """One relevant item listed twice counted twice: AP@3 = 1.0 for a ranking that found one of two."""
    with pytest.raises(ValueError, match="repeats a database index"):
        metrics.relevance(np.array([[0, 0, 1]]), np.array([0]), np.array([0, 1, 0]))
    rel, _ = metrics.relevance(np.array([[0, -1, -1]]), np.array([0]), np.array([0, 1, 0]))  # -1 may repeat
    assert rel.tolist() == [[True, False, False]]


def test_labels_given_as_a_str_are_refused():
    """A row's labels "cat" were the three labels c, a, t: "cat" and "act" shared every label."""
    split = _split(0)
    split.tables["text"].labels[0] = "cat"
    with pytest.raises(ValueError, match="labels of text row 0 must be a tuple of names; got the str 'cat'"):
        retrieval.evaluate(split, {"m": lambda m, x: ("float", x)})
