"""The false-hit budget: Clopper-Pearson bounds, fixed-sequence testing, per-pair operating points in the
cache, shadow checks that tighten a breached pair, and the calibration replay (ushash.sim.calibrate)."""

import math
import random

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead
from ushash.serving.calibration import (Calibration, CalibrationSettings, PairPoint, clopper_pearson_upper,
                                        fixed_sequence, min_trials)
from ushash.sim.calibrate import calibrate, headroom, measure
from ushash.sim.pool import Pool, feature_key
from ushash.sim.stream import make_stream

from conftest import clustered_pool


@pytest.fixture
def head():
    return LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=0)


def test_clopper_pearson_matches_the_closed_form_and_scipy():
    # k = 0: the bound solves (1 - p)^n = delta
    for n in (1, 10, 299, 5000):
        assert clopper_pearson_upper(0, n, 0.05) == pytest.approx(1 - 0.05 ** (1 / n), rel=1e-9)
    assert min_trials(0.01, 0.05) == 299
    assert clopper_pearson_upper(0, 299, 0.05) <= 0.01 < clopper_pearson_upper(0, 298, 0.05)
    assert clopper_pearson_upper(0, 0) == 1.0 and clopper_pearson_upper(5, 5) == 1.0
    # monotone in k, and above the point estimate
    ups = [clopper_pearson_upper(k, 1000, 0.05) for k in range(0, 30, 5)]
    assert ups == sorted(ups) and all(u > k / 1000 for u, k in zip(ups, range(0, 30, 5)))


def test_fixed_sequence_stops_at_the_first_failure():
    # the third point fails; the fourth would pass again but is never declared safe
    path = [(0, 0.99, 1000, 0), (1, 0.98, 2000, 2), (2, 0.97, 2000, 60), (3, 0.96, 100000, 10)]
    chosen, tested = fixed_sequence(path, 0.05, 0.01)
    assert (chosen.radius, chosen.threshold) == (1, 0.98)
    assert len(tested) == 3 and tested[-1].upper > 0.01


def _cal(head, pairs, target=0.01):
    return Calibration(head.revision, target, 0.95, pairs)


def test_the_cache_serves_by_per_pair_points_and_exports_them(head, tmp_path):
    rng = np.random.default_rng(0)
    z = rng.normal(size=32).astype(np.float32)
    z /= np.linalg.norm(z)
    code = np.arange(8, dtype=np.uint8)
    cal = _cal(head, {"image>image": PairPoint(True, 2, 0.9, 500, 1, 0.009),
                      "text>image": PairPoint(False, reason="bound 0.3 > 0.01"),
                      "text>text": PairPoint(True, 4, 0.99, 400, 0, 0.0075)})  # the tiers search 4 bits
    path = cal.save(tmp_path / "calibration.json")
    assert Calibration.load(path).pairs == cal.pairs
    cache = SemanticCache(head, {"calibration": str(path)})
    cache.store(cache.query_from_code("image", code, z), "img")
    near = code.copy()
    near[0] ^= 0b11  # 2 bits away
    assert cache.lookup(cache.query_from_code("image", near, z)).value == "img"
    far = code.copy()
    far[0] ^= 0b111  # 3 bits: beyond image>image's radius 2
    assert cache.lookup(cache.query_from_code("image", far, z)) is None
    assert cache.lookup(cache.query_from_code("text", code, z)) is None  # text>image is off
    m = cache.metrics
    assert m.value("cache_rejections_total", reason="pair_off") == 1
    assert m.value("cache_rejections_total", reason="pair_radius") == 1
    assert m.value("cache_pair_point", pair="image>image", param="threshold") == pytest.approx(0.9)
    assert m.value("cache_pair_on", pair="text>image") == 0.0
    assert m.value("cache_pair_calibrated_false_hit_rate", pair="image>image", stat="upper") == pytest.approx(0.009)
    assert m.value("cache_false_hit_target") == pytest.approx(0.01)
    assert m.value("cache_pair_hits_total", pair="image>image") == 1
    # a code without z: no payload can be checked, so the calibrated pair does not serve it (it was served on
    # the radius alone, where the bound, which counts checked hits, says nothing); with z the same code hits
    assert cache.lookup(cache.query_from_code("image", code)) is None
    assert m.value("cache_rejections_total", reason="pair_no_z") == 1
    assert cache.lookup_many([cache.query_from_code("image", code), cache.query_from_code("image", code, z)])[1].value \
        == "img"
    assert m.value("cache_rejections_total", reason="pair_no_z") == 2


def test_a_pair_is_found_by_name_before_the_tier_holds_the_request_modality(head):
    # the L1 holds text entries only: an image request's pair is still "image>text", not refused as unknown
    rng = np.random.default_rng(1)
    x = rng.normal(size=24).astype(np.float32)
    on = PairPoint(True, 8, 0.5, 500, 0, 0.006)
    cal = _cal(head, {p: on for p in ("image>image", "image>text", "text>image", "text>text")})
    cache = SemanticCache(head, {"capacity_bytes": 1 << 24}, calibration=cal)
    cache.put("text", None, "by text", features=x)
    assert cache.get("image", features=x).value == "by text"
    assert [h["response"] for h in cache.check(None, "image", features=x, num_results=3)] == ["by text"]
    q = cache.query("image", features=x)
    assert [h.value for h in cache.lookup_many([q, cache.query("text", features=x)])] == ["by text", "by text"]
    assert cache.metrics.value("cache_rejections_total", reason="pair_off") == 0


def test_a_calibration_of_another_head_is_refused(head):
    other = LSHHead({"image": 24, "text": 24}, bits=64, dim=32, aligned=True, seed=1)
    with pytest.raises(ValueError, match="recalibrate"):
        SemanticCache(other, {}, calibration=_cal(head, {}))


def test_a_calibration_without_a_revision_is_refused(head):
    """No head has an empty revision: a calibration naming none was accepted for every head."""
    with pytest.raises(ValueError, match="recalibrate"):
        SemanticCache(head, {}, calibration=Calibration("", 0.01, 0.95, {}))
    with pytest.raises(ValueError, match="revision must be"):
        Calibration.from_dict({**_cal(head, {}).to_dict(), "revision": ""})


@pytest.mark.parametrize("field,value", [("on", "false"), ("on", 0), ("radius", -1), ("radius", 2.5),
                                         ("radius", True), ("threshold", "0.9"), ("threshold", float("nan")),
                                         ("threshold", 1.5), ("hits", -3), ("upper", 2.0), ("reason", 7)])
def test_a_calibration_files_points_are_read_as_what_they_say(head, field, value):
    """A hand-edited file whose "on" is the string "false" turned its pair on (a true string): every field of
    a point is checked for its type and range when the file is read."""
    d = _cal(head, {"text>image": PairPoint(False, reason="cross-modal off")}).to_dict()
    d["pairs"]["text>image"][field] = value
    with pytest.raises(ValueError, match=f"calibration pair text>image: {field} must be"):
        Calibration.from_dict(d)
    ok = _cal(head, {"text>image": PairPoint(True, 3, 0.9, 400, 1, 0.012)}).to_dict()
    assert Calibration.from_dict(ok).pairs["text>image"] == PairPoint(True, 3, 0.9, 400, 1, 0.012)


def test_warm_up_loads_the_shadow_checks_bound_only_with_shadow_checks_on(head, monkeypatch):
    """The first bound loads scipy.stats (~0.6 s); warm_up pays it before serving where shadow checks will
    compute bounds (inside the monitor's lock), and not where none will."""
    from ushash.serving.cache import budget

    calls = []
    monkeypatch.setattr(budget, "clopper_pearson_upper", lambda *a: calls.append(a) or 1.0)
    SemanticCache(head, {"radius": 3}).warm_up()
    assert calls == []
    SemanticCache(head, {"radius": 3, "shadow": {"fraction": 0.1}}).warm_up()
    assert calls == [(0, 1)]


def test_shadow_checks_estimate_the_rate_and_tighten_a_breached_pair(head):
    x = np.ones(24, np.float32)
    cfg = {"shadow": {"fraction": 1.0, "min_checks": 5, "target_false_hit_rate": 0.05, "step": 0.01}}
    cache = SemanticCache(head, cfg, rng=random.Random(0))
    cache.put("text", None, "stale", features=x)
    calls = []
    for i in range(5):  # the model answers otherwise every time: every shadow check disagrees
        r = cache.get_or_compute("text", features=x, compute=lambda: calls.append(1) or f"fresh{len(calls)}")
        assert r.computed and r.verified is False and r.value == f"fresh{i + 1}"
        assert cache.get("text", features=x).value == r.value  # a disagreement stores the fresh answer
    assert len(calls) == 5
    m = cache.metrics
    assert m.value("cache_shadow_checks_total", pair="text>text", result="disagree") == 5
    assert m.value("cache_pair_point_changes_total", pair="text>text", action="tighten") == 1
    assert cache.budget.points["text>text"].threshold == pytest.approx(0.99)
    # an agreeing check counts as agree and leaves the point alone
    r = cache.get_or_compute("text", features=x, compute=lambda: "fresh5")
    assert r.verified is True
    est, up, n = cache.budget.monitor.estimate("text>text")
    assert n == 1 and est == 0.0 and up == pytest.approx(0.95)
    assert m.value("cache_shadow_false_hit_rate", pair="text>text", stat="upper") == pytest.approx(up)


def test_shadow_off_action_turns_the_pair_off(head):
    x = np.ones(24, np.float32)
    cache = SemanticCache(head, {"shadow": {"fraction": 1.0, "min_checks": 1, "target_false_hit_rate": 0.01,
                                            "action": "off"}}, rng=random.Random(0))
    cache.put("image", None, "old", features=x)
    r = cache.get_or_compute("text", features=x, compute=lambda: "new")
    assert r.hit.modality == "image" and r.verified is False
    assert not cache.budget.points["text>image"].on
    assert cache.metrics.value("cache_pair_on", pair="text>image") == 0.0
    assert cache.get("text", features=x) is not None  # text>text still serves the stored fresh answer
    assert cache.get("text", features=x).modality == "text"


def _pool(rng, n_classes=60, members=4, spread=0.25, confusable=0.0):
    return clustered_pool(rng, n_classes, members, spread, confusable)


def test_calibrate_keeps_the_budget_on_a_held_out_stream(head):
    rng = np.random.default_rng(0)
    val, test = _pool(rng, confusable=0.1), _pool(rng, confusable=0.1)
    settings = CalibrationSettings(max_radius=8, threshold_step=0.02, path_points=6)
    cal = calibrate(head, val, make_stream(val, 3000, 0.5, 0), 0.05, settings)
    on = [k for k, p in cal.pairs.items() if p.on]
    assert on, cal.table()
    for k, p in cal.pairs.items():
        assert (p.upper <= 0.05) if p.on else p.reason
    assert cal.info["min_trials"] == min_trials(0.05, 0.05)
    res = measure(head, test, make_stream(test, 3000, 0.5, 1), calibration=cal)
    assert res["false_per_hit"] <= 0.05 and res["hits"] > 0
    assert res["exact_hit_rate"] <= res["hit_rate"] <= res["oracle_hit_rate"]
    correct = (res["hits"] - res["false_hits"]) / res["requests"]   # a false hit captures no headroom
    assert math.isclose(res["headroom_captured"], (correct - res["exact_hit_rate"]) /
                        (res["oracle_hit_rate"] - res["exact_hit_rate"]))
    assert headroom(0.5, 0.5, 0.5) != headroom(0.5, 0.5, 0.5)   # nan: the oracle gains nothing
    # an impossible budget turns every pair off
    none = calibrate(head, val, make_stream(val, 500, 0.5, 0), 0.001, settings)
    assert not any(p.on for p in none.pairs.values())


def test_one_input_under_two_classes_is_not_a_false_hit(head):
    """A caption two items share is one input: serving one item's answer to it is no false hit (any cache,
    the exact-key one included, serves it); a near input of another class and source still is."""
    rng = np.random.default_rng(3)
    shared = rng.normal(size=24).astype(np.float32)
    other = shared + 0.01 * rng.normal(size=24).astype(np.float32)
    pool = Pool()
    pool.add("text", shared, 0, "original", feature_key("text", shared))
    pool.add("text", shared, 1, "original", feature_key("text", shared))       # the same caption, item 1
    pool.add("text", other, 2, "original", feature_key("text", other))         # near, another input
    assert list(pool.source_ids()) == [0, 0, 1]
    stream = np.array([0, 1, 1, 2, 0, 2])
    cal = _cal(head, {"text>text": PairPoint(True, 64, 0.0)})
    served = []
    res = measure(head, pool, stream, calibration=cal, served=served)
    assert res["hits"] == 5 and res["false_hits"] == 2          # request 2 served item 0's entry, twice
    assert served == [-1, 0, 0, 0, 0, 0]                        # the one entry, stored by the first request
    # the oracle counts by the same equivalence: the shared caption's second item has an equivalent earlier
    # request (it was counted by class only: an oracle below the exact-key rate, headroom nan or inflated)
    assert res["oracle_hit_rate"] == pytest.approx(4 / 6) and res["exact_hit_rate"] == pytest.approx(4 / 6)
    for short, exact, oracle in (([0, 1], 0.5, 0.5), ([1, 0, 2], 1 / 3, 1 / 3)):
        got = measure(head, pool, np.array(short))
        assert (got["exact_hit_rate"], got["oracle_hit_rate"]) == pytest.approx((exact, oracle))
    from ushash.sim.calibrate import encode_pool, offline_counts, payload_cosines
    enc = encode_pool(head, pool)
    n, bad = offline_counts(enc, payload_cosines(head, enc), stream, np.array([0.0]), np.array([64]))["text>text"]
    # offline every earlier distinct request is an entry: the second request 2 finds itself
    assert (int(n[0, 0]), int(bad[0, 0])) == (5, 1)


def test_offline_counts_serve_the_entry_seen_first_among_equals(head):
    """Two rows of one shared caption (two items) are equal candidates for a near request: same code, same
    cosine. The offline count broke that tie by pool row and counted a false hit where the cache, which
    serves the entry stored first, serves the request's own item."""
    from ushash.sim.calibrate import encode_pool, offline_counts, payload_cosines

    rng = np.random.default_rng(0)
    x = rng.normal(size=24).astype(np.float32)
    y = x + 1e-3 * rng.normal(size=24).astype(np.float32)
    pool = Pool()
    pool.add("text", x, 1, "original", feature_key("text", x))   # row 0: the caption under item 1
    pool.add("text", x, 0, "original", feature_key("text", x))   # row 1: the same caption under item 0
    pool.add("text", y, 0, "original", feature_key("text", y))   # row 2: a near copy, item 0
    stream = np.array([1, 0, 2])                                   # item 0's row first
    enc = encode_pool(head, pool)
    cos = payload_cosines(head, enc)
    assert (enc.codes[0] == enc.codes[1]).all() and cos[2, 0] == cos[2, 1]   # the tie
    served = []
    res = measure(head, pool, stream, served=served, cache_cfg={"radius": 3, "payload_threshold": 0.98})
    assert served == [-1, 1, 1] and (res["hits"], res["false_hits"]) == (2, 0)   # the cache: row 1, stored first
    n, bad = offline_counts(enc, cos, stream, np.array([0.98]), np.array([3]))["text>text"]
    assert (int(n[0, 0]), int(bad[0, 0])) == (2, 0)
    n, bad = offline_counts(enc, cos, np.array([0, 1, 2]), np.array([0.98]), np.array([3]))["text>text"]
    assert (int(n[0, 0]), int(bad[0, 0])) == (2, 1)               # item 1's row first: request 2 is served it


def test_the_reported_evidence_is_of_the_points_deployed_together(head):
    """A pair's evidence was counted in the walk round where it last passed, while other pairs were still at
    other points: text>image reported 192 hits and a bound of 0.0155 <= 0.02, where the final points replayed
    on the same stream gave it 129 hits (fewer than min_trials) and a bound of 0.023. Every pair on now has
    the counts of the final points replayed together, within the budget, or is off."""
    pool = clustered_pool(np.random.default_rng(4), 60, 3, 0.35, 0.5)
    stream = make_stream(pool, 2000, 0.8, 4)
    s = CalibrationSettings(max_radius=12, threshold_step=0.02, threshold_min=0.5, path_points=8, path="hits",
                            marginal=False)
    cal = calibrate(head, pool, stream, 0.02, s)
    res = measure(head, pool, stream, calibration=cal)["pairs"]
    on = {k: p for k, p in cal.pairs.items() if p.on}
    assert on and any(not p.on and "with every pair at its final point" in p.reason for p in cal.pairs.values())
    for k, p in on.items():
        assert (p.hits, p.false_hits) == (res[k]["hits"], res[k]["false_hits"])
        assert p.upper == pytest.approx(res[k]["upper"]) and p.upper <= 0.02 and p.hits >= min_trials(0.02)
    assert cal.info["replays"][-1]["settle"] is True


def test_a_replay_can_be_timed_and_its_cache_kept(head):
    """measure's timings= gets one lookup time per request and one store time per miss, and cache= replays
    through the caller's cache (replay_cache's, kept afterwards to be weighed): the same counts either way."""
    from ushash.sim.calibrate import replay_cache

    pool = clustered_pool(np.random.default_rng(5), 20, 3, 0.25, 0.1)
    stream = make_stream(pool, 300, 0.8, 2)
    cal = _cal(head, {"image>image": PairPoint(True, 3, 0.9), "text>text": PairPoint(True, 3, 0.9)})
    plain = measure(head, pool, stream, calibration=cal)
    timings, cache = {}, replay_cache(head, cal)
    kept = measure(head, pool, stream, calibration=cal, timings=timings, cache=cache)
    assert kept == plain and 0 < plain["hits"] < len(stream)
    assert len(timings["lookup"]) == len(stream) and all(t > 0 for t in timings["lookup"])
    assert len(timings["store"]) == len(stream) - plain["hits"] == len(cache)


def test_variants_share_their_originals_source():
    from ushash.sim.pool import pool_from_split

    class T:
        def __init__(self, x, groups):
            self.x, self.groups = x, groups

    class S:
        tables = {"text": T(np.eye(3, 8, dtype=np.float32), ["a", "b", "c"])}

    pool = pool_from_split(S(), perturb=2, seed=0)
    assert list(pool.source_ids()) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len(set(pool.key)) == 9
