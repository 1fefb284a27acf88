"""The failure scenarios (ushash/sim/failures.py) and their pieces: arrivals, the service model, the
compute breaker, the stale policy, the key filter. Simulated time, seeded, a few seconds in all."""

import math

import numpy as np
import pytest

from ushash.config import compose
from ushash.serving.cache.protection import ComputeBreaker, KeyFilter, StalePolicy
from ushash.sim.config import DefencesConfig, FailuresConfig
from ushash.sim.downstream import Downstream, EventLoop, arrivals
from ushash.sim.failures import DEFENCES, FailureSim, defences, run_scenario

SMALL = FailuresConfig(duration_s=40, trigger_s=15, flood_s=15, rate=400, n_keys=3000, workers=12, hot_ttl_s=15,
                       ttl_s=200)


def test_poisson_and_gpd_arrivals_have_the_asked_rate_and_shape():
    rng = np.random.default_rng(0)
    t = arrivals(1000.0, 0.0, 200.0, rng, "poisson")
    assert abs(len(t) / 200.0 - 1000.0) < 10 and np.all(np.diff(t) >= 0) and t[-1] < 200.0
    gaps = np.diff(arrivals(1000.0, 0.0, 400.0, np.random.default_rng(1), "gpd", 0.83))
    # GPD(shape xi, scale s): median s / xi * (2^xi - 1), s = (1 - xi) / rate
    median = (1 - 0.83) / 1000.0 / 0.83 * (2 ** 0.83 - 1)
    assert np.median(gaps) == pytest.approx(median, rel=0.02)
    # heavy tail: P(gap > x) = (1 + xi x / s)^(-1/xi)
    x = 10 / 1000.0
    assert np.mean(gaps > x) == pytest.approx((1 + 0.83 * x / ((1 - 0.83) / 1000.0)) ** (-1 / 0.83), rel=0.05)
    with pytest.raises(ValueError):
        arrivals(1.0, 0.0, 1.0, rng, "gpd", 1.2)


def test_downstream_queues_behind_its_workers_and_refuses_beyond_the_queue():
    loop = EventLoop()
    ds = Downstream(loop, workers=1, queue_limit=1, sigma=0.0)
    done = []
    for i in range(3):
        ds.submit(1.0, lambda ok, i=i: done.append((i, ok, loop.now)))
    assert ds.in_flight == 2 and ds.peak == 2
    loop.run()
    # call 2 refused at once; 0 and 1 served one after the other (sigma 0: service = the median)
    assert done == [(2, False, 0.0), (0, True, 1.0), (1, True, 2.0)]
    ds.finish_accounting()
    assert ds.calls == 3 and ds.refused == 1 and ds.over_s == pytest.approx(1.0)  # 2 in flight for 1 s of 2


def test_the_peak_per_second_counts_the_calls_carried_over_from_earlier_seconds():
    loop = EventLoop()
    ds = Downstream(loop, workers=8, queue_limit=10, sigma=0.0)
    for _ in range(5):
        ds.submit(3.0, lambda ok: None)  # in service from 0 s to exactly 3 s: no submission in seconds 1 and 2
    loop.at(3.5, ds.submit, 1.0, lambda ok: None)
    loop.run()
    assert [ds.peak_per_bin.get(b, 0) for b in range(5)] == [5, 5, 5, 1, 1] and ds.peak == 5


def test_compute_breaker_opens_half_opens_on_the_callers_clock_and_closes():
    now = [0.0]
    b = ComputeBreaker(fail_max=3, reset_s=2.0, clock=lambda: now[0])
    for _ in range(3):
        assert b.allow()
        b.record(False)
    assert b.state == "open" and b.opens == 1 and not b.allow()
    now[0] = 1.9
    assert not b.allow()
    now[0] = 2.0
    assert b.allow() and b.state == "half-open"
    assert not b.allow()             # one trial call at a time
    b.record(False)                  # the trial failed: open again, for another reset_s
    assert b.state == "open" and b.opens == 2 and not b.allow()
    now[0] = 4.0
    assert b.allow()
    b.record(True)
    assert b.state == "closed" and b.allow() and b.rejected == 4


def test_stale_policy_windows_and_refresh_budget():
    p = StalePolicy(swr_s=10, swr_max_inflight=3, stale_if_error_s=100)
    assert not p.serve_while_revalidating(now=99.0, expires=100.0)     # not expired: a plain hit
    assert p.serve_while_revalidating(100.0, 100.0) and p.serve_while_revalidating(109.9, 100.0)
    assert not p.serve_while_revalidating(110.0, 100.0)
    assert p.serve_on_error(199.0, 100.0) and not p.serve_on_error(200.0, 100.0)
    assert p.may_revalidate(in_flight=1) and p.may_revalidate(in_flight=1)
    assert not p.may_revalidate(in_flight=1)                           # 2 refreshes + 1 other = 3
    p.revalidated()
    assert p.may_revalidate(in_flight=0) and p.revalidating == 2
    off = StalePolicy()
    assert not off.serve_while_revalidating(100.0, 100.0) and not off.serve_on_error(100.0, 100.0)


def test_key_filter_has_no_false_negatives_and_about_its_false_positive_rate():
    kf = KeyFilter(10_000, 0.01)
    kf.update(range(10_000))
    assert all(k in kf for k in range(10_000))
    fp = np.mean([(1 << 40) + k in kf for k in range(20_000)])
    assert fp < 0.02


def test_defences_one_at_a_time():
    d = DefencesConfig()
    off = defences("off", d)
    assert not (off.single_flight or off.bloom or off.breaker) and off.ttl_jitter == off.xfetch_beta == 0
    assert off.swr_s == off.stale_if_error_s == 0
    for name in DEFENCES:
        one = defences(name, d)
        on = [one.single_flight, one.bloom, one.ttl_jitter > 0, one.xfetch_beta > 0, one.stale_if_error_s > 0,
              one.swr_s > 0, one.breaker]
        assert sum(on) == 1 and on[DEFENCES.index(name)]
    assert defences("defaults", d) is d
    with pytest.raises(ValueError):
        defences("nope", d)


@pytest.mark.parametrize("scenario", ["penetration", "breakdown", "avalanche"])
def test_each_scenario_fails_with_the_defences_off_and_holds_with_the_defaults(scenario):
    res = run_scenario(scenario, SMALL, configs=("off", "defaults"))
    off, dflt, steady = res["runs"]["off"], res["runs"]["defaults"], res["steady"]
    assert steady["peak_in_flight"] <= SMALL.workers
    # the failure: the service over its concurrency limit, queueing, p99 blown up, retries
    assert off["peak_in_flight"] > 2 * SMALL.workers and off["queueing_s"] > 1.0
    assert off["p99_vs_steady"] > 3 and off["retry_amplification"] > 1.0
    # the defaults: under the limit, p99 within 2x of the steady state, no errors
    assert dflt["peak_in_flight"] <= SMALL.workers and dflt["queueing_s"] == 0.0
    assert dflt["p99_vs_steady"] <= 2.0 and dflt["error_rate"] == 0.0


def test_single_flight_computes_a_herd_once():
    f = FailuresConfig(**{**SMALL.__dict__, "duration_s": 20.0})
    base = defences("off")
    herd = FailureSim("breakdown", f, base).run()
    one = FailureSim("breakdown", f, defences("single_flight")).run()
    assert one["downstream_calls"] < herd["downstream_calls"]
    assert one["peak_in_flight"] < herd["peak_in_flight"]


def test_a_run_is_reproducible_and_accounts_every_request():
    a = FailureSim("avalanche", SMALL, defences("defaults")).run()
    b = FailureSim("avalanche", SMALL, defences("defaults")).run()
    assert a["p99_ms"] == b["p99_ms"] and a["downstream_calls"] == b["downstream_calls"]
    assert a["answered"] == a["requests"]
    assert a["hit_rate"] + a["stale_ratio"] + a["error_rate"] <= 1.0 + 1e-12
    assert len(a["timeline"]["hit_rate"]) == math.ceil(SMALL.duration_s)


def test_the_cachesim_verb_runs_a_scenario_and_writes_table_and_plot(tmp_path):
    from ushash.sim.replay import run_cachesim

    cfg = compose("cachesim", [f"paths.root={tmp_path}", "scenario=breakdown", "failures.duration_s=20",
                               "failures.rate=200", "failures.n_keys=500", "failures.trigger_s=8",
                               "failures.hot_ttl_s=8", "failures.ttl_s=100"])
    res = run_cachesim(cfg)
    out = tmp_path / "experiments" / "cachesim"
    (folder,) = list(out.iterdir())
    assert folder.name.startswith("scenario-breakdown-")
    for ext in ("json", "md", "png"):
        assert (folder / f"breakdown.{ext}").stat().st_size > 0
    table = (folder / "breakdown.md").read_text()
    assert "all defences off" in table and "defaults (all on)" in table and "single-flight alone" in table
    assert set(res["results"]["breakdown"]["runs"]) == {"off", *DEFENCES, "defaults"}
    with pytest.raises(Exception):
        compose("cachesim", [f"paths.root={tmp_path}", "failures.workers=many"])


@pytest.mark.parametrize("scenario", ["qos", "adaptive_ttl"])
def test_a_policy_run_refuses_the_settings_it_does_not_take(tmp_path, scenario):
    """The policy runs are set in ushash/sim/policies.py: failures.seed=7 gave the same results as seed 0 in
    another folder. Such overrides are refused, before anything runs."""
    from ushash.sim.replay import run_cachesim

    for override in ("failures.seed=7", "defences.single_flight=false"):
        cfg = compose("cachesim", [f"paths.root={tmp_path}", f"scenario={scenario}", override])
        with pytest.raises(ValueError, match=f"scenario={scenario} takes no failures"):
            run_cachesim(cfg)
    assert not (tmp_path / "experiments").exists()


@pytest.mark.parametrize("override", [dict(rate=0.0), dict(duration_s=0.0), dict(n_keys=0), dict(hot_share=1.5),
                                      dict(hot_share=-0.1), dict(workers=0), dict(queue_limit=-1), dict(retries=-1),
                                      dict(zipf_s=-1.0)])
def test_meaningless_failure_settings_are_refused_in_one_line_naming_them(override):
    """They crashed deep in numpy (rate 0, duration 0, no keys, a hot share above 1) or ran silently (no workers)."""
    (name,) = override
    f = FailuresConfig(**{**SMALL.__dict__, **override})
    for scenario in ("penetration", "breakdown", "avalanche"):
        with pytest.raises(ValueError, match=f"^failures.{name} ") as e:
            FailureSim(scenario, f, defences("defaults")).run()
        assert "\n" not in str(e.value)


def test_a_flood_running_past_the_end_of_the_run_is_refused_before_anything_runs(tmp_path):
    """Its requests were simulated past duration_s and counted in the last second."""
    from ushash.sim.replay import run_cachesim

    f = FailuresConfig(**{**SMALL.__dict__, "trigger_s": 30.0})  # 30 + 15 s of flood > 40 s
    with pytest.raises(ValueError, match=r"^failures.trigger_s \+ failures.flood_s .* failures.duration_s"):
        FailureSim("penetration", f, defences("defaults")).run()
    FailureSim("avalanche", f, defences("defaults"))  # no flood there
    cfg = compose("cachesim", [f"paths.root={tmp_path}", "scenario=all", "failures.trigger_s=80"])
    with pytest.raises(ValueError, match="failures.flood_s"):
        run_cachesim(cfg)
    assert not (tmp_path / "experiments").exists()
