"""Deleting a tenant reaches the L2 (nothing comes back through Redis), and a time to live is a finite
number of seconds (NaN would make an entry that never expires)."""

import math

import numpy as np
import pytest
from test_cache_redis import REDIS, RedisServer

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.freshness import Freshness
from ushash.serving.cache.lsh import LSHHead


def _head():
    return LSHHead({"text": 16}, bits=64, dim=32, aligned=True, seed=0, revision="r1")


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_delete_tenant_clears_l1_and_redis():
    srv = RedisServer()
    try:
        cfg = {"radius": 0, "l2": {"url": srv.url, "watermark_check_s": 0.0}}
        a, b = SemanticCache(_head(), cfg), SemanticCache(_head(), cfg)
        xs = np.random.default_rng(0).standard_normal((100, 16)).astype(np.float32)
        for i, x in enumerate(xs):
            a.put("text", features=x, value=i, tenant="acme")
            a.put("text", features=x, value=-i, tenant="other")
        assert a.delete_tenant("acme") == 100
        assert not srv.client.keys("ushash:{acme}:*")
        back = sum(c.get("text", features=x, tenant="acme") is not None for c in (a, b) for x in xs)
        assert back == 0
        assert all(b.get("text", features=x, tenant="other").value == -i for i, x in enumerate(xs))  # untouched
    finally:
        srv.stop()


@pytest.mark.skipif(REDIS is None, reason="redis-server not installed")
def test_delete_tenant_says_when_redis_could_not_be_cleared():
    srv = RedisServer()
    cache = SemanticCache(_head(), {"l2": {"url": srv.url, "breaker_failures": 1}})
    cache.put("text", features=np.ones(16, np.float32), value=1, tenant="acme")
    srv.stop()
    with pytest.raises(RuntimeError, match="L2 could not be reached; call delete_tenant again"):
        cache.delete_tenant("acme")


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -1.0, "60", True])
def test_a_ttl_must_be_finite_seconds(ttl):
    cache = SemanticCache(_head(), {})
    with pytest.raises(ValueError, match="ttl_s"):
        cache.put("text", features=np.ones(16, np.float32), value=1, ttl_s=ttl)
    with pytest.raises(ValueError, match="ttl_s"):
        Freshness(ttl_s=ttl)


def test_ttl_zero_or_none_means_no_expiry_and_numbers_expire():
    f = Freshness(ttl_s=10.0, jitter=0.0)
    assert f.expiry(100.0) == 110.0 and f.expiry(100.0, 0) == math.inf and f.expiry(100.0, 5) == 105.0
