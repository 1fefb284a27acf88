"""Replay settings the schema's types accept but that would measure nothing, or not what the report says,
are refused before anything is loaded, with a line naming the field."""

import pytest

import ushash.sim  # noqa: F401  (registers the schema)
from ushash.config import compose
from ushash.sim.replay import run_cachesim


@pytest.mark.parametrize("override,field", [
    ("methods=[exact,ushash_only]", "methods"),            # a typo: silently not run
    ("methods=[exact,ushash_codes_only]", "ushash_codes_only"),  # silently skipped without ushash
    ("stream.revision_change_at=1.5", "stream.revision_change_at"),  # never happens, yet reported as "at 150%"
    ("stream.revision_change_at=-0.2", "stream.revision_change_at"),
    ("stream.n_requests=0", "stream.n_requests"),
    ("stream.seconds_per_request=0", "stream.seconds_per_request"),  # a stopped clock: TTLs never act
    ("stream.zipf_s=-1", "stream.zipf_s"),
    ("cosine_threshold=1.5", "cosine_threshold"),
    ("split=train", "split=train: the heads were trained on it"),  # flattering hit rates, reported as a replay
    ("split=tset", "split=tset: unknown split"),
    ("cache.calibration=cal.json", "cache.calibration: the replay sweeps"),   # every swept point the same one
    ("methods=[]", "methods is empty"),                     # an empty report
    ("sweep.thresholds=[1.5,-3]", "sweep.thresholds"),     # cosines that cannot be, swept as if they were
    ("sweep.payload_thresholds=[2.0]", "sweep.payload_thresholds"),  # was refused as cache.payload_threshold
    ("sweep.radii=[-2]", "sweep.radii"),                   # was refused as cache.radius
    ("variants.perturb=-1", "variants.perturb"),           # no variants, reported as "-1 copies"
    ("stream.revision_change_at=0.00001", "stream.revision_change_at"),  # before the first request: no change
])
def test_meaningless_replay_settings_are_refused(override, field):
    cfg = compose("cachesim", ["export=nowhere", override])
    with pytest.raises(ValueError, match=field):
        run_cachesim(cfg)


def test_the_report_header_says_when_there_is_no_revision_change_and_no_ttl():
    """It said "revision change at 0% of the stream" and "TTL 0 s" / "TTL None s", where 0 and None mean none."""
    from ushash.sim.report import markdown

    info = {"stream": {"n_requests": 100, "zipf_s": 1.0, "revision_change_at": 0.0, "seconds_per_request": 1.0},
            "classes": 5, "dataset": "d", "split": "test", "pool": 10, "pool_kinds": {}, "variants": "v",
            "cache": {"ttl_s": 0.0}}
    for ttl in (0.0, None):
        head = markdown({**info, "cache": {"ttl_s": ttl}}, []).splitlines()[0]
        assert "no revision change, no TTL (entries never expire) at 1.0 s/request" in head
        assert "0%" not in head and "TTL 0" not in head and "None" not in head
    head = markdown({**info, "stream": {**info["stream"], "revision_change_at": 0.5}, "cache": {"ttl_s": 7200.0}},
                    []).splitlines()[0]
    assert "revision change at 50% of the stream, TTL 7200 s at 1.0 s/request" in head   # as before
