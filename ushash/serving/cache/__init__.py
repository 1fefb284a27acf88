"""The semantic cache runtime: hash-code keyed lookups on CPU or GPU, Redis as L2 (docs/cache.md).

    from ushash.serving.cache import SemanticCache
    cache = SemanticCache.from_export("exports/<name>", {"capacity_bytes": 64 << 20, "radius": 3})
"""

from ushash.serving.cache.cache import DEFAULT_TENANT, InvalidTenant, Result, SemanticCache, UnknownTenant
from ushash.serving.cache.config import CacheConfig, L2Config
from ushash.serving.cache.entries import TENANT_PATTERN, Entry, Hit, decode_value, encode_value
from ushash.serving.cache.request import Query, RequestError

__all__ = ["CacheConfig", "DEFAULT_TENANT", "Entry", "Hit", "InvalidTenant", "L2Config", "Query", "RequestError", "Result",
           "SemanticCache", "TENANT_PATTERN", "UnknownTenant", "decode_value", "encode_value"]
