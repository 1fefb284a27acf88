"""Single-flight, the same cases for threads (get_or_compute) and coroutines (aget_or_compute): one compute
for N concurrent misses, a slow leader's followers compute for themselves after the timeout (no
exception), a failed leader's error reaches its followers (who do not all compute), and a compute that
asks for its own key fails at once."""

import asyncio
import threading
import time

import numpy as np
import pytest

from ushash.serving.cache import SemanticCache
from ushash.serving.cache.lsh import LSHHead

X = np.ones(8, np.float32)
N = 8


def _cache(timeout=30.0):
    return SemanticCache(LSHHead({"text": 8}, bits=64, dim=16), {"singleflight_timeout_s": timeout})


class Boom(Exception):
    pass


def run_threads(cache, compute_for):
    """N threads call get_or_compute at once; compute_for(i) is thread i's compute (a plain function
    taking a `sleep` and returning its value). Returns [Result or exception]."""
    barrier = threading.Barrier(N)
    out = [None] * N

    def worker(i):
        barrier.wait()
        try:
            out[i] = cache.get_or_compute("text", features=X, compute=lambda: compute_for(i, time.sleep, cache, False))
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out[i] = e

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(N)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    return out


def run_tasks(cache, compute_for):
    async def one(i):
        async def compute():
            return await compute_for(i, asyncio.sleep, cache, True)
        try:
            return await cache.aget_or_compute("text", features=X, compute=compute)
        except Exception as e:  # noqa: BLE001
            return e

    async def main():
        return await asyncio.gather(*[one(i) for i in range(N)])

    return asyncio.run(main())


RUNNERS = {"threads": run_threads, "asyncio": run_tasks}


def _compute(body):
    """Make a compute usable by both runners: body(i, calls) -> (seconds to sleep, value or exception)."""
    calls = []

    def compute_for(i, sleep, cache, is_async):
        calls.append(i)
        seconds, outcome = body(i, calls)

        if is_async:
            async def go():
                await sleep(seconds)
                if isinstance(outcome, Exception):
                    raise outcome
                return outcome
            return go()
        sleep(seconds)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return compute_for, calls


@pytest.mark.parametrize("runner", RUNNERS)
def test_n_concurrent_misses_compute_once(runner):
    cache = _cache()
    compute_for, calls = _compute(lambda i, calls: (0.2, "v"))
    out = RUNNERS[runner](cache, compute_for)
    assert len(calls) == 1 and [r.value for r in out] == ["v"] * N
    assert sum(r.waited for r in out) == N - 1


@pytest.mark.parametrize("runner", RUNNERS)
def test_followers_of_a_slow_leader_compute_after_the_timeout_without_an_error(runner):
    cache = _cache(timeout=0.2)
    compute_for, calls = _compute(lambda i, calls: (1.0 if len(calls) == 1 else 0.0, "v"))
    out = RUNNERS[runner](cache, compute_for)
    assert all(not isinstance(r, Exception) for r in out), out
    assert [r.value for r in out] == ["v"] * N
    assert sum(r.computed for r in out) >= 2 and sum(r.waited for r in out) == N - 1


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_failed_leader_s_error_reaches_its_followers(runner):
    cache = _cache()
    compute_for, calls = _compute(lambda i, calls: (0.2, Boom("backend down")))
    out = RUNNERS[runner](cache, compute_for)
    assert len(calls) == 1, f"{len(calls)} computes: the followers should not all retry at once"
    assert all(isinstance(r, Boom) and str(r) == "backend down" for r in out)
    # the next call computes again (the failure is not cached)
    compute_ok, calls_ok = _compute(lambda i, calls: (0.0, "ok"))
    out = RUNNERS[runner](cache, compute_ok)
    assert [r.value for r in out] == ["ok"] * N and len(calls_ok) == 1


def test_a_compute_asking_for_its_own_key_fails_at_once_threads():
    cache = _cache(timeout=30.0)

    def compute():
        return cache.get_or_compute("text", features=X, compute=lambda: "inner").value

    t0 = time.monotonic()
    with pytest.raises(RecursionError, match="its own request"):
        cache.get_or_compute("text", features=X, compute=compute)
    assert time.monotonic() - t0 < 2.0
    assert cache.get_or_compute("text", features=X, compute=lambda: "v").value == "v"  # nothing left locked


def test_a_compute_asking_for_its_own_key_fails_at_once_asyncio():
    cache = _cache(timeout=30.0)

    async def inner():
        return "inner"

    async def compute():
        return (await cache.aget_or_compute("text", features=X, compute=inner)).value

    async def main():
        t0 = time.monotonic()
        with pytest.raises(RecursionError, match="its own request"):
            await cache.aget_or_compute("text", features=X, compute=compute)
        assert time.monotonic() - t0 < 2.0
        return (await cache.aget_or_compute("text", features=X, compute=inner)).value

    assert asyncio.run(main()) == "inner"


def test_another_key_inside_a_compute_is_fine():
    cache = _cache()
    y = -np.ones(8, np.float32)

    def compute():
        return "outer+" + cache.get_or_compute("text", features=y, compute=lambda: "inner").value

    assert cache.get_or_compute("text", features=X, compute=compute).value == "outer+inner"


def test_followers_are_counted_once_as_hot_keys():
    """A follower's second look after its wait recorded the request again: 8 requests read as 15."""
    cache = _cache()
    cache.track_hot_keys(window_s=600)
    compute_for, calls = _compute(lambda i, calls: (0.2, "v"))
    run_threads(cache, compute_for)
    assert len(calls) == 1 and list(cache.hotkeys.counts().values()) == [N]


def test_a_cancelled_async_leader_leaves_its_followers_to_compute():
    """The leader's task cancelled (its client went away) raised CancelledError in every follower."""
    cache = _cache()

    async def compute():
        await asyncio.sleep(0.3)
        return "v"

    async def main():
        leader = asyncio.create_task(cache.aget_or_compute("text", features=X, compute=compute))
        await asyncio.sleep(0.01)
        followers = [asyncio.create_task(cache.aget_or_compute("text", features=X, compute=compute)) for _ in range(3)]
        await asyncio.sleep(0.05)
        leader.cancel()
        return await asyncio.gather(*followers, return_exceptions=True)

    out = asyncio.run(main())
    assert [getattr(r, "value", r) for r in out] == ["v"] * 3


def test_one_async_single_flight_table_per_live_event_loop():
    """Tables were kept by id(loop) for ever: one per asyncio.run, and a new loop could inherit a dead one's."""
    import gc

    cache = _cache()
    for _ in range(20):
        asyncio.run(cache.aget_or_compute("text", features=X, compute=lambda: asyncio.sleep(0, "v")))
    gc.collect()
    assert len(cache._asf) <= 1


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("during", ["refresh", "shadow"])
def test_a_failed_refresh_or_shadow_check_serves_the_fresh_cached_answer(runner, during):
    """An early refresh (XFetch) or a shadow check whose compute failed raised the backend's error where the
    entry was still fresh and servable."""
    import random

    class Clock:
        t = 1000.0

        def __call__(self):
            return self.t

    clock = Clock()
    cfg = {"ttl_s": 100, "ttl_jitter": 0.0, "xfetch_beta": 1.0} if during == "refresh" else {"shadow": {"fraction": 1.0}}
    cache = SemanticCache(LSHHead({"text": 8}, bits=64, dim=16), cfg, clock=clock, rng=random.Random(0))
    cache.put("text", None, "cached answer", features=X, compute_s=60.0)
    clock.t = 1099.0 if during == "refresh" else 1000.0   # 1 s of life left: XFetch refreshes early
    compute_for, calls = _compute(lambda i, calls: (0.0, Boom("backend down")))
    out = RUNNERS[runner](cache, compute_for)
    assert [getattr(r, "value", r) for r in out] == ["cached answer"] * N and calls
    assert cache.metrics.value("cache_compute_failures_total", during=during) == len(calls)
    assert cache.get("text", features=X).value == "cached answer"
