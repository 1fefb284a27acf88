"""retrieval.evaluate against a naive reference: directions, protocols, a separate database, tiny databases."""

import numpy as np

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
