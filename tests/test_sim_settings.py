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
])
def test_meaningless_replay_settings_are_refused(override, field):
    cfg = compose("cachesim", ["export=nowhere", override])
    with pytest.raises(ValueError, match=field):
        run_cachesim(cfg)
