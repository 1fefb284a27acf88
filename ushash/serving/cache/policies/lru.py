"""LRU and LFU: cachetools' LRUCache / LFUCache (both O(1); sizes through `getsizeof`), with their `popitem`
captured to report what they evict. cachetools' LFU counts hits since insertion, with no aging."""

from __future__ import annotations

import cachetools

from ushash.serving.cache.policies import POLICIES, Policy


class _Capturing:
    """Mixin for a cachetools cache: records the keys its `popitem` evicts."""

    def popitem(self):
        key, value = super().popitem()
        self.evicted.append(key)
        return key, value


class _LRU(_Capturing, cachetools.LRUCache):
    pass


class _LFU(_Capturing, cachetools.LFUCache):
    pass


class _CachetoolsPolicy(Policy):
    impl: type

    def __init__(self, capacity_bytes: int):
        super().__init__(capacity_bytes)
        self._c = self.impl(maxsize=self.capacity_bytes, getsizeof=lambda nbytes: nbytes)
        self._c.evicted = []

    def insert(self, key: int, nbytes: int, ident: int | None = None) -> list[int]:
        if nbytes > self.capacity_bytes:
            return [key]
        self._c.evicted = []
        self._c[key] = int(nbytes)
        return self._c.evicted

    def access(self, key: int) -> None:
        if key in self._c:
            self._c[key]  # noqa: B018  (a read is what counts as a reference in cachetools)

    def remove(self, key: int) -> None:
        self._c.pop(key, None)

    @property
    def used_bytes(self) -> int:
        return int(self._c.currsize)

    def __len__(self) -> int:
        return len(self._c)

    def __contains__(self, key: int) -> bool:
        return key in self._c


@POLICIES.register("lru")
class LRU(_CachetoolsPolicy):
    name, impl = "lru", _LRU


@POLICIES.register("lfu")
class LFU(_CachetoolsPolicy):
    name, impl = "lfu", _LFU
