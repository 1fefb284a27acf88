"""The hit check: which of a tier's candidates within the radius may be served, and which one.

Candidates come nearest first, ties by the tier's id (L1 slot, L2 entry id). A candidate is refused when
it is of another revision (`cache_rejections_total{reason="revision"}`), expired (`expired`), of another
modality with `cross_modal: false`, or, with `payload_check`, when its decoded payload has cosine <
`payload_threshold` with the request's z (`payload`). Of the rest the nearest is served; ties by higher
cosine, then candidate order.

One vectorised step for a whole batch of queries (`select`): the candidates of every query as flat
columns, the payloads of those that pass the cheap checks decoded and scored in one call per modality,
and the winner of each query picked by one sort. `choose` is `select` for one query's `Candidates` list
(the L2's).

The cosine is the payload codec's (ushash.serving.payload.scoring.scores): unchecked for the L1's own
records, checked for records read from a shared L2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ushash.serving.cache.entries import Candidates
from ushash.serving.cache.request import Query


@dataclass
class Batch:
    """The candidates of B queries as flat columns, query i's at [lims[i], lims[i + 1]), each query's in
    serving order (nearest first, then the tier's id)."""
    lims: np.ndarray        # int64 [B + 1]
    dists: np.ndarray       # int [M]
    modality: np.ndarray    # int [M], index into `modalities`
    current: np.ndarray     # bool [M]: of the revision served
    expires: np.ndarray     # float64 [M]
    has_payload: np.ndarray  # bool [M]: the entry has a payload record
    records: Callable[[np.ndarray, str], np.ndarray]   # (candidate indices, modality) -> uint8 [k, nbytes]


class HitCheck:
    def __init__(self, payload_codec, payload_check: bool, payload_threshold: float, cross_modal: bool, metrics):
        self.codec = payload_codec
        self.payload_check = bool(payload_check)
        self.threshold = float(payload_threshold)
        self.cross_modal = bool(cross_modal)
        self.metrics = metrics

    def select(self, qz: np.ndarray | None, has_z: np.ndarray, qmod: np.ndarray, modalities: list[str], c: Batch,
               now: float, trusted: bool) -> tuple[np.ndarray, np.ndarray]:
        """(chosen int64 [B]: index into the batch's candidates or -1; cosine float32 [B], NaN where the
        payload was not checked). qz float32 [B, dim] unit rows (rows without z ignored), has_z bool [B],
        qmod int [B] (index into `modalities`). trusted: the payload records were written by this process
        (the unchecked decoding path is safe)."""
        b, m = len(c.lims) - 1, len(c.dists)
        chosen = np.full(b, -1, np.int64)
        cos = np.full(m, np.nan, np.float32)
        if m == 0:
            return chosen, np.full(b, np.nan, np.float32)
        qid = np.repeat(np.arange(b), np.diff(c.lims))
        keep = c.current & (c.expires > now)
        n_rev = m - int(c.current.sum())
        n_exp = int(c.current.sum()) - int(keep.sum())
        if n_rev:
            self.metrics.rejections.labels(reason="revision").inc(n_rev)
        if n_exp:
            self.metrics.rejections.labels(reason="expired").inc(n_exp)
        if not self.cross_modal:
            keep &= c.modality == qmod[qid]
        if self.payload_check and self.codec is not None and qz is not None:
            checking = keep & has_z[qid]
            if checking.any():
                good = checking & c.has_payload   # an entry without a payload cannot pass the check
                for mi in np.unique(c.modality[good]).tolist():
                    idx = np.flatnonzero(good & (c.modality == mi))
                    name = modalities[mi]
                    cos[idx] = self.codec.scores(name, qz[qid[idx]], c.records(idx, name), checked=not trusted)
                passed = checking & (cos.astype(np.float64) >= self.threshold)
                n_bad = int(checking.sum()) - int(passed.sum())
                if n_bad:
                    self.metrics.rejections.labels(reason="payload").inc(n_bad)
                keep = (keep & ~checking) | passed
        ok = np.flatnonzero(keep)
        if len(ok):
            # per query: nearest, then higher cosine (unchecked candidates: 0 for all), then candidate order
            neg = -np.nan_to_num(cos[ok], nan=0.0).astype(np.float64) + 0.0
            order = ok[np.lexsort((ok, neg, c.dists[ok], qid[ok]))]
            first = np.unique(qid[order], return_index=True)
            chosen[first[0]] = order[first[1]]
        out = np.full(b, np.nan, np.float32)
        hit = chosen >= 0
        out[hit] = cos[chosen[hit]]
        return chosen, out

    def choose(self, q: Query, c: Candidates, revision: str, now: float,
               trusted: bool) -> tuple[int, int, float | None] | None:
        """(index into c, distance, cosine or None) of the candidate to serve, or None: `select` for one
        query."""
        n = len(c)
        mods = sorted(set(c.modalities) | {q.modality})
        mid = {m: i for i, m in enumerate(mods)}
        payloads = c.payloads

        def records(idx, modality):
            return np.frombuffer(b"".join(payloads[i] for i in idx.tolist()), np.uint8).reshape(len(idx), -1)

        batch = Batch(lims=np.array([0, n], np.int64), dists=np.asarray(c.dists, np.int64),
                      modality=np.array([mid[m] for m in c.modalities], np.int64).reshape(n),
                      current=np.array([r == revision for r in c.revisions], bool).reshape(n),
                      expires=np.asarray(c.expires, np.float64).reshape(n),
                      has_payload=np.array([len(p) > 0 for p in payloads], bool).reshape(n), records=records)
        qz = None if q.z is None else q.z[None]
        chosen, cos = self.select(qz, np.array([q.z is not None]), np.array([mid[q.modality]]), mods, batch, now,
                                  trusted)
        i = int(chosen[0])
        if i < 0:
            return None
        return i, int(c.dists[i]), None if np.isnan(cos[0]) else float(cos[0])
