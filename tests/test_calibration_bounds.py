"""min_trials is the exact count clopper_pearson_upper gives (no float rounding off by one), and the
calibration's confidence is range-checked like the shadow checks'."""

import pytest

from ushash.serving.calibration import CalibrationSettings, ShadowConfig, clopper_pearson_upper, min_trials


def _fewest(target, delta):
    n = 0
    while clopper_pearson_upper(0, n, delta) > target:
        n += 1
    return n


def test_min_trials_is_the_fewest_trials_whose_bound_meets_the_target():
    assert min_trials(0.999, 0.001) == 1            # ln(0.001) / ln(0.001) rounds to just above 1
    assert clopper_pearson_upper(0, 1, 0.001) <= 0.999
    for target in (0.5, 0.25, 0.1, 0.05, 0.01, 0.001, 0.999, 1 - 1 / 1024):
        for delta in (0.5, 0.25, 0.1, 0.05, 0.01, 0.001, 1 / 16, 1 / 1024):
            assert min_trials(target, delta) == _fewest(target, delta), (target, delta)
    for target, delta in ((0.0, 0.05), (1.0, 0.05), (0.01, 0.0), (0.01, 1.0)):
        with pytest.raises(ValueError, match="min_trials needs 0 < target < 1 and 0 < delta < 1"):
            min_trials(target, delta)


@pytest.mark.parametrize("confidence", [0.0, 1.0, -0.5, 1.5])
def test_calibration_confidence_must_be_in_the_open_unit_interval(confidence):
    with pytest.raises(ValueError, match=r"calibration confidence must be in \(0, 1\)"):
        CalibrationSettings(confidence=confidence)
    with pytest.raises(ValueError, match=r"shadow.confidence must be in \(0, 1\)"):
        ShadowConfig(confidence=confidence)
    assert CalibrationSettings(confidence=0.9).confidence == 0.9


@pytest.mark.parametrize("k, n, delta", [(-1, 5, 0.05), (6, 5, 0.05), (0, -1, 0.05), (1, 10, 0.0), (1, 10, 1.0),
                                         (1, 10, -0.1), (1, 10, float("nan"))])
def test_clopper_pearson_upper_refuses_counts_and_levels_that_cannot_be(k, n, delta):
    # k > n used to be bounded at 1.0 and delta 0 or 1 at 1.0 / 0.0: a caller's swapped counts read as "no evidence"
    with pytest.raises(ValueError, match="clopper_pearson_upper needs"):
        clopper_pearson_upper(k, n, delta)


def test_clopper_pearson_upper_edges_stay():
    assert clopper_pearson_upper(0, 0) == 1.0 and clopper_pearson_upper(7, 7) == 1.0
    assert 0.0 < clopper_pearson_upper(0, 10) < 1.0


def test_a_breach_at_min_checks_is_acted_on_whichever_way_the_check_went():
    from ushash.serving.calibration import ShadowMonitor

    # 4 disagreements, then an agreement as the 5th (min_checks) check: the bound (upper(4, 5)) is far over
    # the target, so the 5th check acts; it used to wait for the next disagreement, however far away
    m = ShadowMonitor(ShadowConfig(fraction=1.0, min_checks=5, target_false_hit_rate=0.05), None)
    assert [m.record("text>text", False) for _ in range(4)] == [None] * 4
    assert m.record("text>text", True) == "tighten"
    # no false hit seen, no breach (5 checks cannot bound the rate under 0.05, but nothing was wrong); past
    # min_checks an agreement only lowers the bound: it never acts, a disagreement over the target does
    m = ShadowMonitor(ShadowConfig(fraction=1.0, min_checks=5, target_false_hit_rate=0.05), None)
    assert [m.record("text>text", True) for _ in range(30)] == [None] * 30
    acts = [m.record("text>text", False) for _ in range(10)]
    assert "tighten" in acts and acts.index("tighten") == next(
        i for i in range(10) if clopper_pearson_upper(i + 1, 31 + i, 0.05) > 0.05)


@pytest.mark.parametrize("kw, field", [(dict(threshold_step=0.0), "threshold_step"),
                                       (dict(threshold_step=-0.01), "threshold_step"),
                                       (dict(threshold_min=0.9, threshold_max=0.8), "threshold_min"),
                                       (dict(threshold_max=1.5), "threshold_max"),
                                       (dict(threshold_min=-1.5), "threshold_min"),
                                       (dict(max_radius=-1), "max_radius"), (dict(path_points=0), "path_points")])
def test_calibration_grid_settings_that_cannot_make_a_grid_are_refused(kw, field):
    # they crashed with ZeroDivisionError or numpy's "zero-size array", or (path_points 0) turned every pair
    # off as if the stream had too few hits
    with pytest.raises(ValueError, match=f"^calibration .*{field}") as e:
        CalibrationSettings(**kw)
    assert "\n" not in str(e.value)


def test_the_threshold_grid_never_goes_below_threshold_min():
    from ushash.sim.calibrate import _path

    grid = _path(CalibrationSettings(threshold_step=0.03))   # 0.5 / 0.03 is not whole: it ended at 0.49
    assert grid[0] == 1.0 and grid.min() >= 0.5 and grid.min() == pytest.approx(0.52)
    default = _path(CalibrationSettings())                     # a step that divides the range: unchanged
    assert len(default) == 51 and default[0] == 1.0 and default[-1] == 0.5
    assert list(_path(CalibrationSettings(threshold_step=0.02, threshold_min=0.9))) == [1.0, 0.98, 0.96, 0.94, 0.92, 0.9]
