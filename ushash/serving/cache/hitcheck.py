"""The hit check: which of a tier's candidates within the radius may be served, and which one.

Candidates come nearest first (`ushash.serving.cache.entries.Candidates`, from L1 or the L2 alike). A
candidate is refused when it is of another revision (`cache_rejections_total{reason="revision"}`), expired
(`expired`), of another modality with `cross_modal: false`, or, with `payload_check`, when its decoded
payload has cosine < `payload_threshold` with the request's z (`payload`). Of the rest the nearest is
served; ties by higher cosine, then lower candidate id.

The cosine is the payload codec's (ushash.serving.payload.scoring.scores): unchecked for the L1's own
records, checked for records read from a shared L2.
"""

from __future__ import annotations

import numpy as np

from ushash.serving.cache.entries import Candidates
from ushash.serving.cache.request import Query


class HitCheck:
    def __init__(self, payload_codec, payload_check: bool, payload_threshold: float, cross_modal: bool, metrics):
        self.codec = payload_codec
        self.payload_check = bool(payload_check)
        self.threshold = float(payload_threshold)
        self.cross_modal = bool(cross_modal)
        self.metrics = metrics

    def choose(self, q: Query, c: Candidates, revision: str, now: float,
               trusted: bool) -> tuple[int, int, float | None] | None:
        """(index into c, distance, cosine or None) of the candidate to serve, or None. trusted: the
        payload records were written by this process (the unchecked decoding path is safe)."""
        keep, n_rev, n_exp = [], 0, 0
        for i in range(len(c)):
            if c.revisions[i] != revision:
                n_rev += 1
            elif c.expires[i] <= now:
                n_exp += 1
            elif self.cross_modal or c.modalities[i] == q.modality:
                keep.append(i)
        if n_rev:
            self.metrics.rejections.labels(reason="revision").inc(n_rev)
        if n_exp:
            self.metrics.rejections.labels(reason="expired").inc(n_exp)
        if not keep:
            return None
        if not self.payload_check or q.z is None or self.codec is None:
            i = keep[0]
            return i, c.dists[i], None
        by_mod: dict[str, list[int]] = {}
        for i in keep:
            by_mod.setdefault(c.modalities[i], []).append(i)
        best, n_bad = None, 0
        for m, idx in by_mod.items():
            recs = np.frombuffer(b"".join(c.payloads[i] for i in idx), np.uint8).reshape(len(idx), -1)
            cos = self.codec.scores(m, q.z, recs, checked=not trusted)
            for i, cs in zip(idx, cos.tolist()):
                if cs >= self.threshold:
                    key = (c.dists[i], -cs, c.ids[i])
                    if best is None or key < best[0]:
                        best = (key, i)
                else:
                    n_bad += 1
        if n_bad:
            self.metrics.rejections.labels(reason="payload").inc(n_bad)
        if best is None:
            return None
        (d, neg_cos, _), i = best
        return i, d, -neg_cos
