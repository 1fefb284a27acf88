"""The request stream and the clock it runs on.

A request is a pool member: its class drawn from a Zipf law over a random ranking of the classes, then one
of the class's members uniformly. The replay advances a simulated clock by `seconds_per_request` per
request (so TTLs act) and deploys a new head revision at `revision_change_at` of the stream.
"""

from __future__ import annotations

import numpy as np


class SimClock:
    """The simulated time (seconds since the epoch): the caches under test read it, the replay sets it."""

    def __init__(self, t: float = 1.7e9):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make_stream(pool, n_requests: int, zipf_s: float = 1.0, seed: int = 0) -> np.ndarray:
    """Pool indices of the requests: class ~ Zipf(zipf_s) over a random ranking, member uniform."""
    if not len(pool):
        raise ValueError("make_stream: the pool is empty (no rows, or none whose media decoded): no request can be made")
    rng = np.random.default_rng(seed)
    cls = np.asarray(pool.cls)
    classes = np.unique(cls)
    members = {c: np.flatnonzero(cls == c) for c in classes}
    ranking = rng.permutation(classes)
    p = 1.0 / np.arange(1, len(ranking) + 1) ** float(zipf_s)
    p /= p.sum()
    picks = ranking[rng.choice(len(ranking), size=int(n_requests), p=p)]
    return np.array([members[c][rng.integers(len(members[c]))] for c in picks], np.int64)


def revision_change_index(n_requests: int, revision_change_at: float) -> int:
    """The request before which the new revision is deployed: revision_change_at x n for a fraction strictly
    between 0 and 1; -1 (never) otherwise."""
    at = revision_change_at
    return int(at * n_requests) if at and 0 < at < 1 else -1
