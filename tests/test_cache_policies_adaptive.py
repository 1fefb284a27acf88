"""Adaptive TTL (serving/cache/adaptive.py), QoS admission (qos.py), hot keys (hotkeys.py), and their
experiments against the fixed alternatives (ushash/sim/policies.py): values checked by hand."""

import math

import pytest

from ushash.serving.cache.adaptive import (AdaptiveTTL, RollingP99, adaptive_ttl, lat_factor, mem_factor,
                                           memory_percent)
from ushash.serving.cache.hotkeys import HotKeys, hotness_freshness, sigmoid
from ushash.serving.cache.qos import QoSAdmission, QoSLRU


def test_the_design_rule_exactly():
    assert mem_factor(75) == pytest.approx(1.0) and mem_factor(85) == pytest.approx(0.8)
    assert mem_factor(100) == pytest.approx(0.5) and mem_factor(120) == pytest.approx(0.3)   # floor 0.3
    assert mem_factor(50) == pytest.approx(1.5)                                                # as written
    assert lat_factor(80) == 1.0 and lat_factor(350) == pytest.approx(0.5) and lat_factor(700) == pytest.approx(0.2)
    assert adaptive_ttl(600, 80, 200) == pytest.approx(600 * 0.9 * 0.8)                       # 432 s
    assert adaptive_ttl(600, 84.9, 100) == pytest.approx(600 * (1 - 0.02 * 9.9))              # 481.2 s
    assert adaptive_ttl(600, 85, 100) == 60.0                                                 # cap at >= 85 %
    assert adaptive_ttl(30, 90, 100) == pytest.approx(30 * 0.7)                               # under the cap
    assert adaptive_ttl(600, 50, 0, max_factor=1.0) == 600.0


def test_adaptive_ttl_policy_reads_its_sources_at_most_every_refresh_s():
    now, reads = [0.0], []
    mem = [70.0]

    def memory():
        reads.append(now[0])
        return mem[0]

    pol = AdaptiveTTL(100.0, memory=memory, p99=lambda: 100.0, refresh_s=1.0, clock=lambda: now[0])
    assert pol.ttl() == pytest.approx(110.0)
    mem[0] = 90.0
    now[0] = 0.5
    assert pol.ttl() == pytest.approx(110.0) and len(reads) == 1
    now[0] = 1.0
    assert pol.ttl() == pytest.approx(60.0) and pol.last == (90.0, 100.0)


def test_rolling_p99_and_memory_percent():
    r = RollingP99(window_s=10.0, clock=lambda: 0.0)
    for i in range(1, 101):
        r.record(i / 1000.0, now=float(i) / 100)
    assert r.p99_ms(now=1.0) == pytest.approx(99.0)   # the 99th of 1..100 ms (index round(0.99 * 99) = 98)
    assert r.p99_ms(now=20.0) == 0.0                  # all older than the window
    assert 0.0 < memory_percent("cpu") < 100.0
    assert 0.0 < memory_percent("cpu", limit_bytes=1 << 50) < memory_percent("cpu")


def test_qos_admission_weights_shrink_for_low_classes_as_load_rises():
    q = QoSAdmission({"pay": "critical", "rep": "batch"}, onset=0.7)
    for t in ("pay", "rep", "other"):
        assert q.probability(t, 0.5) == 1.0
    assert q.probability("pay", 1.0) == 1.0
    assert q.probability("other", 1.0) == pytest.approx(0.5)        # default class normal, floor 0.5
    assert q.probability("rep", 1.0) == pytest.approx(0.05)
    assert q.probability("rep", 0.85) == pytest.approx(1 - 0.95 * 0.5)
    assert q.probability("other", 0.85) == pytest.approx(0.75)
    with pytest.raises(ValueError):
        QoSAdmission({"x": "gold"})


def test_qos_lru_never_lets_a_lower_class_evict_a_higher_one():
    q = QoSAdmission({"pay": "critical", "rep": "batch", "web": "normal"}, weights={"batch": 1.0, "normal": 1.0})
    c = QoSLRU(3, q)
    c.put("pay", 1, "a")
    c.put("pay", 2, "b")
    c.put("rep", 1, "x")
    assert c.put("rep", 2, "y")                 # evicts the batch entry, not the critical ones
    assert c.get("rep", 1) is None and c.get("pay", 1) == "a" and c.get("pay", 2) == "b"
    assert c.put("web", 1, "w")                 # normal evicts batch
    assert c.get("rep", 2) is None
    assert not c.put("rep", 3, "z")             # only higher classes left: the batch newcomer is refused
    assert c.put("pay", 3, "c")                 # critical evicts the lowest class present (normal)
    assert c.get("web", 1) is None and len(c) == 3 and c.refused == 1 and c.evicted == 3
    plain = QoSLRU(2)
    plain.put("pay", 1, "a")
    plain.put("rep", 1, "x")
    plain.put("rep", 2, "y")                    # plain LRU: the batch scan pushes the critical entry out
    assert plain.get("pay", 1) is None


def test_hot_keys_sliding_window_counts_top_and_share():
    h = HotKeys(window_s=10.0, buckets=5, max_keys=100)
    for i in range(10):
        h.record("a", now=0.5)
    for i in range(5):
        h.record("b", now=3.0)
    h.record("c", now=9.0)
    assert h.counts(now=9.5) == {"a": 10, "b": 5, "c": 1}
    assert h.top(2, now=9.5) == [("a", 10), ("b", 5)]
    assert h.share(1, now=9.5) == pytest.approx(10 / 16)
    # the bucket of t in [0, 2) leaves the window at t = 10
    assert h.counts(now=10.0) == {"b": 5, "c": 1} and h.count("a", now=10.0) == 0
    # hotness: ln(count / mean count of the window's keys)
    assert h.hotness("b", now=10.0) == pytest.approx(math.log(5 / 3))
    assert h.hotness("zz", now=10.0) == -math.inf
    s = h.score("b", age_s=60.0, alpha=0.7, tau_s=120.0, now=10.0)
    assert s == pytest.approx(0.7 / (1 + math.exp(-math.log(5 / 3))) + 0.3 * math.exp(-0.5))
    assert h.score("zz", age_s=0.0, alpha=0.7, now=10.0) == pytest.approx(0.3)


def test_hot_keys_space_saving_bounds_memory():
    h = HotKeys(window_s=10.0, buckets=1, max_keys=2)
    for k, n in (("a", 5), ("b", 2), ("c", 1)):
        h.record(k, n, now=1.0)
    # "c" took the smallest counter's place (b: 2) and inherited it: 2 + 1
    assert h.counts(now=1.0) == {"a": 5, "c": 3}


def test_hotness_freshness_score_by_hand():
    assert sigmoid(0.0) == 0.5 and sigmoid(-800.0) == 0.0
    assert hotness_freshness(0.0, 0.0, alpha=0.5) == pytest.approx(1.0 * 0.5 * 0.5 + 0.5)
    assert hotness_freshness(2.0, 300.0, alpha=0.4, tau_s=300.0) == pytest.approx(
        0.4 / (1 + math.exp(-2)) + 0.6 * math.exp(-1))


def test_adaptive_ttl_against_fixed_on_the_memory_pressure_stream():
    from ushash.sim.policies import run_adaptive_ttl

    res = run_adaptive_ttl()   # the documented stream: 900 s, about 2 s
    fixed, safe, ada = res["runs"]["fixed 600 s"], res["runs"]["fixed 60 s"], res["runs"]["adaptive"]
    assert fixed["seconds_over_100"] > 0                        # the long fixed TTL runs out of memory
    assert ada["seconds_over_100"] == 0 and ada["peak_memory_percent"] < fixed["peak_memory_percent"]
    assert safe["hit_rate"] < ada["hit_rate"] < fixed["hit_rate"]  # the short fixed TTL loses hits all the time
    assert min(res["runs"]["adaptive"]["timeline"]["ttl_s"][300:600]) <= 60.0


def test_qos_admission_keeps_the_critical_tenant_hot_under_a_batch_flood():
    from ushash.sim.policies import run_qos

    res = run_qos({"duration_s": 240.0, "flood_from_s": 60.0, "flood_to_s": 180.0, "flood_rate": 300.0,
                   "normal_keys": 5000})
    plain, qos = res["runs"]["plain LRU (admit all)"], res["runs"]["QoS admission"]
    assert plain["payments"]["during"] < plain["payments"]["before"] - 0.1   # the flood flushes payments
    assert qos["payments"]["during"] >= qos["payments"]["before"] - 0.01
    assert qos["payments"]["during"] > plain["payments"]["during"] + 0.2
    assert qos["refused"] > 0


def test_the_cache_stores_with_its_adaptive_ttl_policy():
    import numpy as np

    from ushash.serving.cache import SemanticCache
    from ushash.serving.cache.lsh import LSHHead

    head = LSHHead({"text": 24}, bits=64, dim=32, aligned=True, seed=0)
    cache = SemanticCache(head, {"payload_check": False, "ttl_s": 600, "ttl_jitter": 0.0, "adaptive_ttl": True},
                          clock=lambda: 1000.0)
    assert cache.ttl_policy is not None and cache.ttl_policy.base_s == 600.0
    cache.ttl_policy.memory, cache.ttl_policy.p99 = (lambda: 90.0), (lambda: 100.0)
    f = np.random.default_rng(0).normal(size=(2, 24)).astype(np.float32)
    cache.put("text", features=f[0], value="a")
    assert cache.get("text", features=f[0]).expires == 1000.0 + 60.0     # >= 85 % memory: at most 60 s
    cache.put("text", features=f[1], value="b", ttl_s=30)                 # an explicit ttl_s wins
    assert cache.get("text", features=f[1]).expires == 1000.0 + 30.0
    res = cache.get_or_compute("text", features=-f[0], compute=lambda: "c")
    assert res.computed and len(cache.compute_p99._q) == 1               # the computations' p99 is measured
    assert SemanticCache(head, {"ttl_s": 600}).ttl_policy is None        # off by default
