"""Learn-then-Test with a split calibration stream (`path: split`) and the bound in other units: each new
statistic against a naive reference (the item split, the radius sweeps, the choice of path, the per-item and
per-distinct-pair counts, and the test half's evidence being the test half's alone)."""

import numpy as np
import pytest

from ushash.serving.cache.lsh import LSHHead
from ushash.serving.calibration import Calibration, CalibrationSettings, PairPoint, clopper_pearson_upper, min_trials
from ushash.sim.calibrate import calibrate, choose_path, measure, radius_sweeps, split_stream, unit_counts
from ushash.sim.pool import Pool, feature_key
from ushash.sim.stream import make_stream

from conftest import clustered_pool


@pytest.fixture
def head():
    return LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)


def _pool(rng, n_classes=40, members=3, spread=0.25, confusable=0.1):
    return clustered_pool(rng, n_classes, members, spread, confusable)


def _text_pool(rng, **kw):
    """The text members of `_pool(rng, **kw)` alone (one modality: one pair)."""
    p, q = _pool(rng, **kw), Pool()
    for i, m in enumerate(p.modality):
        if m == "text":
            q.add("text", p.features[i], p.cls[i], p.kind[i], p.key[i])
    return q


def test_the_item_split_is_disjoint_seeded_and_balanced_by_popularity():
    rng = np.random.default_rng(0)
    pool = _pool(rng)
    stream = make_stream(pool, 4000, 1.0, 0)
    learn = split_stream(pool, stream, "item", 0.5, 0)
    cls = np.asarray(pool.cls)[stream]
    a, b = set(cls[learn].tolist()), set(cls[~learn].tolist())
    assert not a & b and a | b == set(cls.tolist())                    # no item in both halves
    assert abs(len(a) - len(b)) <= 2
    assert (split_stream(pool, stream, "item", 0.5, 0) == learn).all()  # seeded
    assert not (split_stream(pool, stream, "item", 0.5, 1) == learn).all()
    # naive reference of the stratification: the items by request count, most first, dealt in pairs; each
    # pair has one item in each half, so the two most requested items are never in the same half
    items, n = np.unique(cls, return_counts=True)
    ranked = items[np.lexsort((items, -n))].tolist()
    for i in range(0, len(ranked) - 1, 2):
        assert (ranked[i] in a) != (ranked[i + 1] in a)
    # items with a rare modality are dealt among themselves: each half gets half of the audio items
    pool2 = _pool(np.random.default_rng(1))
    for c in range(0, 40, 5):                 # 8 of the 40 items also have audio
        pool2.add("audio", np.ones(24, np.float32) * c, c, "original", feature_key("audio", np.ones(24) * c))
    s2 = make_stream(pool2, 4000, 1.0, 0)
    learn2 = split_stream(pool2, s2, "item", 0.5, 0)
    cls2 = np.asarray(pool2.cls)[s2]
    audio = {c for c in range(0, 40, 5) if c in set(cls2.tolist())}
    assert len(audio & set(cls2[learn2].tolist())) == len(audio) // 2
    # a Zipf stream's halves carry comparable shares of the requests (a plain item split would not)
    assert 0.3 < learn.mean() < 0.7
    by_req = split_stream(pool, stream, "request", 0.25, 0)
    assert by_req.sum() == 1000


def test_radius_sweeps_hold_the_threshold_and_respect_the_repeat_floor():
    radii, thresholds = np.arange(4), np.round(1.0 - np.arange(51) * 0.01, 6)
    sweeps = radius_sweeps(radii, thresholds, (0.99, 0.98, 0.95), floor=0.985)
    # naive reference: min(t, floor) put on the grid at or below it, duplicates dropped, radius 0..3 each
    want = []
    for t in (0.99, 0.98, 0.95):
        g = max(x for x in thresholds if x <= min(t, 0.985) + 1e-9)
        if g not in [w[0][1] for w in want]:
            want.append([(r, float(g)) for r in range(4)])
    assert sweeps == want
    assert [s[0][1] for s in sweeps] == [0.98, 0.95]
    assert radius_sweeps(radii, thresholds, (0.99,), floor=None) == [[(r, 0.99) for r in range(4)]]


def test_a_looser_path_is_chosen_only_for_a_testable_gain():
    need = min_trials(0.01, 0.05)
    assert choose_path([("tight", 1000, need), ("mid", 1000 + need - 1, need), ("hits", 1000 + need - 1, need)]) == "tight"
    assert choose_path([("tight", 1000, need), ("mid", 1000 + need, need), ("hits", 1100 + need, need)]) == "mid"
    assert choose_path([("tight", None, need), ("mid", 50, need), ("hits", 40, need)]) == "mid"
    assert choose_path([("tight", None, need), ("hits", None, need)]) is None
    # prefer: loose gives the sweeps need 0 (the most hits, ties to the looser) and the hits path min_trials
    assert choose_path([("tight", 1000, 0), ("mid", 1000, 0), ("hits", 1000 + need - 1, need)]) == "mid"
    assert choose_path([("tight", 1000, 0), ("mid", 1001, 0), ("hits", 1001 + need, need)]) == "hits"
    assert choose_path([("tight", 1000, 0), ("mid", 999, 0), ("hits", 1000, need)]) == "tight"


def test_prefer_loose_keeps_the_walks_last_passing_point():
    """Where a looser point serves the same hits, `prefer: tight` stays at the tighter one and `loose` takes
    the last point of the walk that passed; the reference is each walk's own replay counts, step by step."""
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    pool = _text_pool(np.random.default_rng(0), n_classes=60, spread=0.05, confusable=0.0)   # tight clusters: ties
    stream = make_stream(pool, 3000, 0.5, 0)
    got = {}
    for prefer in ("tight", "loose"):
        s = CalibrationSettings(max_radius=6, threshold_step=0.05, path_points=8, path="hits", prefer=prefer)
        cal = calibrate(head, pool, stream, 0.05, s)
        p = cal.pairs["text>text"]
        assert p.on, cal.table()
        steps = [r["text>text"] for r in cal.info["replays"] if not r.get("settle") and "text>text" in r]
        # naive reference: walk the replays; a step passes while its bound holds and the hits it adds are false
        # at most at the target rate; tight moves only on more hits, loose also on as many
        need, at = min_trials(0.05, 0.05), None
        for r, t, n, k in steps:
            if n >= need and clopper_pearson_upper(k, n, 0.05) > 0.05:
                break
            if at is not None and n >= need:
                dn, dk = n - at[2], k - at[3]
                if dn < 0 or (dn == 0 and prefer == "tight"):
                    continue
                if dk > 0.05 * dn:
                    break
            if n >= need:
                at = (r, t, n, k)
        assert (p.radius, p.threshold) == (at[0], at[1])
        got[prefer] = (p.radius, p.threshold, p.hits)
    assert got["loose"][:2] != got["tight"][:2]        # the walk met a tie: the two rules part there
    assert got["loose"][2] >= got["tight"][2]


def test_the_bound_in_items_and_distinct_pairs():
    """A captured item (its first request served another item's entry) is mis-served on every repeat: 4 false
    hits, 1 false item, 1 false distinct (request, entry) pair; the reference counts by hand."""
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    rng = np.random.default_rng(3)
    x = rng.normal(size=24).astype(np.float32)
    y = x + 0.01 * rng.normal(size=24).astype(np.float32)     # another item, another input, almost x
    pool = Pool()
    pool.add("text", x, 0, "original", feature_key("text", x))
    pool.add("text", y, 1, "original", feature_key("text", y))
    stream = np.array([0, 1, 1, 0, 1, 1, 0])
    cal = Calibration(head.revision, 0.01, 0.95, {"text>text": PairPoint(True, 64, 0.0)})
    pr = measure(head, pool, stream, calibration=cal)["pairs"]["text>text"]
    assert (pr["hits"], pr["false_hits"]) == (6, 4)
    assert (pr["distinct"], pr["distinct_false"]) == (2, 1)      # (0, entry 0) and (1, entry 0)
    assert (pr["items"], pr["items_false"]) == (2, 1)
    assert pr["items_upper"] == pytest.approx(clopper_pearson_upper(1, 2, 0.05))
    assert unit_counts(pr, "items")["hits"] == 2 and unit_counts(pr, "items")["upper"] == pr["items_upper"]
    assert unit_counts(pr, "distinct")["false_hits"] == 1 and unit_counts(pr, "hits") == pr


def test_split_calibration_reports_the_test_halfs_evidence_alone():
    # one modality: one pair, so its counts do not depend on where other pairs were during the walk
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    rng = np.random.default_rng(0)

    val, test = _text_pool(rng, n_classes=80), _text_pool(rng, n_classes=80)
    s = CalibrationSettings(max_radius=8, threshold_step=0.02, path_points=6, path="split",
                            tight_thresholds=(0.98, 0.9))
    stream = make_stream(val, 4000, 0.5, 0)
    cal = calibrate(head, val, stream, 0.05, s)
    info = cal.info
    assert info["path_requests"] + info["test_requests"] == 4000
    p = cal.pairs["text>text"]
    assert p.on, cal.table()
    assert info["path_choice"]["text>text"]["path"] in ("hits", "sweep0", "sweep1")
    # naive reference: the test half replayed alone through a cache at the chosen point gives the reported
    # counts (the path half never entered them), and they are not the whole stream's
    learn = split_stream(val, stream, "item", 0.5, 0)
    res = measure(head, val, stream[~learn], calibration=cal)["pairs"]["text>text"]
    assert (res["hits"], res["false_hits"]) == (p.hits, p.false_hits)
    assert p.units["items"][:2] == [res["items"], res["items_false"]]
    assert p.units["distinct"][:2] == [res["distinct"], res["distinct_false"]]
    assert p.upper == pytest.approx(clopper_pearson_upper(p.false_hits, p.hits, 0.05)) and p.upper <= 0.05
    assert measure(head, val, stream, calibration=cal)["pairs"]["text>text"]["hits"] > p.hits
    held = measure(head, test, make_stream(test, 3000, 0.5, 1), calibration=cal)
    assert held["false_per_hit"] <= 0.05 and held["hits"] > 0
    assert "items: false / n (upper)" in cal.table()


def test_a_calibration_in_distinct_pairs_says_so():
    """Under count: distinct a point's hits are distinct (request, entry) pairs: its table, its file and the
    unit it reports name them so, and a calibration in hits reads as before."""
    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    point = PairPoint(True, 3, 0.9, hits=40, false_hits=0, upper=0.072)
    cal = Calibration(head.revision, 0.1, 0.95, {"text>text": point},
                      {"settings": {"count": "distinct"}})
    assert cal.unit == "distinct"
    assert "| distinct (request, entry) pairs | false distinct (request, entry) pairs |" in cal.table()
    assert cal.to_dict()["rate"].startswith("false distinct (request, entry) pairs / distinct")
    plain = Calibration(head.revision, 0.1, 0.95, {"text>text": point})
    assert plain.unit == "hits" and "| hits | false hits | rate |" in plain.table()
    assert plain.to_dict()["rate"] == "false hits / hits of the pair, on the calibration stream"
    assert Calibration.from_dict(cal.to_dict()).unit == "distinct"


def test_settings_refuse_unknown_paths_and_units():
    with pytest.raises(ValueError, match="path"):
        CalibrationSettings(path="best")
    with pytest.raises(ValueError, match="count"):
        CalibrationSettings(count="requests")
    with pytest.raises(ValueError, match="split_frac"):
        CalibrationSettings(split_frac=1.0)


def test_an_untested_pair_is_off_with_the_hits_of_its_own_path():
    """The test half's path was chosen on the path half; where none of its points has min_trials hits the
    reason quoted the most hits anywhere on the grid (1000 at looser points) instead of the path's 50."""
    from ushash.sim.calibrate import _path, offline_paths

    radii, thr = np.arange(3), _path(CalibrationSettings())
    n = np.zeros((3, len(thr)), np.int64)
    n[:, thr <= 0.9] = 1000
    n[:, thr == 0.99] = 50
    chosen = [(0, 0.99), (1, 0.99), (2, 0.99)]
    _, points = offline_paths({"text>text": (n, np.zeros_like(n))}, lambda k, n_: chosen, radii, thr, 0.05, 0.01, 299)
    assert points["text>text"].reason == "at most 50 hits at the points of its path on the calibration stream, 299 needed"
    _, points = offline_paths({"text>text": (n * 0 + 66, np.zeros_like(n))}, lambda k, n_: [], radii, thr, 0.05,
                              0.01, 299)   # no path at all (no grid point had enough): the grid's most, as before
    assert points["text>text"].reason == "at most 66 hits on the calibration stream, 299 needed"
