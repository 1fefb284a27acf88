"""L1 entry storage: columns indexed by slot (numpy arrays for fixed-size fields, lists for bytes).

A slot is an entry's id inside one cache; freed slots are reused. Columnar storage keeps the per-entry
overhead of a million entries small (see benchmarks/cache_lookup.py for the measured bytes per entry).
"""

from __future__ import annotations

import numpy as np


class EntryTable:
    NUMERIC = {"tenant": np.int32, "modality": np.int8, "revision": np.int32, "created": np.float64,
               "expires": np.float64, "compute_s": np.float32, "nbytes": np.int64, "gen": np.int64,
               "alive": np.bool_}

    def __init__(self, code_bytes: int, capacity: int = 1024):
        self.code_bytes = int(code_bytes)
        self._cap = max(16, int(capacity))
        self.code = np.zeros((self._cap, self.code_bytes), np.uint8)
        for name, dt in self.NUMERIC.items():
            setattr(self, name, np.zeros(self._cap, dt))
        self.payload: list = [None] * self._cap
        self.value: list = [None] * self._cap
        self.kind: list = [None] * self._cap
        self.l2id: list = [None] * self._cap
        self._free: list[int] = []
        self._hwm = 0
        self.live = 0

    def _grow(self) -> None:
        cap = self._cap * 2
        code = np.zeros((cap, self.code_bytes), np.uint8)
        code[: self._cap] = self.code
        self.code = code
        for name, dt in self.NUMERIC.items():
            a = np.zeros(cap, dt)
            a[: self._cap] = getattr(self, name)
            setattr(self, name, a)
        for name in ("payload", "value", "kind", "l2id"):
            getattr(self, name).extend([None] * (cap - self._cap))
        self._cap = cap

    def alloc(self) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            if self._hwm == self._cap:
                self._grow()
            slot = self._hwm
            self._hwm += 1
        self.alive[slot] = True
        self.gen[slot] += 1
        self.live += 1
        return slot

    def release(self, slot: int) -> None:
        if not self.alive[slot]:
            return
        self.alive[slot] = False
        self.payload[slot] = self.value[slot] = self.kind[slot] = self.l2id[slot] = None
        self._free.append(slot)
        self.live -= 1

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.alive[: self._hwm])

    def nbytes_arrays(self) -> int:
        """Bytes of the column arrays themselves (capacity, not live entries)."""
        return int(self.code.nbytes + sum(getattr(self, n).nbytes for n in self.NUMERIC) + 4 * 8 * self._cap)
