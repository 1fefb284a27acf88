"""Threads that run an event loop's blocking calls (encoding a request: CPU work of tens of milliseconds).

    workers = Workers(2)
    result = await workers.run(cache.query, "image", data)   # in a worker thread, in a copy of the context
    workers.close()

What `asyncio.to_thread` does, at less cost per encoder-sized call: the caller puts (call, loop, future) on one queue that
every worker takes from, and the worker that ran it settles the future through `loop.call_soon_threadsafe`.
`to_thread` goes through concurrent.futures (a Future with its condition lock, a work item, the pool's
thread accounting) and `asyncio.wrap_future`, Python code that runs on both sides of the handoff, cold after
the call's own work, while the other thread waits for the GIL (`benchmarks/offload.py` times the two handoffs
side by side; docs/benchmarks.md: the gain is on a call that leaves the caches cold, as an encoding does; on an
empty call the two are within a few hundredths of a millisecond, either way from machine to machine). The call runs in a copy of the caller's context, as under `to_thread`
(tracing spans, the single-flight leader mark). A call whose awaiter was cancelled still runs to its end;
its result is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import queue
import threading
from typing import Any, Callable


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():   # its awaiter was cancelled
        return
    if isinstance(error, StopIteration):   # a Future refuses it (TypeError): its awaiter would wait forever
        cause, error = error, RuntimeError(f"the call raised StopIteration{f' ({error})' if str(error) else ''}")
        error.__cause__ = cause
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class Workers:
    """`n` daemon threads (default: the machine's cores), started on the first call; `close()` stops them."""

    def __init__(self, n: int | None = None, name: str = "ushash-worker"):
        self.n = int(os.cpu_count() or 1) if n is None else int(n)
        if self.n < 1:
            raise ValueError(f"Workers needs at least one thread; got {n!r}")
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    async def run(self, fn: Callable, *args) -> Any:
        """fn(*args) in a worker thread; its result, or its exception raised here."""
        if not self._threads:
            self._start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((contextvars.copy_context(), fn, args, loop, fut))
        return await fut

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("these workers are closed")
            while len(self._threads) < self.n:
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            ctx, fn, args, loop, fut = item
            result, error = None, None
            try:
                result = ctx.run(fn, *args)
            except BaseException as e:   # noqa: BLE001 (the awaiter's to raise, as under to_thread)
                error = e
            try:
                loop.call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:   # the loop is closed: nobody is waiting
                pass
            del item, ctx, fn, args, loop, fut, result, error   # not kept alive while it waits for the next

    def close(self) -> None:
        """Stop the threads once the calls already queued have run (a call made later raises)."""
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)

    @contextlib.asynccontextmanager
    async def lifespan(self, app=None):
        """FastAPI(lifespan=workers.lifespan): the threads closed when the app shuts down."""
        try:
            yield
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"Workers(n={self.n}, started={len(self._threads)})"


__all__ = ["Workers"]
