"""The budget benchmarks' own logic: GPTCache's decision rule replayed in numpy (checked against a direct
transcription of GPTCache's get/put), its threshold chosen on val, and the heads' run names, which follow
the resolved training config (a changed default trains a new head instead of resuming the old one)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def compare():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return _load("gptcache_compare", "benchmarks/gptcache/compare.py")


def gptcache_reference(xs, group, cls, src, stream, threshold):
    """GPTCache 0.1.44's get / put as written: faiss IndexFlatL2 over the stored embeddings of the request's
    cache, top_k 1, SearchDistanceEvaluation (rank = 4 - d^2, a hit when rank >= 4 t); a miss puts."""
    stored = {g: [] for g in xs}
    hits = false = 0
    for q in stream:
        g = int(group[q])
        x = xs[g][q]
        if stored[g]:
            d2 = [float(np.sum((xs[g][e] - x) ** 2)) for e in stored[g]]
            j = int(np.argmin(d2))          # the first of equal distances, as faiss's flat index
            if 4.0 - d2[j] >= 4.0 * threshold:
                hits += 1
                e = stored[g][j]
                false += int(cls[e] != cls[q] and src[e] != src[q])
                continue
        stored[g].append(q)
    return hits, false


def test_emulation_matches_gptcaches_rule(compare):
    rng = np.random.default_rng(0)
    n, k = 120, 15
    centres = rng.normal(size=(k, 16))
    cls = rng.integers(0, k, size=n)
    x = centres[cls] + 0.6 * rng.normal(size=(n, 16))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    group = (np.arange(n) % 2).astype(np.int64)            # two caches (e.g. per modality)
    xs = {g: np.where((group == g)[:, None], x, 0).astype(np.float32) for g in (0, 1)}
    p = 1.0 / np.arange(1, n + 1)
    stream = rng.choice(n, size=600, p=p / p.sum())
    cosines = [0.99, 0.9, 0.8, 0.6, 0.3]
    src = np.where(np.arange(n) % 4 < 2, np.arange(n), np.arange(n) - 2)   # members 4k+2, 4k+3 share 4k, 4k+1 inputs
    rows = compare.emulate(xs, group, cls, stream, cosines, src)
    for r, c in zip(rows, cosines):
        # away from the grid value a cosine >= c is d^2 <= 2 (1 - c) = 4 (1 - t)
        assert (r["hits"], r["false_hits"]) == gptcache_reference(xs, group, cls, src, stream, (1 + c) / 2), c
    assert rows[0]["hits"] < rows[-1]["hits"]               # looser thresholds serve more
    assert rows[-1]["false_hits"] > 0


def test_emulation_records_what_it_served(compare):
    """emulate's per-request record (served=) is the member GPTCache's rule serves each request (-1: a miss):
    its hits are the row's, each served entry is an earlier request of the same cache at cosine >= the
    threshold and its nearest stored one; the thresholds not asked for record nothing."""
    rng = np.random.default_rng(1)
    n = 60
    x = rng.normal(size=(n, 8))
    x[n // 2:] = x[: n // 2] + 0.3 * rng.normal(size=(n // 2, 8))   # near pairs
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    group = np.zeros(n, np.int64)
    cls = np.arange(n) % (n // 2)
    stream = rng.integers(0, n, 300)
    served = {0.9: []}
    rows = compare.emulate({0: x}, group, cls, stream, [0.95, 0.9], served=served)
    got = np.asarray(served[0.9])
    assert set(served) == {0.9} and len(got) == len(stream) and (got >= 0).sum() == rows[1]["hits"] > 0
    stored = []
    for q, e in zip(stream.tolist(), got.tolist()):
        if e >= 0:
            sims = x[stored] @ x[q]
            assert e in stored and float(x[e] @ x[q]) >= 0.9 and float(x[e] @ x[q]) == pytest.approx(float(sims.max()))
        elif q not in stored:
            stored.append(q)


def test_gains_count_each_caches_own_answers_by_pair_and_distance(compare):
    """`gains`: the requests only one cache answered, the other's by (pair, Hamming distance of the codes)
    with their z cosines and the cosines ushash's check reads, checked against a hand count."""
    class Enc:
        modality = np.array(["text", "text", "image", "image"])
        codes = np.zeros((4, 8), np.uint8)     # 64-bit codes, the bits in their first byte
        codes[:, 0] = [0b0000_0000, 0b0000_0111, 0b1000_0000, 0b1000_0001]
        z = np.eye(4, dtype=np.float32)
    Enc.z[1] = [0.6, 0.8, 0, 0]
    Enc.z[3] = [0, 0, 0.8, 0.6]
    stream = np.array([0, 1, 2, 3, 1, 3])
    ours = [-1, -1, -1, -1, 1, 2]        # ushash: a repeat of 1, and 3 answered by 2
    theirs = [-1, 0, -1, 2, 0, -1]       # GPTCache: 1 by 0 (d=3), 3 by 2 (d=1), the repeat of 1 by 0
    check = np.full((4, 4), np.nan)
    check[1, 0], check[3, 2] = 0.55, 0.78   # what the hit check reads: the request's z against the entry's payload
    g = compare.gains(Enc, check, stream, ours, theirs)
    assert (g["theirs_only"], g["ours_only"]) == (2, 1)
    assert g["by_pair_distance"] == [
        {"pair": "image>image", "distance": 1, "requests": 1, "cos_min": pytest.approx(0.8), "cos_max": pytest.approx(0.8),
         "check_min": pytest.approx(0.78), "check_max": pytest.approx(0.78)},
        {"pair": "text>text", "distance": 3, "requests": 1, "cos_min": pytest.approx(0.6), "cos_max": pytest.approx(0.6),
         "check_min": pytest.approx(0.55), "check_max": pytest.approx(0.55)}]


def test_threshold_is_chosen_on_val_within_the_bound(compare):
    rows = compare.with_bounds([
        {"cosine": 0.99, "hits": 400, "false_hits": 0, "hit_rate": 0.40},
        {"cosine": 0.95, "hits": 600, "false_hits": 1, "hit_rate": 0.60},     # upper 0.0079: passes
        {"cosine": 0.90, "hits": 700, "false_hits": 9, "hit_rate": 0.70},     # upper > 0.01
        {"cosine": 0.80, "hits": 800, "false_hits": 40, "hit_rate": 0.80}])
    assert compare.select_on_val(rows, 0.01)["cosine"] == 0.95
    assert compare.select_on_val(rows, 0.001) is None


def test_gptcaches_best_case_on_test_is_a_threshold_that_serves(compare):
    """The comparison's "chosen on test" row: the highest test hit rate within the false-hit limit. A threshold
    that served nothing passed any limit (0 false hits per hit), so with no real row within it the table
    showed a hit rate of 0 at some cosine instead of none."""
    rows = [{"cosine": 0.999, "hits": 0, "false_hits": 0, "false_per_hit": 0.0, "hit_rate": 0.0},
            {"cosine": 0.99, "hits": 400, "false_hits": 0, "false_per_hit": 0.0, "hit_rate": 0.40},
            {"cosine": 0.95, "hits": 600, "false_hits": 3, "false_per_hit": 0.005, "hit_rate": 0.60},
            {"cosine": 0.90, "hits": 700, "false_hits": 14, "false_per_hit": 0.02, "hit_rate": 0.70}]
    assert compare.best_on_test(rows, 0.01)["cosine"] == 0.95
    assert compare.best_on_test(rows, 0.0)["cosine"] == 0.99
    assert compare.best_on_test([rows[0], rows[3]], 0.01) is None


def test_embeddings_are_shared_z_or_per_modality_features(compare):
    from ushash.sim.pool import Pool

    pool = Pool()
    pool.add("image", np.ones(6), 0, "original", b"a")
    pool.add("text", np.ones(4) * 2, 0, "original", b"b")
    pool.add("image", np.arange(6.0), 1, "original", b"c")

    class Enc:
        z = np.eye(3, 5, dtype=np.float32)

    xs, group = compare.embeddings("z", Enc, pool)
    assert list(group) == [0, 0, 0] and xs[0].shape == (3, 5)
    xs, group = compare.embeddings("features", Enc, pool)
    assert list(group) == [0, 1, 0] and xs[0].shape == (3, 6) and xs[1].shape == (3, 4)
    assert np.allclose(np.linalg.norm(xs[0][[0, 2]], axis=1), 1) and np.allclose(xs[1][1], 0.5)


def test_head_runs_are_named_after_the_resolved_recipe():
    heads = _load("budget_heads", "scripts/budget_heads.py")
    a, recipe = heads.config_key(["data=tuxpaint", "encoder=offline"])
    assert heads.config_key(["data=tuxpaint", "encoder=offline"])[0] == a
    assert recipe["bits"] == 64 and recipe["seed"] == 0          # the shipped defaults the bars are about
    assert heads.config_key(["data=tuxpaint", "encoder=offline", "model.lr=0.002"])[0] != a   # a new default
    assert heads.config_key(["data=emoji", "encoder=offline"])[0] != a
    # where things go and whether to resume do not change the head
    assert heads.config_key(["data=tuxpaint", "encoder=offline", "resume=false", "run_name=x"])[0] == a
    # the training features are part of it: a store made again with other content is another head
    ov = ["data=tuxpaint", "encoder=offline"]
    stores = {"train": "0" * 16, "val": "1" * 16}
    assert heads.config_key(ov, stores)[0] == heads.config_key(ov, dict(stores))[0] != a
    assert heads.config_key(ov, {**stores, "val": "2" * 16})[0] != heads.config_key(ov, stores)[0]


def test_a_variant_of_the_recipe_is_named_apart_from_the_defaults_heads():
    """--override trains another head: it must be named (--name), and its export never takes the defaults' name,
    which the budget benchmarks read."""
    heads = _load("budget_heads", "scripts/budget_heads.py")
    assert heads.export_name("tuxpaint", "offline") == "budget-tuxpaint-offline"
    assert heads.export_name("tuxpaint", "offline", "margin") == "budget-tuxpaint-offline-margin"
    assert (heads.config_key(["data=tuxpaint", "encoder=offline", "model.loss.margin=10"])[0]
            != heads.config_key(["data=tuxpaint", "encoder=offline"])[0])
    with pytest.raises(SystemExit, match="--name"):   # refused before anything is extracted or trained
        heads.build("tuxpaint", "offline", ["model.loss.margin=10"])


@pytest.fixture(scope="module")
def payload_query():
    return _load("payload_query_bench", "benchmarks/payload_query.py")


def test_payload_query_best_on_val_against_a_naive_scan(payload_query):
    """The point with the most val hits whose bound meets the target (threshold <= the floor), ties to the
    smaller radius then the higher threshold: checked against a plain scan of every grid cell, ties included."""
    from ushash.serving.calibration import clopper_pearson_upper
    pq = payload_query
    rng = np.random.default_rng(3)
    R, T = len(pq.RADII), len(pq.THRESHOLDS)
    for trial in range(40):
        n = rng.integers(0, 6, size=(R, T)) * 100          # coarse counts: many equal hit counts (ties)
        bad = np.where(rng.random((R, T)) < 0.5, 0, rng.integers(0, 8, size=(R, T)))
        bad = np.minimum(bad, n)
        floor = float(rng.choice([1.0, 0.98, 0.9]))
        got = pq.best_on_val(n, bad, floor, 0.01, 0.05)
        cells = [(int(n[i, j]), -int(r), float(t), int(r)) for i, r in enumerate(pq.RADII) for j, t in enumerate(pq.THRESHOLDS)
                 if t <= floor + 1e-9 and n[i, j] > 0 and clopper_pearson_upper(int(bad[i, j]), int(n[i, j]), 0.05) <= 0.01]
        if not cells:
            assert got is None
            continue
        h, _, t, r = max(cells)
        assert got == (r, t, h), trial


def test_payload_query_request_side_gives_an_exact_repeat_cosine_one(payload_query):
    """The request through its own payload codec meets its own record at cosine 1 (to float rounding), where
    the fp32 z meets the INT4 record below 1; z rows are returned untouched for the shipped side."""
    from types import SimpleNamespace
    from ushash.serving.payload.codec import PayloadCodec
    from ushash.sim.calibrate import Encoded
    pq = payload_query
    rng = np.random.default_rng(0)
    z = rng.normal(size=(30, 64)).astype(np.float32)
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    mods = np.array(["image"] * 20 + ["text"] * 10)
    codec = PayloadCodec.default(64, ("image", "text"))
    records = {m: (np.flatnonzero(mods == m), codec.encode(m, z[mods == m])) for m in ("image", "text")}
    head = SimpleNamespace(payload=codec)
    enc = Encoded(modality=mods, codes=np.zeros((30, 8), np.uint8), z=z, records=records, cls=np.arange(30),
                  key=list(range(30)))
    assert pq.request_rows(head, enc, "z") is z
    raw = pq.cosines(head, enc, pq.request_rows(head, enc, "z"))
    own = pq.cosines(head, enc, pq.request_rows(head, enc, "payload"))
    floors_raw, floors_own = pq.repeat_floor(enc, raw), pq.repeat_floor(enc, own)
    assert floors_raw["image"] < 0.999 and floors_own["image"] > 1 - 1e-5
    assert floors_own["text"] > 1 - 1e-5
    # the naive reference: decode every record, cosine with each request row
    for m, (idx, recs) in records.items():
        dec = codec.decode(m, recs)
        ref = z @ dec.T / np.linalg.norm(dec, axis=1)
        np.testing.assert_allclose(raw[:, idx], ref, atol=2e-6)


def test_the_cost_run_of_ushash_replays_as_measure_does(compare, tmp_path):
    """ours.py, in a fresh process: the test stream's hits and false hits are measure's in this process, one
    entry per miss; the fill stores every one of its distinct entries; the timings and memory are filled in.
    And fill_rows makes distinct entries of the pool's image features through the head."""
    import torch

    from ushash.data import synthetic
    from ushash.hashing.heads import USHash
    from ushash.serving.artifact import load_export
    from ushash.serving.calibration import Calibration, PairPoint
    from ushash.serving.export import write_export
    from ushash.sim.calibrate import encode_pool, measure
    from ushash.sim.pool import pool_from_split
    from ushash.sim.stream import make_stream

    dims = {"image": 24, "text": 24}
    splits = synthetic.write_synthetic(tmp_path / "features", sizes={"train": 10, "val": 10, "test": 30},
                                       n_classes=8, dims=dims, aligned=True)
    torch.manual_seed(0)
    write_export(USHash(dims, bits=64, dim=32, hidden=32).eval(), tmp_path / "tiny",
                 {"name": "synthetic", "fingerprint": synthetic.ENCODER["fingerprint"]}, source={"dataset": "synthetic"})
    head = load_export(tmp_path / "tiny")
    pool = pool_from_split(splits["test"], seed=0)
    stream = make_stream(pool, 600, 1.0, 0)
    cal = Calibration(head.revision, 0.05, 0.95, {"image>image": PairPoint(True, 4, 0.9),
                                                  "text>text": PairPoint(True, 4, 0.9)})
    cal.save(tmp_path / "cal.json")
    enc = encode_pool(head, pool)
    ref = measure(head, pool, stream, calibration=cal, enc=enc)
    fill = compare.fill_rows(head, pool, 300)
    assert fill["modality"] == "image" and len(np.unique(fill["codes"], axis=0)) > 250
    assert fill["features"].shape == (300, 24) and np.allclose(np.linalg.norm(fill["z"], axis=1), 1, atol=1e-5)
    got = compare.costs(None, str(tmp_path / "tiny"), tmp_path / "cal.json", enc, stream, fill, {})
    u = got["ushash"]
    assert (u["hits"], u["false_hits"]) == (ref["hits"], ref["false_hits"]) and 0 < ref["hits"] < len(stream)
    assert u["entries"] == len(stream) - ref["hits"]
    assert u["fill"]["entries"] == 300                   # every fill entry stored (none is a repeat of another)
    assert u["lookup_p50_us"] > 0 and u["fill"]["accounted_per_entry"] > 0 and got["gptcache_fill"] == {}


def test_the_cost_table_puts_both_caches_side_by_side(compare):
    u = {"lookup_p50_us": 50.0, "lookup_p99_us": 90.0, "store_p50_us": 120.0, "entries": 10,
         "replay_rss_growth": 2 << 20, "loading_rss": 40 << 20, "process_rss": 700 << 20,
         "fill": {"entries": 1000, "rss_per_entry": 300.0, "accounted_per_entry": 84.0, "store_p50_us": 110.0}}
    t = {"cosine": 0.9, "get_p50_us": 2000.0, "get_p99_us": 9000.0, "put_p50_us": 700.0, "entries": 12,
         "replay_rss_growth": 6 << 20, "process_rss": 90 << 20}
    res = [{"dataset": "d", "embeddings": {"z": {"budgets": {"0.01": {"test": t}}}},
            "costs": {"budget": "0.01", "ushash": u, "fill_modality": "image",
                      "gptcache_fill": {"z": {"entries": 1000, "rss_per_entry": 1700.0, "put_p50_us": 440.0}}}}]
    lines = compare.cost_lines(res)
    assert "1,000 distinct image entries" in lines[1]
    assert lines[-2].startswith("| d | ushash (calibrated on val) | 50.0 / 90.0 | 1 | 120.0 | 10 | 2.0 | 300 | 84 |")
    assert lines[-1].startswith("| d | GPTCache, export z, cos >= 0.900 | 2000.0 / 9000.0 | 40x | 700.0 | 12 | 6.0 | 1700 | - |")
    assert compare.cost_lines([{"dataset": "d", "embeddings": {}}]) == []


def test_the_proxy_benchmarks_text_stream_is_each_caption_and_variants_that_change_it(tmp_path):
    """benchmarks/proxy_overhead.py's text requests: a stamp's caption (its .txt's first line) and n variants,
    each a different string; a stamp without a caption has none."""
    po = _load("proxy_overhead", "benchmarks/proxy_overhead.py")
    (tmp_path / "frog.png").write_bytes(b"")
    (tmp_path / "frog.txt").write_text("A green frog on a big leaf.\nfr.utf8=Une grenouille.\n", encoding="utf-8")
    (tmp_path / "mute.png").write_bytes(b"")
    rng = np.random.default_rng(0)
    caps = po.caption_variants(tmp_path / "frog.png", rng, 4)
    assert caps[0] == "A green frog on a big leaf." and len(caps) == 5
    assert all(c != caps[0] for c in caps[1:]) and len(set(caps)) == 5, caps
    assert po.caption_variants(tmp_path / "mute.png", rng, 4) is None
    body = po.chat_text(caps[1])
    assert body["messages"][0]["content"] == [{"type": "text", "text": caps[1]}]


def test_false_hit_budget_rows_every_budget_and_details_those_asked():
    """results.md: a summary row per (set, budget) with each pair's point; the per-pair evidence only for the
    budgets of --detail (every budget without it)."""
    fhb = _load("false_hit_budget", "benchmarks/false_hit_budget.py")
    pairs = {"image>image": {"on": True, "radius": 5, "threshold": 0.98}, "text>image": {"on": False}}
    test = {"hit_rate": 0.97, "false_per_hit": 0.0, "false_per_hit_upper": 0.0003, "false_per_request": 0.0,
            "exact_hit_rate": 0.9, "oracle_hit_rate": 0.99, "headroom_captured": 0.7, "pairs": {
                "image>image": {"hits": 10, "false_hits": 0, "upper": 0.26, "distinct": 4, "distinct_false": 0,
                                "distinct_upper": 0.5, "items": 2, "items_false": 0, "items_upper": 0.8}}}
    budgets = {b: {"calibration": {"pairs": pairs, "info": {"min_trials": 299}}, "table": f"TABLE {b}", "test": test}
               for b in ("0.01", "0.05")}
    results = [{"dataset": "a", "default": test, "budgets": budgets, "test_requests": 100, "val_requests": 200}]
    meta = {"date": "d", "machine": "m", "command": "c"}
    every = fhb.markdown(results, meta)
    one = fhb.markdown(results, meta, [0.01])
    for md in (every, one):
        assert "| a | 0.01 | image>image (5, 0.98) | 0.9700 |" in md and "| a | 0.05 | image>image (5, 0.98) |" in md
    assert "TABLE 0.01" in every and "TABLE 0.05" in every
    assert "TABLE 0.01" in one and "TABLE 0.05" not in one and "a, budget 0.05, measured on test" not in one


def test_a_kept_budget_result_is_keyed_by_the_features_it_was_computed_from(tmp_path, monkeypatch):
    """benchmarks/false_hit_budget.py keeps each export's result for an interrupted run to resume: one made from
    data/features was served for another --features-dir (and a part cut short by a kill stopped the run)."""
    import argparse
    import types

    from ushash.serving.calibration import CalibrationSettings

    fhb = _load("false_hit_budget", "benchmarks/false_hit_budget.py")
    calls = []
    monkeypatch.setattr(fhb, "load_export", lambda export: types.SimpleNamespace(revision="r1"))
    monkeypatch.setattr(fhb, "run", lambda head, features_dir, *a: calls.append(str(features_dir)) or
                        {"made_from": str(features_dir)})
    s = CalibrationSettings()

    def args(features):
        return argparse.Namespace(budgets=[0.01], requests=10, test_requests=10, out=str(tmp_path), features_dir=features)

    assert fhb.resumed("exports/x", args(ROOT / "data" / "features"), s)["made_from"].endswith("features")
    assert fhb.resumed("exports/x", args(ROOT / "data" / "features"), s) and len(calls) == 1   # kept
    assert fhb.resumed("exports/x", args(tmp_path / "other"), s) == {"made_from": str(tmp_path / "other")}
    assert len(calls) == 2 and "data/features" not in (tmp_path / "part-x.json").read_text()   # computed again
    (tmp_path / "part-x.json").write_text('{"key": {"revis')            # a part cut short by a kill
    assert fhb.resumed("exports/x", args(tmp_path / "other"), s) and len(calls) == 3   # is computed again
    import json

    key = json.loads((tmp_path / "part-x.json").read_text())["key"]
    assert key["features_dir"] == str((tmp_path / "other").resolve())
    fhb.resumed("exports/x", args(ROOT / "data" / "features"), s)        # the repository's: named relative to it
    assert json.loads((tmp_path / "part-x.json").read_text())["key"]["features_dir"] == "data/features"
