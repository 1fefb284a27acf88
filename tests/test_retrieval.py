"""retrieval.evaluate against a naive reference: directions, protocols, a separate database, tiny databases, ties."""

import numpy as np
import pytest

from ushash.evaluation import retrieval
from ushash.data import synthetic
from ushash.data.store import write_split


def _naive_ap10(q_groups, d_groups, scores):
    """Brute force: rank by score descending, ties by index; paired relevance; Z = min(10, #rel)."""
    aps = []
    for i, g in enumerate(q_groups):
        order = sorted(range(len(d_groups)), key=lambda j: (-scores[i][j], j))[:10]
        rel = [d_groups[j] == g for j in order]
        n_rel = sum(dg == g for dg in d_groups)
        hits, s = 0, 0.0
        for r, ok in enumerate(rel, 1):
            if ok:
                hits += 1
                s += hits / r
        aps.append(s / min(10, n_rel) if n_rel else 0.0)
    return float(np.mean(aps))


def test_codes_against_naive_hamming_ranking_with_separate_database(tmp_path):
    tq = synthetic.clustered(40, 4, {"image": 8, "text": 8}, seed=1, aligned=True)
    td = synthetic.clustered(60, 4, {"image": 8, "text": 8}, seed=2, aligned=True)
    # queries share groups with some database items: make the first 20 query groups reappear in the database
    td["image"]["groups"][:20] = tq["text"]["groups"][:20]
    q = write_split(tmp_path / "q", "toy", "query", tq, synthetic.ENCODER)
    d = write_split(tmp_path / "d", "toy", "db", td, synthetic.ENCODER)
    planes = np.random.default_rng(0).normal(size=(8, 8))

    def lsh(m, x):
        from ushash.core import codes
        return "codes", codes.pack(x @ planes > 0)

    rows = retrieval.evaluate(q, {"lsh": lsh}, protocols=("paired",), database=d)
    got = {r["direction"]: r["map@10"] for r in rows}
    qb = (np.asarray(q.tables["text"].x) @ planes > 0)
    db = (np.asarray(d.tables["image"].x) @ planes > 0)
    ham = (qb[:, None, :] != db[None, :, :]).sum(-1)
    want = _naive_ap10(list(q.tables["text"].groups), list(d.tables["image"].groups), -ham)
    assert np.isclose(got["T→I"], want)
    assert set(got) == {"T→I", "I→T"}


def test_database_smaller_than_k_pads_with_no_result(tmp_path):
    t = synthetic.clustered(6, 2, {"image": 4, "text": 4}, aligned=True)
    s = write_split(tmp_path / "s", "toy", "test", t, synthetic.ENCODER)
    rows = retrieval.evaluate(s, {"raw": lambda m, x: ("float", x)}, k=10)
    assert rows and all(0 <= r["map@10"] <= 1 for r in rows)
    cos = np.asarray(s.tables["image"].x) @ np.asarray(s.tables["text"].x).T
    norms = np.linalg.norm(s.tables["image"].x, axis=1)[:, None] * np.linalg.norm(s.tables["text"].x, axis=1)[None]
    want = _naive_ap10(list(s.tables["image"].groups), list(s.tables["text"].groups), cos / norms)
    got = [r for r in rows if r["direction"] == "I→T" and r["protocol"] == "paired"][0]["map@10"]
    assert np.isclose(got, want)


def _palette_split(n, seed, palette, dims=2):
    """Three modalities whose rows repeat a few vectors (heavy ties), groups and multi-label sets per row."""
    from ushash.data.store import FeatureSplit, Table

    rng = np.random.default_rng(seed)
    tables = {}
    for m in ("image", "text", "audio"):
        pick = rng.integers(0, len(palette), n)
        labels = [tuple(sorted(set(rng.choice(list("abcd"), rng.integers(0, 3)).tolist()))) for _ in range(n)]
        tables[m] = Table(m, palette[pick].astype(np.float32), [f"{m}{i}" for i in range(n)],
                          np.array([f"g{v}" for v in rng.integers(0, 4, n)]), labels)
    return FeatureSplit(None, {"name": "toy"}, tables)


def _naive_rows(q, d, scores_of, k, ks, exhaustive):
    """Per direction and protocol, from loops over the raw rows: tie-broken map@k / R@K (ties by ascending
    row) and, with `exhaustive`, the tie-aware values as the mean over every ordering of tied items."""
    from test_metrics_ties import naive_expectation

    out = {}
    for qm, qt in q.tables.items():
        for dm, dt in d.tables.items():
            if qm == dm:
                continue
            score = scores_of(qt.x, dt.x)  # exact: float64 or integer, larger is nearer
            for protocol in ("paired", "label"):
                rel = np.array([[qt.groups[i] == dt.groups[j] if protocol == "paired" else bool(set(qt.labels[i]) & set(dt.labels[j]))
                                 for j in range(len(dt))] for i in range(len(qt))])
                aps, hit = [], {K: [] for K in ks}
                for i in range(len(qt)):
                    order = sorted(range(len(dt)), key=lambda j: (-score[i, j], j))
                    found, total = 0, 0.0
                    for r, j in enumerate(order[:k], 1):
                        if rel[i, j]:
                            found += 1
                            total += found / r
                    aps.append(total / min(k, rel[i].sum()) if rel[i].any() else 0.0)
                    for K in ks:
                        hit[K].append(float(rel[i, order[:K]].any()))
                want = {f"map@{k}": np.mean(aps), **{f"R@{K}": np.mean(v) for K, v in hit.items()}}
                if exhaustive:
                    want.update(naive_expectation(score, rel, k, ks, "min", descending=True))
                out[(retrieval.direction_name(qm, dm), protocol)] = want
    return out



@pytest.mark.parametrize("kind", ["codes", "float"])
def test_evaluate_equals_naive_loops_in_every_direction_and_protocol_ties_included(kind):
    """Queries and a separate database of 9 and 7 rows per modality, each row one of 9 vectors: every
    reported metric (tie-broken and tie-aware, paired and label, six directions) against loops over the rows
    and the exhaustive average over tie orderings."""
    from ushash.core import codes

    grid = np.array([(a, b) for a in range(3) for b in range(3)], np.float32)
    q, d = _palette_split(9, 1, grid), _palette_split(7, 2, grid)
    lut = np.random.default_rng(3).standard_normal((9, 16)).astype(np.float32)  # one vector per grid point

    def bits(x):
        x = np.asarray(x)
        return np.stack([x[:, 0] > 0, x[:, 0] > 1, x[:, 1] > 0, x[:, 1] > 1] + [x[:, 0] < 0] * 4, axis=1)

    def vec(x):
        x = np.asarray(x).astype(int)
        return lut[x[:, 0] * 3 + x[:, 1]]

    if kind == "codes":
        method = lambda m, x: ("codes", codes.pack(bits(x)))
        scores_of = lambda a, b: -(bits(a)[:, None] != bits(b)[None]).sum(-1)
    else:
        method = lambda m, x: ("float", vec(x))
        unit = lambda v: v.astype(np.float64) / np.linalg.norm(v, axis=1, keepdims=True)
        scores_of = lambda a, b: np.round(unit(vec(a)) @ unit(vec(b)).T, 9)
    k, ks = 5, (1, 3, 5)
    rows = retrieval.evaluate(q, {"m": method}, k=k, ks=ks, database=d)
    want = _naive_rows(q, d, scores_of, k, ks, exhaustive=True)
    assert {(r["direction"], r["protocol"]) for r in rows} == set(want) and len(want) == 12
    for r in rows:
        expect = want[(r["direction"], r["protocol"])]
        assert set(expect) <= set(r)
        for key, v in expect.items():
            assert r[key] == pytest.approx(v, abs=1e-9), (r["direction"], r["protocol"], key)


def test_evaluate_float_ties_of_repeated_rows_in_a_large_database():
    """600 database rows repeating 13 vectors (64-d), where one float32 product would round repeats apart:
    the tie-broken metrics equal the naive loops on exact scores, and the tie-aware mAP@10 is the closed form
    on exact scores (its closed form is checked exhaustively in test_metrics_ties)."""
    from ushash.core import metrics

    lut = np.random.default_rng(4).standard_normal((13, 64)).astype(np.float32)
    grid = np.arange(13, dtype=np.float32)[:, None]
    q, d = _palette_split(40, 5, grid), _palette_split(600, 6, grid)
    vec = lambda x: lut[np.asarray(x)[:, 0].astype(int)]
    unit = lambda v: v.astype(np.float64) / np.linalg.norm(v, axis=1, keepdims=True)
    scores_of = lambda a, b: np.round(unit(vec(a)) @ unit(vec(b)).T, 9)
    rows = retrieval.evaluate(q, {"m": lambda m, x: ("float", vec(x))}, database=d)
    want = _naive_rows(q, d, scores_of, 10, (1, 5, 10), exhaustive=False)
    for r in rows:
        expect = want[(r["direction"], r["protocol"])]
        for key, v in expect.items():
            assert r[key] == pytest.approx(v, abs=1e-9), (r["direction"], r["protocol"], key)
        qm, dm = [{"I": "image", "T": "text", "A": "audio"}[c] for c in r["direction"].split("→")]
        qt, dt = q.tables[qm], d.tables[dm]
        score = scores_of(qt.x, dt.x)
        rel = metrics.relevance_matrix(qt.groups, dt.groups) if r["protocol"] == "paired" else np.array(
            [[bool(set(a) & set(b)) for b in dt.labels] for a in qt.labels])
        tie = metrics.expected_report(*metrics.tie_blocks(score, rel, 10), rel.sum(axis=1), k=10, ks=(1, 5, 10))
        assert r["tie_map@10"] == pytest.approx(tie["tie_map@10"], abs=1e-9)


def _three_splits(tmp_path):
    """A query split with image, text and audio rows, and databases with and without audio (seeded)."""
    dims = {"image": 8, "text": 8, "audio": 8}
    q = write_split(tmp_path / "q", "toy", "query", synthetic.clustered(30, 3, dims, seed=1), synthetic.ENCODER)
    full = write_split(tmp_path / "d", "toy", "db", synthetic.clustered(40, 3, dims, seed=2), synthetic.ENCODER)
    from ushash.data.store import FeatureSplit
    no_audio = FeatureSplit(full.path, {**full.meta, "split": "db-no-audio"},
                            {m: t for m, t in full.tables.items() if m != "audio"})   # the same rows, less audio
    return q, full, no_audio


def test_a_database_without_a_modality_reports_the_directions_it_cannot_run(tmp_path, caplog):
    """Queries with audio against a database with no audio rows: I→A, T→A and also A→I, A→T silently vanished
    from the rows (every audio direction was dropped, even those that need audio only in the queries)."""
    q, full, no_audio = _three_splits(tmp_path)
    method = lambda m, x: ("float", np.asarray(x, np.float32))  # noqa: E731
    skipped = []
    with caplog.at_level("WARNING", logger="ushash.evaluation.retrieval"):
        rows = retrieval.evaluate(q, {"m": method}, protocols=("paired",), database=no_audio, skipped=skipped)
    assert {r["direction"] for r in rows} == {"I→T", "T→I", "A→I", "A→T"}   # audio queries need no audio database
    assert [(s["method"], s["direction"]) for s in skipped] == [("m", "I→A"), ("m", "T→A")]
    assert all(s["reason"] == "the database split 'db-no-audio' has no audio rows" for s in skipped)
    assert "I→A, T→A (the database split 'db-no-audio' has no audio rows)" in caplog.text
    # the rows that do run are the ones the full database gives for the same pairs of tables
    want = {r["direction"]: r for r in retrieval.evaluate(q, {"m": method}, protocols=("paired",), database=full)}
    assert len(want) == 6 and all(r == want[r["direction"]] for r in rows)
    # the other way round: queries with no audio, a database with audio rows
    skipped = []
    rows = retrieval.evaluate(no_audio, {"m": method}, protocols=("paired",), database=full, skipped=skipped)
    assert {r["direction"] for r in rows} == {"I→T", "T→I", "I→A", "T→A"}
    assert {s["direction"]: s["reason"] for s in skipped} == {
        "A→I": "the query split 'db-no-audio' has no audio rows", "A→T": "the query split 'db-no-audio' has no audio rows"}


def test_nothing_is_skipped_when_both_sides_have_every_modality(tmp_path, caplog):
    q, full, _ = _three_splits(tmp_path)
    method = lambda m, x: ("float", np.asarray(x, np.float32))  # noqa: E731
    for database in (full, None):
        skipped = []
        with caplog.at_level("WARNING", logger="ushash.evaluation.retrieval"):
            rows = retrieval.evaluate(q, {"m": method}, protocols=("paired",), database=database, skipped=skipped)
        assert len({r["direction"] for r in rows}) == 6 and skipped == []
    assert "not evaluated" not in caplog.text
