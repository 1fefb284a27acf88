"""Eviction policies with a capacity in bytes: LRU, LFU, W-TinyLFU and LRU-K with time decay, one module each.

Every policy tracks integer keys (the cache's entry slots) and their sizes in bytes:

    evicted = policy.insert(key, nbytes, ident)   # keys to drop, oldest decision first; may contain
                                           # `key` itself when the policy refuses to admit it (W-TinyLFU);
                                           # ident: the request's identity across slots (optional;
                                           # bind_idents(table) derives it from the slot's row instead)
    policy.access(key)                      # a hit
    policy.access_many(keys)                # hits of a batch, in order (W-TinyLFU: one compiled call)
    policy.remove(key)                      # the cache dropped it (expiry, revision change, replacement)

After `insert` returns, the bytes of the keys still held never exceed `capacity_bytes`.

- "lru", "lfu": cachetools' LRUCache / LFUCache (both O(1); sizes through `getsizeof`), with their
  `popitem` captured to report what they evict. cachetools' LFU counts hits since insertion, with no aging.
- "wtinylfu": W-TinyLFU (this package's wtinylfu.py): a 1% LRU window, a segmented-LRU main space and a
  count-min TinyLFU admission filter over byte sizes, in numpy arrays, deterministic, its sketch sized from
  the entries held.
- "lruk": LRU-K with exponential time decay (this module). An entry's score is the decayed count of
  its last K references, sum_i 2^(-(now - t_i) / half_life); the lowest score is evicted. Because
  every score decays by the same factor, the ranking is kept as log(sum_i 2^(t_i / half_life)), which
  never changes unless the entry is referenced, so a lazy min-heap suffices. half_life -> 0 gives LRU;
  half_life -> inf gives "fewest of the last K references" (LFU capped at K); entries referenced once
  lose to ones referenced K times unless they are about a half-life newer (LRU-K's scan resistance).

Adding a policy = one module in this package that subclasses `Policy` and registers itself with
`@POLICIES.register("<name>")` (every module of the package is imported), and a preset in
configs/cache/<name>.yaml (`cache=<name>`; options go to the constructor as `policy_options`).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable

from ushash.core.registry import Registry, import_all

POLICIES = Registry("eviction policy", "ushash/serving/cache/policies")


class Policy:
    name = ""

    def __init__(self, capacity_bytes: int):
        if isinstance(capacity_bytes, bool) or int(capacity_bytes) <= 0:
            raise ValueError(f"capacity_bytes must be a positive int; got {capacity_bytes!r}")
        self.capacity_bytes = int(capacity_bytes)

    def insert(self, key: int, nbytes: int, ident: int | None = None) -> list[int]:
        """Hold `key` of `nbytes`; returns the keys evicted. ident: the request's identity, for policies
        that count requests across entries (W-TinyLFU's sketch); others ignore it."""
        raise NotImplementedError

    def bind_idents(self, rows) -> None:
        """Take each key's ident from row `key` of an entry table (`code`, `tenant`) instead of `insert`'s
        argument (W-TinyLFU: nothing held per entry for it); others ignore idents."""

    def access(self, key: int) -> None:
        raise NotImplementedError

    def access_many(self, keys) -> None:
        """`access` of each key in turn (a batch's hits, in query order)."""
        for k in keys:
            self.access(int(k))

    def remove(self, key: int) -> None:
        raise NotImplementedError

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: int) -> bool:
        raise NotImplementedError


def make_policy(name: str, capacity_bytes: int, clock: Callable[[], float] = time.monotonic, **options) -> Policy:
    """Build a registered policy by name with its options (wtinylfu: window, protected; lruk: k, half_life_s); `clock`
    reaches the policies that take one."""
    cls = POLICIES.lookup(str(name).lower())
    params = inspect.signature(cls.__init__).parameters
    allowed = sorted(k for k in params if k not in ("self", "capacity_bytes", "clock"))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"eviction policy {cls.name!r} takes {'options ' + str(allowed) if allowed else 'no options'}; "
                         f"got {unknown}")
    if "clock" in params:
        options["clock"] = clock
    return cls(capacity_bytes, **options)


# Every module of this package is imported: the ones that register themselves fill the registry.
import_all(__name__, __path__)  # noqa: E402
