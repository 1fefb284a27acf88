"""The false-hit budget: per-pair operating points, their confidence bounds, and the online monitor.

A cache lookup pairs the request's modality with a cached entry's modality (`"text>image"`: a caption
served the answer an image stored). Each pair has its own operating point, a Hamming radius and a payload
cosine threshold, or is off. `Calibration` holds the points chosen for a false-hit budget
(`target_false_hit_rate`) on a labelled calibration stream (ushash.sim.calibrate replays a data set's val
split), with the one-sided upper confidence bound on each pair's false-hit rate, and is written beside the
export as `calibration.json` (python -m ushash.calibrate export=<export>); `cache.calibration=<that file>`
makes a `SemanticCache` serve by it.

Statistics (numpy / scipy only, no cache code):

    clopper_pearson_upper(k, n, delta)   one-sided (1 - delta) upper bound on a binomial rate, k of n
    fixed_sequence(path, delta, target)  fixed-sequence testing (Learn-then-Test, Angelopoulos et al. 2021):
                                         walk a path of points from the tightest to the loosest, testing
                                         H0 "rate > target" at each with the Clopper-Pearson bound at level
                                         delta, stop at the first that fails; the family-wise error of
                                         declaring any point safe is at most delta without a multiplicity
                                         correction, because the order is fixed before looking at the labels

The false-hit rate of a pair is per hit: false hits served by that pair / hits served by it. When every
pair meets the budget per hit, the whole cache does, per hit and per request.

`ShadowMonitor`: online, a fraction of hits is also computed (shadow compute) and compared with the
cached answer; per pair it keeps the estimate and its upper bound since the pair's point last changed, and
a bound above the target (after `min_checks` checks) tightens the pair's threshold by `step` or turns it
off (`ShadowConfig.action`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

MODALITIES = ("image", "text", "audio")
FORMAT = "ushash-calibration"
FORMAT_VERSION = 1


def pair_name(request_modality: str, entry_modality: str) -> str:
    """"text>image": a text request served from an image entry."""
    return f"{request_modality}>{entry_modality}"


def split_pair(name: str) -> tuple[str, str]:
    parts = str(name).split(">")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"a modality pair is written 'request>entry' (e.g. 'text>image'); got {name!r}")
    return parts[0], parts[1]


# ---------------------------------------------------------------------------------------------- statistics
def clopper_pearson_upper(k: int, n: int, delta: float = 0.05) -> float:
    """The one-sided (1 - delta) Clopper-Pearson upper bound on a binomial rate after k events in n trials:
    the p with P(X <= k | n, p) = delta (1.0 when k == n, and when n == 0). Counts that cannot come from
    n trials (k < 0, k > n) and a delta outside (0, 1) are refused, not bounded at 1 or 0."""
    k, n = int(k), int(n)
    if not 0 <= k <= n:
        raise ValueError(f"clopper_pearson_upper needs 0 <= k <= n events in n trials; got k={k}, n={n}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"clopper_pearson_upper needs 0 < delta < 1; got delta={delta}")
    if k == n:
        return 1.0
    from scipy.stats import beta

    return float(beta.ppf(1.0 - float(delta), k + 1, n - k))


def min_trials(target: float, delta: float = 0.05) -> int:
    """The fewest trials with no event whose upper bound (clopper_pearson_upper) is <= target: about
    ceil(ln delta / ln(1 - target)), moved to the exact count where float rounding put that ratio on the
    wrong side of a whole number."""
    if not (0.0 < float(target) < 1.0 and 0.0 < float(delta) < 1.0):
        raise ValueError(f"min_trials needs 0 < target < 1 and 0 < delta < 1; got target={target}, delta={delta}")
    n = int(math.ceil(math.log(delta) / math.log1p(-target)))
    while clopper_pearson_upper(0, n, delta) > target:
        n += 1
    while n > 0 and clopper_pearson_upper(0, n - 1, delta) <= target:
        n -= 1
    return n


@dataclass
class Tested:
    """One point of a path: its setting, how many hits it served on the calibration stream and how many
    of them were false, and the upper bound."""
    radius: int
    threshold: float
    hits: int
    false_hits: int
    upper: float

    @property
    def rate(self) -> float:
        return self.false_hits / self.hits if self.hits else 0.0


def fixed_sequence(path: Iterable[tuple[int, float, int, int]], delta: float, target: float) -> tuple[Optional[Tested], list[Tested]]:
    """Walk `path` ((radius, threshold, hits, false hits), tightest first) and return (the last point whose
    upper bound is <= target before the first that is not, or None; every point tested)."""
    chosen, tested = None, []
    for r, t, n, k in path:
        p = Tested(int(r), float(t), int(n), int(k), clopper_pearson_upper(k, n, delta))
        tested.append(p)
        if p.upper > target:
            break
        chosen = p
    return chosen, tested


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class CalibrationSettings:
    """How `ushash.sim.calibrate` chooses the operating points (the `calibration` block of python -m
    ushash.calibrate, configs/calibrate.yaml; its split= and requests= set `split` and `n_requests`)."""
    split: str = "val"                # the labelled calibration stream is replayed from this split
    confidence: float = 0.95          # one-sided: the bound holds with this probability
    max_radius: int = 10              # radii 0..max_radius are on the grid of operating points
    threshold_max: float = 1.0        # the path of payload thresholds runs from here (tightest) ...
    threshold_min: float = 0.5        # ... down to here (loosest) ...
    threshold_step: float = 0.01      # ... in these steps
    repeat_floor: bool = True         # same-modality pairs start at the lowest cosine an exact repeat reaches
                                      # through the payload codec on the calibration split: never stricter
    count: str = "hits"               # what the bound counts: every hit; "distinct" (request, served
                                      # entry) pairs, so a repeated request counts once; or "items": the
                                      # request items (classes) a pair served, an item with any false hit
                                      # one event (strictest: an item mis-served once is mis-served on every
                                      # repeat, so items, not hits, are the independent trials)
    marginal: bool = True             # a looser point is taken only when the hits it adds are false at
                                      # most at the target rate (ends the sequence earlier: never less safe);
                                      # off, a walk takes its last passing point under either `prefer`
    path_points: int = 16             # points tested per pair (replays of the calibration stream, at most)
    path: str = "split"               # "hits": one path per pair, the grid points ordered by hit counts (no
                                      # labels read), walked on the whole stream; "split": Learn-then-Test
                                      # with a split stream: on the path half each candidate path (the hits
                                      # path, and the radius sweeps at each of `tight_thresholds`) is walked,
                                      # the pair keeps the one that serves the most hits there (a looser one
                                      # only when it serves `min_trials` more), and the test half alone walks
                                      # it with fixed-sequence testing (the points and bounds reported)
    prefer: str = "tight"             # where the evidence does not decide: "tight" keeps the tighter point of
                                      # a walk when a looser one serves no more hits, and (path "split") the
                                      # tightest path unless a looser one serves `min_trials` more hits on the
                                      # path half; "loose" takes the walk's last passing point and, among
                                      # the radius sweeps, the one with the most hits there, ties to the
                                      # looser (the hits path, whose thresholds run far lower, still needs
                                      # `min_trials` more)
    split_by: str = "item"            # path "split": the halves hold disjoint items (classes), or "request"
    split_frac: float = 0.5           # share of the items (requests) in the path-choosing half
    split_seed: int = 0
    tight_thresholds: tuple = (0.99, 0.98, 0.97, 0.95)   # path "split": a radius sweep 0..max_radius per
                                      # threshold (same-modality pairs: no higher than the repeat floor)
    n_requests: Optional[int] = None  # calibration stream length; None: stream.n_requests

    def __post_init__(self):
        if not 0.0 < float(self.confidence) < 1.0:
            raise ValueError(f"calibration confidence must be in (0, 1); got {self.confidence}")
        if str(self.count) not in ("hits", "distinct", "items"):
            raise ValueError(f"calibration count must be hits, distinct or items; got {self.count!r}")
        if str(self.path) not in ("hits", "split"):
            raise ValueError(f"calibration path must be hits or split; got {self.path!r}")
        if str(self.prefer) not in ("tight", "loose"):
            raise ValueError(f"calibration prefer must be tight or loose; got {self.prefer!r}")
        if str(self.split_by) not in ("item", "request"):
            raise ValueError(f"calibration split_by must be item or request; got {self.split_by!r}")
        if not 0.0 < float(self.split_frac) < 1.0:
            raise ValueError(f"calibration split_frac must be in (0, 1); got {self.split_frac}")
        if int(self.max_radius) < 0:
            raise ValueError(f"calibration max_radius must be >= 0; got {self.max_radius}")
        if not float(self.threshold_step) > 0:
            raise ValueError(f"calibration threshold_step must be > 0; got {self.threshold_step}")
        if not -1.0 <= float(self.threshold_min) <= float(self.threshold_max) <= 1.0:
            raise ValueError(f"calibration needs -1 <= threshold_min <= threshold_max <= 1 (cosines); got "
                             f"threshold_min {self.threshold_min}, threshold_max {self.threshold_max}")
        if int(self.path_points) < 1:
            raise ValueError(f"calibration path_points must be >= 1; got {self.path_points}")
        self.tight_thresholds = tuple(float(t) for t in self.tight_thresholds)


@dataclass
class ShadowConfig:
    """Online verification of hits (`SemanticCache.get_or_compute` and `verify`): the cache's `shadow` block."""
    fraction: float = 0.0             # share of hits that are also computed and compared (0: off)
    target_false_hit_rate: Optional[float] = None   # budget to enforce; None: the calibration's, else monitor only
    confidence: float = 0.95          # of the upper bound exported and tested
    min_checks: int = 50              # checks of a pair (since its point changed) before a breach acts
    action: str = "tighten"           # on a breach: tighten (threshold + step, off past 1) | off
    step: float = 0.01                # how much a breach raises the pair's threshold

    def __post_init__(self):
        if not 0.0 <= float(self.fraction) <= 1.0:
            raise ValueError(f"shadow.fraction is a share of hits in [0, 1]; got {self.fraction}")
        if str(self.action) not in ("tighten", "off"):
            raise ValueError(f"shadow.action must be tighten or off; got {self.action!r}")
        if not 0.0 < float(self.confidence) < 1.0:
            raise ValueError(f"shadow.confidence must be in (0, 1); got {self.confidence}")


# ---------------------------------------------------------------------------------------------- points
@dataclass
class PairPoint:
    """One pair's operating point: served when on, within `radius` bits and with payload cosine >=
    `threshold`; the calibration's evidence with it."""
    on: bool
    radius: int = 0
    threshold: float = 1.0
    hits: int = 0                     # hits this pair served on the calibration stream at this point, counted
                                      # in the calibration's unit (Calibration.unit; false_hits, upper too)
    false_hits: int = 0
    upper: float = 1.0                # one-sided upper confidence bound of false_hits / hits
    reason: str = ""                  # why a pair is off
    units: dict = field(default_factory=dict)   # the same point's evidence in other units: {"distinct" |
                                      # "items": [trials, events, upper bound]} (distinct (request, entry)
                                      # pairs; request items, one with any false hit an event)

    @property
    def rate(self) -> float:
        return self.false_hits / self.hits if self.hits else 0.0


def _check_point(pair: str, v: dict) -> None:
    """Refuse a calibration file's point whose fields are not what they say ("on": "false" is a true string:
    the pair would serve)."""
    def bad(name, want):
        raise ValueError(f"calibration pair {pair}: {name} must be {want}; got {v[name]!r}")

    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    if not isinstance(v.get("on"), bool):
        raise ValueError(f"calibration pair {pair}: on must be true or false; got {v.get('on')!r}")
    for name in ("radius", "hits", "false_hits"):
        if name in v and not (isinstance(v[name], int) and not isinstance(v[name], bool) and v[name] >= 0):
            bad(name, "a whole number >= 0")
    if "threshold" in v and not (number(v["threshold"]) and -1.0 <= v["threshold"] <= 1.0):
        bad("threshold", "a cosine in [-1, 1]")
    if "upper" in v and not (number(v["upper"]) and 0.0 <= v["upper"] <= 1.0):
        bad("upper", "a rate in [0, 1]")
    if "reason" in v and not isinstance(v["reason"], str):
        bad("reason", "text")
    if "units" in v and not isinstance(v["units"], dict):
        bad("units", "an object")


UNIT_NAMES = {"hits": "hits", "distinct": "distinct (request, entry) pairs", "items": "request items"}


@dataclass
class Calibration:
    """Per-pair operating points for one head revision and one false-hit budget."""
    revision: str
    target_false_hit_rate: float
    confidence: float
    pairs: dict[str, PairPoint]
    info: dict = field(default_factory=dict)   # how it was made: dataset, split, stream, codec floors, paths

    def point(self, request_modality: str, entry_modality: str) -> PairPoint:
        return self.pairs.get(pair_name(request_modality, entry_modality)) or PairPoint(False, reason="not calibrated")

    @property
    def search_radius(self) -> int:
        """The radius the tiers search: the largest of the pairs that are on (0 when none is)."""
        return max([p.radius for p in self.pairs.values() if p.on] or [0])

    @property
    def unit(self) -> str:
        """What each point's hits, false_hits and upper count (`CalibrationSettings.count`): "hits" (every
        hit), "distinct" ((request, served entry) pairs) or "items" (request items)."""
        return str((self.info.get("settings") or {}).get("count", "hits"))

    @property
    def unit_name(self) -> str:
        return UNIT_NAMES.get(self.unit, self.unit)

    def check_head(self, head) -> None:
        """Refuse a calibration made for another head (its points say nothing about other codes)."""
        if not self.revision or self.revision != str(getattr(head, "revision", "")):
            raise ValueError(f"this calibration is for head revision {self.revision}; the cache serves "
                             f"{getattr(head, 'revision', '?')}: recalibrate (python -m ushash.calibrate export=<that export>)")

    def to_dict(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "revision": self.revision,
                "target_false_hit_rate": self.target_false_hit_rate, "confidence": self.confidence,
                "rate": f"false {self.unit_name} / {self.unit_name} of the pair, on the calibration stream",
                "bound": "one-sided Clopper-Pearson upper bound; points by fixed-sequence testing",
                "pairs": {k: dataclasses.asdict(v) for k, v in sorted(self.pairs.items())}, "info": self.info}

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a calibration file (format {d.get('format') if isinstance(d, dict) else d!r})")
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"calibration format version {d.get('format_version')!r}; this reads {FORMAT_VERSION}")
        names = {f.name for f in dataclasses.fields(PairPoint)}
        pairs = {}
        for k, v in (d.get("pairs") or {}).items():
            split_pair(k)
            if not isinstance(v, dict) or set(v) - names:
                raise ValueError(f"calibration pair {k}: unknown fields {sorted(set(v) - names) if isinstance(v, dict) else v}")
            _check_point(k, v)
            pairs[k] = PairPoint(**v)
        if not isinstance(d.get("revision"), str) or not d["revision"]:
            raise ValueError(f"calibration revision must be a head's revision; got {d.get('revision')!r}")
        return cls(d["revision"], float(d["target_false_hit_rate"]), float(d["confidence"]), pairs,
                   dict(d.get("info") or {}))

    def save(self, path) -> Path:
        from ushash.core.io import write_json

        return write_json(Path(path), self.to_dict())

    @classmethod
    def load(cls, path) -> "Calibration":
        p = Path(path)
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read calibration {p}: {e}") from e

    def table(self) -> str:
        units = [u for u in ("distinct", "items") if any(u in p.units for p in self.pairs.values())]
        n = self.unit_name
        lines = [f"| pair | status | radius | payload threshold | {n} | false {n} | rate | upper bound |"
                 + "".join(f" {u}: false / n (upper) |" for u in units),
                 "|---|---|---|---|---|---|---|---|" + "---|" * len(units)]
        for k, p in sorted(self.pairs.items()):
            status = "on" if p.on else f"off ({p.reason})"
            cells = "".join(f" {p.units[u][1]} / {p.units[u][0]} ({p.units[u][2]:.4f}) |" if p.on and u in p.units
                            else " - |" for u in units)
            lines.append(f"| {k} | {status} | {p.radius if p.on else '-'} | {f'{p.threshold:.4f}' if p.on else '-'} | "
                         f"{p.hits} | {p.false_hits} | {p.rate:.4f} | {p.upper:.4f} |" + cells)
        return "\n".join(lines)


def uniform_points(modalities: Iterable[str], radius: int, threshold: float, cross_modal: bool) -> dict[str, PairPoint]:
    """The points a cache without a calibration serves by: one radius and threshold for every pair, the
    cross-modal pairs off with cross_modal: false."""
    mods = list(modalities)
    return {pair_name(a, b): PairPoint(a == b or bool(cross_modal), int(radius), float(threshold),
                                       reason="" if a == b or cross_modal else "cross_modal: false")
            for a in mods for b in mods}


# ---------------------------------------------------------------------------------------------- online
class ShadowMonitor:
    """Per-pair shadow checks of served hits. `record(pair, agreed)` returns the action taken on a breach
    ("tighten" / "off") or None; the caller applies it to its points (`apply`). Thread-safe."""

    def __init__(self, config: ShadowConfig, target: Optional[float]):
        self.config = config
        self.target = config.target_false_hit_rate if config.target_false_hit_rate is not None else target
        self.delta = 1.0 - float(config.confidence)
        self.n: dict[str, int] = {}        # since the pair's point last changed
        self.k: dict[str, int] = {}
        self.total: dict[str, list[int]] = {}   # [checks, disagreements], ever
        self.actions: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def estimate(self, pair: str) -> tuple[float, float, int]:
        """(false-hit rate estimate, upper bound, checks) of a pair since its point last changed."""
        with self._lock:
            n, k = self.n.get(pair, 0), self.k.get(pair, 0)
        return (k / n if n else 0.0), clopper_pearson_upper(k, n, self.delta), n

    def record(self, pair: str, agreed: bool) -> Optional[str]:
        with self._lock:
            self.n[pair] = self.n.get(pair, 0) + 1
            self.k[pair] = self.k.get(pair, 0) + (not agreed)
            tot = self.total.setdefault(pair, [0, 0])
            tot[0] += 1
            tot[1] += not agreed
            n, k = self.n[pair], self.k[pair]
            # a breach needs a false hit seen: tested at each disagreement from min_checks on, and at the
            # min_checks-th check whichever way it went if a disagreement came before it (past min_checks an
            # agreement only lowers the bound)
            if self.target is None or n < int(self.config.min_checks) or k == 0 or (
                    agreed and n > int(self.config.min_checks)):
                return None
            if clopper_pearson_upper(k, n, self.delta) <= self.target:
                return None
            self.n[pair] = self.k[pair] = 0   # a new point: its evidence starts over
            return str(self.config.action)

    def apply(self, points: dict[str, PairPoint], pair: str, action: str) -> PairPoint:
        """Tighten or turn off `pair` in `points` (in place); returns its new point."""
        p = points.get(pair) or PairPoint(False)
        if action == "tighten" and p.on and p.threshold + float(self.config.step) <= 1.0:
            new = dataclasses.replace(p, threshold=round(p.threshold + float(self.config.step), 6))
        else:
            new = dataclasses.replace(p, on=False, reason=f"shadow checks breached {self.target}")
            action = "off"
        points[pair] = new
        with self._lock:
            self.actions[(pair, action)] = self.actions.get((pair, action), 0) + 1
        return new
