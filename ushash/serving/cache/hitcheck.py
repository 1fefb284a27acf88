"""The hit check: which of a tier's candidates within the radius may be served, and which one.

Candidates come nearest first, ties by the tier's id (L1 slot, L2 entry id). A candidate is refused when
it is of another revision (`cache_rejections_total{reason="revision"}`), expired (`expired`), of another
modality with `cross_modal: false`, or, with `payload_check`, when its decoded payload has cosine <
`payload_threshold` with the request's z (`payload`). Of the rest the nearest is served; ties by higher
cosine, then candidate order.

One vectorised step for a whole batch of queries (`select`): the candidates of every query as flat
columns, the cheap checks in one compiled pass (numba), the payloads of those that pass decoded and
scored in one call per modality, and the winner of each query picked in a second compiled pass. `choose` is `select` for one query's `Candidates` list
(the L2's).

With per-pair operating points (`points`, a {"request>entry": PairPoint} mapping from
ushash.serving.cache.budget, read on every lookup so a shadow breach acts at once) the modality pair of a
candidate decides instead of `cross_modal`: it is refused when its pair is off (`pair_off`) or beyond the
pair's radius (`pair_radius`), and the pair's threshold replaces `payload_threshold`; a request without z
(a code alone) is served by no pair (`pair_no_z`), since no payload can be checked for it. `rank` keeps the
best k candidates of one query instead of one (check / store's top-k).

The cosine is the payload codec's (ushash.serving.payload.scoring.scores): unchecked for the L1's own
records, checked for records read from a shared L2.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
from ushash.core.jit import njit

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


# candidate status, per query and candidate (_triage)
_REVISION, _EXPIRED, _MODALITY, _SERVABLE, _CHECK, _NO_PAYLOAD = range(6)


@njit(cache=True, nogil=True)
def _triage(lims, current, expires, modality, qmod, has_z, has_payload, now, cross_modal, check):
    """Status of every candidate (the cheap checks), and the revision / expired refusal counts."""
    status = np.empty(len(current), np.int8)
    n_rev = n_exp = 0
    for qi in range(len(lims) - 1):
        for j in range(lims[qi], lims[qi + 1]):
            if not current[j]:
                status[j] = _REVISION
                n_rev += 1
            elif expires[j] <= now:
                status[j] = _EXPIRED
                n_exp += 1
            elif not cross_modal and modality[j] != qmod[qi]:
                status[j] = _MODALITY
            elif check and has_z[qi]:
                status[j] = _CHECK if has_payload[j] else _NO_PAYLOAD
            else:
                status[j] = _SERVABLE
    return status, n_rev, n_exp


@njit(cache=True, nogil=True)
def _pick(lims, dists, status, cos, thr):
    """Per query: the nearest servable candidate (checked ones need cosine >= threshold), ties by higher
    cosine, then candidate order. Returns (chosen [B] or -1, its cosine or NaN, payload refusals)."""
    b = len(lims) - 1
    chosen = np.full(b, -1, np.int64)
    out = np.full(b, np.nan, np.float32)
    n_bad = 0
    for qi in range(b):
        best, bd, bc = -1, 0, np.float32(0.0)
        for j in range(lims[qi], lims[qi + 1]):
            s = status[j]
            if s == _CHECK:
                if not np.float64(cos[j]) >= thr[j]:   # NaN (a corrupt record) fails too
                    n_bad += 1
                    continue
                cj = cos[j]
            elif s == _NO_PAYLOAD:
                n_bad += 1
                continue
            elif s == _SERVABLE:
                cj = np.float32(0.0)
            else:
                continue
            if best < 0 or dists[j] < bd or (dists[j] == bd and cj > bc):
                best, bd, bc = j, dists[j], cj
        chosen[qi] = best
        if best >= 0 and status[best] == _CHECK:
            out[qi] = cos[best]
    return chosen, out, n_bad


class _Uncounted:
    """Metrics that count nothing (`HitCheck.uncounted`): `rejections.labels(...).inc(...)` does nothing."""

    @property
    def rejections(self):
        return self

    def labels(self, **_):
        return self

    def inc(self, *_):
        pass


class HitCheck:
    def __init__(self, payload_codec, payload_check: bool, payload_threshold: float, cross_modal: bool, metrics,
                 points=None):
        self.points = points      # None: one radius (the tier's), threshold and cross_modal for every pair
        self.codec = payload_codec
        self.payload_check = bool(payload_check)
        self.threshold = float(payload_threshold)
        self.cross_modal = bool(cross_modal)
        self.metrics = metrics

    def uncounted(self) -> "HitCheck":
        """This check, counting no rejection: for a choice made again among candidates it has counted once."""
        quiet = copy.copy(self)
        quiet.metrics = _Uncounted()
        return quiet

    def _score(self, qz, has_z, qmod, modalities, c: "Batch", now: float, trusted: bool):
        """(status [M], cosine [M], threshold [M]) of every candidate: the cheap checks, the pairs' points,
        the payload cosines."""
        b, m = len(c.lims) - 1, len(c.dists)
        check = self.payload_check and self.codec is not None and qz is not None
        points = self.points
        status, n_rev, n_exp = _triage(c.lims, c.current, c.expires, c.modality, qmod, has_z, c.has_payload, float(now),
                                       self.cross_modal or points is not None, check)
        if n_rev:
            self.metrics.rejections.labels(reason="revision").inc(n_rev)
        if n_exp:
            self.metrics.rejections.labels(reason="expired").inc(n_exp)
        qid = np.zeros(m, np.int64) if b == 1 else np.repeat(np.arange(b), c.lims[1:] - c.lims[:-1])
        thr = np.full(m, self.threshold, np.float64)
        if points is not None:
            live = status >= _SERVABLE
            qm = np.asarray(qmod)[qid]
            n_off = n_far = 0
            for a in sorted(set(qm[live].tolist())):
                for e in sorted(set(c.modality[live & (qm == a)].tolist())):
                    sel = live & (qm == a) & (c.modality == e)
                    name = modalities[a] + ">" + modalities[e]
                    p = points.get(name)
                    if p is None or not p.on:
                        status[sel] = _MODALITY
                        n_off += int(sel.sum())
                        continue
                    far = sel & (np.asarray(c.dists) > int(p.radius))
                    status[far] = _MODALITY
                    n_far += int(far.sum())
                    thr[sel] = float(p.threshold)
            # a calibrated point's bound counts hits whose payload was checked: a request without z (a code
            # alone) cannot be, so no pair serves it (it was served on the radius alone, outside the budget).
            # Checking payloads, a candidate still _SERVABLE is one of a request without z
            no_z = status == _SERVABLE if self.payload_check and self.codec is not None else np.zeros(m, bool)
            status[no_z] = _MODALITY
            if n_off:
                self.metrics.rejections.labels(reason="pair_off").inc(n_off)
            if n_far:
                self.metrics.rejections.labels(reason="pair_radius").inc(n_far)
            if no_z.any():
                self.metrics.rejections.labels(reason="pair_no_z").inc(int(no_z.sum()))
        cos = np.zeros(m, np.float32)
        if check:
            idx = np.flatnonzero(status == _CHECK)
            if len(idx):
                present = c.modality[idx]
                groups = [(int(present[0]), idx)] if present.min() == present.max() else \
                    [(mi, idx[present == mi]) for mi in sorted(set(present.tolist()))]
                for mi, ix in groups:
                    name = modalities[mi]
                    # one row of z per candidate, a batch of one included: the same arithmetic, the same cosines
                    cos[ix] = self.codec.scores(name, qz[qid[ix]], c.records(ix, name), checked=not trusted)
        return status, cos, thr

    def select(self, qz: np.ndarray | None, has_z: np.ndarray, qmod: np.ndarray, modalities: list[str], c: "Batch",
               now: float, trusted: bool) -> tuple[np.ndarray, np.ndarray]:
        """(chosen int64 [B]: index into the batch's candidates or -1; cosine float32 [B], NaN where the
        payload was not checked). qz float32 [B, dim] unit rows (rows without z ignored), has_z bool [B],
        qmod int [B] (index into `modalities`). trusted: the payload records were written by this process
        (the unchecked decoding path is safe)."""
        b, m = len(c.lims) - 1, len(c.dists)
        if m == 0:
            return np.full(b, -1, np.int64), np.full(b, np.nan, np.float32)
        status, cos, thr = self._score(qz, has_z, qmod, modalities, c, now, trusted)
        chosen, out, n_bad = _pick(c.lims, c.dists, status, cos, thr)
        if n_bad:
            self.metrics.rejections.labels(reason="payload").inc(n_bad)
        return chosen, out

    def select_top(self, qz, has_z, qmod, modalities, c: "Batch", now: float, trusted: bool,
                   k: int) -> list[tuple[int, float | None]]:
        """The best k servable candidates of a batch of ONE query, best first: (index, cosine or None)."""
        if len(c.dists) == 0:
            return []
        status, cos, thr = self._score(qz, has_z, qmod, modalities, c, now, trusted)
        ok, n_bad = [], 0
        for j in range(len(c.dists)):
            st = status[j]
            if st == _CHECK:
                if not float(cos[j]) >= thr[j]:   # NaN (a corrupt record) fails too
                    n_bad += 1
                    continue
                ok.append((int(c.dists[j]), -float(cos[j]), j, float(cos[j])))
            elif st == _NO_PAYLOAD:
                n_bad += 1
            elif st == _SERVABLE:
                ok.append((int(c.dists[j]), 0.0, j, None))
        if n_bad:
            self.metrics.rejections.labels(reason="payload").inc(n_bad)
        ok.sort()
        return [(j, cs) for _, _, j, cs in ok[:int(k)]]

    def _batch_of(self, q: Query, c: Candidates, revision: str):
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
        return qz, np.array([q.z is not None]), np.array([mid[q.modality]]), mods, batch

    def choose(self, q: Query, c: Candidates, revision: str, now: float,
               trusted: bool) -> tuple[int, int, float | None] | None:
        """(index into c, distance, cosine or None) of the candidate to serve, or None: `select` for one
        query."""
        qz, has_z, qmod, mods, batch = self._batch_of(q, c, revision)
        chosen, cos = self.select(qz, has_z, qmod, mods, batch, now, trusted)
        i = int(chosen[0])
        if i < 0:
            return None
        return i, int(c.dists[i]), None if np.isnan(cos[0]) else float(cos[0])

    def rank(self, q: Query, c: Candidates, revision: str, now: float, trusted: bool,
             k: int = 1) -> list[tuple[int, int, float | None]]:
        """Up to k servable candidates of c, best first, as (index into c, distance, cosine or None)."""
        if k <= 1:
            best = self.choose(q, c, revision, now, trusted)
            return [best] if best is not None else []
        qz, has_z, qmod, mods, batch = self._batch_of(q, c, revision)
        return [(j, int(c.dists[j]), cs) for j, cs in self.select_top(qz, has_z, qmod, mods, batch, now, trusted, k)]
