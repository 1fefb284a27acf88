"""ushash.serving.workers: the threads the proxy encodes in, held to what asyncio.to_thread does."""

from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from ushash.serving.workers import Workers

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("test_workers_var", default="unset")


def test_a_call_returns_its_result_from_another_thread_in_a_copy_of_the_context():
    w = Workers(2)

    def call(x):
        seen = VAR.get()
        VAR.set("changed in the worker")   # the copy's, not the caller's
        return x * 2, seen, threading.get_ident()

    async def main():
        VAR.set("the caller's")
        out = await w.run(call, 21)
        return out, VAR.get()

    try:
        (doubled, seen, ident), after = asyncio.run(main())
    finally:
        w.close()
    assert (doubled, seen, after) == (42, "the caller's", "the caller's")
    assert ident != threading.get_ident()


def test_an_exception_is_raised_at_the_await_and_the_worker_goes_on():
    w = Workers(1)
    err = ValueError("bad image")

    def fails():
        raise err

    async def main():
        with pytest.raises(ValueError) as e:
            await w.run(fails)
        assert e.value is err
        return await w.run(lambda: "next")

    try:
        assert asyncio.run(main()) == "next"
    finally:
        w.close()


def test_n_workers_run_n_calls_at_once():
    """Two calls that each wait for the other at a barrier finish only if two threads run them together."""
    w = Workers(2)
    barrier = threading.Barrier(2, timeout=10)

    async def main():
        return await asyncio.gather(w.run(barrier.wait), w.run(barrier.wait))

    try:
        assert sorted(asyncio.run(main())) == [0, 1]
    finally:
        w.close()


def test_a_cancelled_awaiter_leaves_the_call_to_finish_and_nothing_is_raised_on_the_loop():
    w = Workers(1)
    release, finished = threading.Event(), threading.Event()
    loop_errors = []

    def slow():
        release.wait(10)
        finished.set()
        return "dropped"

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: loop_errors.append(ctx))
        task = asyncio.create_task(w.run(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        assert await w.run(lambda: "served") == "served"   # queued behind the cancelled one: it ran to its end
        await asyncio.sleep(0.05)                           # the dropped result's settle has run

    try:
        asyncio.run(main())
    finally:
        w.close()
    assert finished.is_set() and loop_errors == []


def test_closed_workers_stop_their_threads_and_refuse_new_calls():
    w = Workers(2)

    async def main():
        await w.run(lambda: None)

    asyncio.run(main())
    threads = list(w._threads)
    assert len(threads) == 2
    w.close()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(main())


def test_the_number_of_threads_is_checked():
    for n in (0, -1):
        with pytest.raises(ValueError):
            Workers(n)
    assert Workers().n >= 1


def test_the_lifespan_closes_the_workers_at_shutdown():
    w = Workers(1)

    async def main():
        async with w.lifespan(None):
            assert await w.run(lambda: "served") == "served"
        with pytest.raises(RuntimeError, match="closed"):
            await w.run(lambda: None)

    asyncio.run(main())
