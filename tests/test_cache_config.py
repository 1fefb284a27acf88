"""Cache settings are checked when they are loaded: every wrong type or range fails naming the key."""

import pytest

from ushash.serving.cache.config import CacheConfig


@pytest.mark.parametrize("bad,key", [
    ({"tenants": "acme"}, "cache.tenants"),            # a string is not a list of tenants
    ({"tenants": []}, "cache.tenants"),
    ({"tenants": ["ok", "not ok!"]}, "cache.tenants"),
    ({"max_candidates": 0}, "cache.max_candidates"),
    ({"max_candidates": -3}, "cache.max_candidates"),
    ({"singleflight_timeout_s": 0}, "cache.singleflight_timeout_s"),
    ({"singleflight_timeout_s": -1.0}, "cache.singleflight_timeout_s"),
    ({"radius": 2.7}, "cache.radius"),
    ({"radius": "3"}, "cache.radius"),
    ({"radius": True}, "cache.radius"),
    ({"radius": -1}, "cache.radius"),
    ({"capacity_bytes": "abc"}, "cache.capacity_bytes"),
    ({"capacity_bytes": 0}, "cache.capacity_bytes"),
    ({"payload_threshold": "abc"}, "cache.payload_threshold"),
    ({"payload_threshold": 1.5}, "cache.payload_threshold"),
    ({"ttl_s": float("nan")}, "cache.ttl_s"),
    ({"ttl_s": float("inf")}, "cache.ttl_s"),
    ({"ttl_s": -5}, "cache.ttl_s"),
    ({"ttl_jitter": 1.0}, "cache.ttl_jitter"),
    ({"xfetch_beta": -1}, "cache.xfetch_beta"),
    ({"bloom_fp_rate": 0}, "cache.bloom_fp_rate"),
    ({"mih_nhash": 0}, "cache.mih_nhash"),
    ({"observe_radius": 1}, "cache.observe_radius"),
    ({"payload_check": "yes"}, "cache.payload_check"),
    ({"policy": "fifo"}, "cache.policy"),
    ({"backend": "gpu"}, "cache.backend"),
    ({"policy_options": [1, 2]}, "cache.policy_options"),
    ({"bogus": 1}, "unknown setting"),
    ({"l2": {"timeout_s": 0}}, "cache.l2.timeout_s"),
    ({"l2": {"url": "http://x"}}, "cache.l2.url"),
    ({"l2": {"breaker_failures": 1.5}}, "cache.l2.breaker_failures"),
    ({"l2": {"prefix": "a b"}}, "cache.l2.prefix"),
    ({"l2": "redis://127.0.0.1"}, "cache.l2"),
    ({"media": {"max_pixels": -1}}, "max_pixels"),
    ({"media": {"nope": 1}}, "cache.media"),
])
def test_bad_settings_fail_naming_the_key(bad, key):
    with pytest.raises(ValueError) as e:
        CacheConfig.from_dict(bad)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_good_settings_are_normalised():
    c = CacheConfig.from_dict({"tenants": ("a", "b"), "ttl_s": 60, "payload_threshold": 1, "l2": {}})
    assert c.tenants == ["a", "b"] and c.ttl_s == 60.0 and isinstance(c.payload_threshold, float)
    assert c.l2.url.startswith("redis://127.0.0.1") and c.media.max_pixels > 0


@pytest.mark.parametrize("bad,match", [({"mih_nhash": 3}, "mih_nhash=3 must divide"),
                                       ({"radius": 65}, "radius"),
                                       ({"backend": "torch", "device": "cuda:99"}, "no such CUDA device"),
                                       ({"device": "cuda"}, "needs cache.backend=torch")])
def test_settings_that_depend_on_the_head_fail_when_it_is_loaded(bad, match):
    c = CacheConfig.from_dict(bad)
    with pytest.raises(ValueError, match=match):
        c.check_head(64)
