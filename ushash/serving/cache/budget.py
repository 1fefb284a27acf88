"""`PairBudget`: a cache's per-pair operating points, its shadow checks and their metrics.

The points come from a calibration (`ushash.serving.calibration.Calibration`, `cache.calibration`) or, when
there is none, from the cache's one `radius` / `payload_threshold` / `cross_modal` for every pair; the hit
check (hitcheck.py) serves by them. Shadow checks (`cache.shadow`) feed a `ShadowMonitor`; a breach
tightens a pair or turns it off, in place, for the next lookup.

Series (rendered at scrape time from plain counters, in the cache's registry):

    cache_pair_hits_total{pair}                           hits served, by request>entry modality pair
    cache_pair_on{pair}                                   1 while the pair may serve
    cache_pair_point{pair,param="radius|threshold"}       the operating point in force
    cache_pair_calibrated_false_hit_rate{pair,stat="rate|upper"}   the calibration's evidence for it
    cache_false_hit_target                                the budget (absent without one)
    cache_shadow_checks_total{pair,result="agree|disagree"}
    cache_shadow_false_hit_rate{pair,stat="estimate|upper"}   since the pair's point last changed
    cache_pair_point_changes_total{pair,action="tighten|off"}
"""

from __future__ import annotations

import logging
import threading

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ushash.serving.calibration import (Calibration, PairPoint, ShadowConfig, ShadowMonitor, clopper_pearson_upper,
                                        pair_name, uniform_points)

log = logging.getLogger(__name__)


class PairBudget:
    def __init__(self, config, registry=None):
        c = config
        self.config = c
        self.shadow_config = c.shadow if isinstance(c.shadow, ShadowConfig) else ShadowConfig(**dict(c.shadow or {}))
        self.hits: dict[str, int] = {}
        self._lock = threading.Lock()
        self.install((), None)
        if registry is not None:
            registry.register(_Collector(self))

    def install(self, modalities, calibration: Calibration | None) -> None:
        """The points of a (new) head: the calibration's, or the cache's uniform ones; shadow evidence and
        earlier breaches start over."""
        c = self.config
        self.modalities = tuple(modalities)
        self.calibration = calibration
        self.calibrated = calibration is not None
        if calibration is not None:
            self.points = {pair_name(a, b): calibration.point(a, b) for a in self.modalities for b in self.modalities}
            target = calibration.target_false_hit_rate
        else:
            self.points = uniform_points(self.modalities, c.radius, c.payload_threshold, c.cross_modal)
            target = None
        self.monitor = ShadowMonitor(self.shadow_config, target)

    def warm_up(self) -> None:
        """With shadow checks on, load what their bounds are computed with (scipy.stats: ~40 MB and ~0.6 s on its
        first use) now: else the first disagreement pays it inside the monitor's lock, which every shadow check
        takes, or the first scrape of the metrics does."""
        if float(self.shadow_config.fraction) > 0:
            clopper_pearson_upper(0, 1)

    @property
    def per_pair(self) -> bool:
        """The hit check must read the points (a calibration, or a pair changed by a shadow breach)."""
        return self.calibrated or bool(self.monitor.actions)

    @property
    def search_radius(self) -> int | None:
        """The radius the tiers must search for these points (None: the cache's own `radius`)."""
        return self.calibration.search_radius if self.calibration is not None else None

    def count_hits(self, pairs) -> None:
        """`count_hit` of each (request modality, entry modality), under one lock."""
        counts: dict[tuple, int] = {}
        for p in pairs:
            counts[p] = counts.get(p, 0) + 1
        with self._lock:
            for (a, b), n in counts.items():
                k = pair_name(a, b)
                self.hits[k] = self.hits.get(k, 0) + n

    def count_hit(self, request_modality: str, entry_modality: str) -> None:
        k = pair_name(request_modality, entry_modality)
        with self._lock:
            self.hits[k] = self.hits.get(k, 0) + 1

    def verify(self, request_modality: str, entry_modality: str, agreed: bool) -> PairPoint | None:
        """Record one shadow check; returns the pair's new point when a breach changed it. Without
        `payload_check` no threshold is checked, so a breach turns the pair off instead of raising it."""
        k = pair_name(request_modality, entry_modality)
        action = self.monitor.record(k, bool(agreed))
        if action is None:
            return None
        if action == "tighten" and not self.config.payload_check:
            action = "off"   # a higher threshold would change nothing served
        new = self.monitor.apply(self.points, k, action)
        log.warning("shadow checks of %s breached the false-hit budget %s: %s", k, self.monitor.target,
                    f"threshold now {new.threshold:.4f}" if new.on else "pair turned off")
        return new


class _Collector:
    def __init__(self, budget: PairBudget):
        self.b = budget

    def collect(self):
        b = self.b
        with b._lock:
            hits = dict(b.hits)
        points = dict(b.points)
        h = CounterMetricFamily("cache_pair_hits", "Hits served, by request>entry modality pair", labels=["pair"])
        for k in sorted(points):
            h.add_metric([k], hits.get(k, 0))
        yield h
        on = GaugeMetricFamily("cache_pair_on", "1 while the modality pair may serve hits", labels=["pair"])
        pt = GaugeMetricFamily("cache_pair_point", "Operating point in force", labels=["pair", "param"])
        for k, p in sorted(points.items()):
            on.add_metric([k], 1.0 if p.on else 0.0)
            pt.add_metric([k, "radius"], float(p.radius))
            pt.add_metric([k, "threshold"], float(p.threshold))
        yield on
        yield pt
        if b.calibration is not None:
            cal = GaugeMetricFamily("cache_pair_calibrated_false_hit_rate",
                                    "False-hit rate on the calibration stream (per hit, or per the calibration's "
                                    "count unit), and its upper bound",
                                    labels=["pair", "stat"])
            for k, p in sorted(b.calibration.pairs.items()):
                cal.add_metric([k, "rate"], p.rate)
                cal.add_metric([k, "upper"], p.upper)
            yield cal
        if b.monitor.target is not None:
            t = GaugeMetricFamily("cache_false_hit_target", "The false-hit budget (per hit)")
            t.add_metric([], float(b.monitor.target))
            yield t
        m = b.monitor
        checks = CounterMetricFamily("cache_shadow_checks", "Hits also computed and compared", labels=["pair", "result"])
        est = GaugeMetricFamily("cache_shadow_false_hit_rate", "Shadow-check false-hit rate since the point changed",
                                labels=["pair", "stat"])
        for k, (n, bad) in sorted(dict(m.total).items()):
            checks.add_metric([k, "agree"], n - bad)
            checks.add_metric([k, "disagree"], bad)
            e, u, _ = m.estimate(k)
            est.add_metric([k, "estimate"], e)
            est.add_metric([k, "upper"], u)
        yield checks
        yield est
        ch = CounterMetricFamily("cache_pair_point_changes", "Operating points changed by shadow checks",
                                 labels=["pair", "action"])
        for (k, a), n in sorted(dict(m.actions).items()):
            ch.add_metric([k, a], n)
        yield ch
