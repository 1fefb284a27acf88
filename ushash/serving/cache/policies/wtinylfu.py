"""W-TinyLFU: theine's Rust core (`theine_core.TlfuCore`: a 1% LRU window, a segmented-LRU main space and
a count-min-sketch TinyLFU admission filter). It bounds a number of entries, not bytes, and exposes
no sketch or victim hook; it does expose what it evicts on `set`, including a refused candidate. So an
entry of `nbytes` occupies ceil(nbytes / slot_bytes) slots (its own key plus "ballast" keys, all touched
together on a hit), the core holds capacity_bytes // slot_bytes slots, and losing any slot drops the
whole entry. Bytes held <= slots held * slot_bytes <= capacity. Capacities beyond 2^24 slots use
coarser slots (slot_bytes = capacity / 2^24). cachebox (the other maintained
candidate) has LRU/LFU/TTL/RR/FIFO caches but no TinyLFU.
"""

from __future__ import annotations

from ushash.serving.cache.policies import POLICIES, Policy


@POLICIES.register("wtinylfu")
class WTinyLFU(Policy):
    """theine_core.TlfuCore over slots of `slot_bytes` (see the module docstring)."""

    name = "wtinylfu"
    MAX_SLOTS_PER_ENTRY = 1 << 12
    MAX_SLOTS = 1 << 24

    def __init__(self, capacity_bytes: int, slot_bytes: int = 64):
        super().__init__(capacity_bytes)
        from theine_core import TlfuCore, spread

        if int(slot_bytes) <= 0:
            raise ValueError(f"slot_bytes must be positive; got {slot_bytes!r}")
        # theine's core grows with its size (about 100 B per slot once used, and a 2^28-slot core fails
        # to allocate), so very large capacities get coarser slots rather than more of them.
        self.slot_bytes = max(int(slot_bytes), -(-self.capacity_bytes // self.MAX_SLOTS))
        self.slots = max(1, self.capacity_bytes // self.slot_bytes)
        self._core = TlfuCore(self.slots)
        self._spread = spread
        self._owner: dict[int, int] = {}          # slot hash -> key
        self._hashes: dict[int, list[int]] = {}   # key -> its slot hashes
        self._bytes: dict[int, int] = {}
        self._used = 0

    def _slot_hashes(self, key: int, nbytes: int) -> list[int]:
        n = max(1, -(-int(nbytes) // self.slot_bytes))
        base = key * self.MAX_SLOTS_PER_ENTRY
        return [self._spread(base + j) for j in range(n)]

    def insert(self, key: int, nbytes: int) -> list[int]:
        n_slots = max(1, -(-int(nbytes) // self.slot_bytes))
        if n_slots > min(self.slots, self.MAX_SLOTS_PER_ENTRY):
            return [key]
        if key in self._hashes:
            self.remove(key)
        hs = self._slot_hashes(key, nbytes)
        for h in hs:
            self._owner[h] = key
        self._hashes[key], self._bytes[key] = hs, int(nbytes)
        self._used += int(nbytes)
        dropped = []
        for h in self._core.set([(h, 0) for h in hs]):
            k = self._owner.get(h)
            if k is not None and k in self._hashes and k not in dropped:
                dropped.append(k)
        for k in dropped:
            self.remove(k)
        return dropped

    def access(self, key: int) -> None:
        hs = self._hashes.get(key)
        if hs:
            self._core.access(hs)

    def remove(self, key: int) -> None:
        hs = self._hashes.pop(key, None)
        if hs is None:
            return
        for h in hs:
            self._core.remove(h)
            self._owner.pop(h, None)
        self._used -= self._bytes.pop(key)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, key: int) -> bool:
        return key in self._hashes
