"""QoS-aware admission: tenants in classes (critical, normal, batch) whose admission weights shrink for
the low classes as the load rises, and an eviction order that never lets a lower class push out a higher
one's entries (the design's case: a report export flushing a payment service's hot keys).

Admission: a newcomer of class c is admitted with probability

    p_c(load) = 1 - (1 - w_c) * clip((load - onset) / (1 - onset), 0, 1)

load in [0, 1] (the cache's occupancy, or any pressure the caller measures): every class is admitted
below `onset`; at full load class c is admitted with its floor weight w_c (critical 1, normal 0.5, batch
0.05 by default). Eviction (`QoSLRU`): the victim is the least recently used entry of the lowest class
present whose rank is not above the newcomer's; when only higher classes' entries are left, the
newcomer is refused instead. Within one class it is plain LRU.
"""

from __future__ import annotations

import random
from collections import OrderedDict

CLASSES = ("batch", "normal", "critical")   # rank 0, 1, 2
DEFAULT_WEIGHTS = {"critical": 1.0, "normal": 0.5, "batch": 0.05}


class QoSAdmission:
    def __init__(self, tenant_class: dict[str, str] | None = None, weights: dict[str, float] | None = None,
                 onset: float = 0.7, default_class: str = "normal", rng: random.Random | None = None):
        self.tenant_class = dict(tenant_class or {})
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        for c, cl in list(self.tenant_class.items()) + [("default", default_class)]:
            if cl not in CLASSES:
                raise ValueError(f"tenant {c!r}: class must be one of {CLASSES}; got {cl!r}")
        if not 0 <= onset < 1:
            raise ValueError(f"onset must be in [0, 1); got {onset}")
        self.onset, self.default_class = float(onset), default_class
        self.rng = rng or random.Random(0)

    def class_of(self, tenant: str) -> str:
        return self.tenant_class.get(tenant, self.default_class)

    def rank(self, tenant: str) -> int:
        return CLASSES.index(self.class_of(tenant))

    def probability(self, tenant: str, load: float) -> float:
        w = float(self.weights[self.class_of(tenant)])
        x = min(1.0, max(0.0, (float(load) - self.onset) / (1.0 - self.onset)))
        return 1.0 - (1.0 - w) * x

    def admit(self, tenant: str, load: float) -> bool:
        p = self.probability(tenant, load)
        return p >= 1.0 or self.rng.random() < p


class QoSLRU:
    """A key -> value cache of `capacity` entries with QoS admission and class-ordered eviction. With
    `admission=None` it is one plain LRU over every tenant (the fixed alternative)."""

    def __init__(self, capacity: int, admission: QoSAdmission | None = None):
        self.capacity = int(capacity)
        self.admission = admission
        self._lru: list[OrderedDict] = [OrderedDict() for _ in CLASSES]
        self._one: OrderedDict = OrderedDict()
        self.refused = self.evicted = 0

    def __len__(self) -> int:
        return len(self._one) if self.admission is None else sum(len(x) for x in self._lru)

    def get(self, tenant: str, key):
        k = (tenant, key)
        if self.admission is None:
            if k in self._one:
                self._one.move_to_end(k)
                return self._one[k]
            return None
        d = self._lru[self.admission.rank(tenant)]
        if k in d:
            d.move_to_end(k)
            return d[k]
        return None

    def put(self, tenant: str, key, value) -> bool:
        k = (tenant, key)
        if self.admission is None:
            self._one[k] = value
            self._one.move_to_end(k)
            if len(self._one) > self.capacity:
                self._one.popitem(last=False)
                self.evicted += 1
            return True
        r = self.admission.rank(tenant)
        d = self._lru[r]
        if k in d:
            d[k] = value
            d.move_to_end(k)
            return True
        if not self.admission.admit(tenant, len(self) / self.capacity):
            self.refused += 1
            return False
        if len(self) >= self.capacity:
            victim = next((x for x in self._lru[:r + 1] if x), None)
            if victim is None:   # only higher classes' entries left: the newcomer gives way
                self.refused += 1
                return False
            victim.popitem(last=False)
            self.evicted += 1
        d[k] = value
        return True
