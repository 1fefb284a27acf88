"""The service behind the cache, as a discrete-event model: arrivals, a worker pool with a queue, and
the event loop the failure scenarios (ushash.sim.failures) run on. Simulated time only: a run of minutes
of traffic takes about a second.

- `arrivals`: request times, Poisson or heavy-tailed (generalised-Pareto inter-arrival times; the design
  reports a fit of shape ~0.83, whose variance is infinite: bursts and lulls), at a given mean rate.
- `Downstream`: `workers` calls in service at once (the service's concurrency limit), a FIFO queue of at
  most `queue_limit` calls behind them (a call arriving to a full queue is refused at once), service
  times lognormal (a median and a log-space sigma per call). A call whose caller gave up is still served
  (the service does not know): wasted work, which is how retries feed back. `in_flight` (in service +
  queued) is tracked over time: its peak, the time spent above `workers` (queueing) and the peak per second
  (the most in flight at any time during that second, calls carried over from earlier seconds included).
- `EventLoop`: a heap of (time, seq, callback, args).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from typing import Callable

import numpy as np


def arrivals(rate: float, t0: float, t1: float, rng: np.random.Generator, kind: str = "poisson",
             shape: float = 0.83) -> np.ndarray:
    """Arrival times in [t0, t1) at mean `rate` per second. kind: poisson (exponential gaps) or gpd
    (generalised-Pareto gaps of shape `shape` < 1, scale (1 - shape) / rate so the mean gap is 1 / rate)."""
    if rate <= 0 or t1 <= t0:
        return np.zeros(0)
    n = int((t1 - t0) * rate * 1.5 + 64)
    out = []
    t = t0
    while t < t1:
        if kind == "poisson":
            gaps = rng.exponential(1.0 / rate, n)
        elif kind == "gpd":
            if not 0 < shape < 1:
                raise ValueError(f"gpd shape must be in (0, 1) for a finite mean; got {shape}")
            u = 1.0 - rng.random(n)  # (0, 1]
            gaps = (1.0 - shape) / rate / shape * (u ** -shape - 1.0)
        else:
            raise ValueError(f"arrivals kind must be poisson or gpd; got {kind!r}")
        ts = t + np.cumsum(gaps)
        out.append(ts)
        t = float(ts[-1])
    ts = np.concatenate(out)
    return ts[ts < t1]


class EventLoop:
    def __init__(self):
        self.now = 0.0
        self._h: list = []
        self._seq = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self._h, (t, self._seq, fn, args))

    def run(self, until: float = math.inf) -> None:
        h = self._h
        while h and h[0][0] <= until:
            t, _, fn, args = heapq.heappop(h)
            self.now = t
            fn(*args)


class Downstream:
    """A worker pool with a bounded FIFO queue on an EventLoop. `submit(median_s, done)` calls
    done(ok: bool) when the call completes (ok) or is refused because the queue is full (not ok)."""

    def __init__(self, loop: EventLoop, workers: int = 8, queue_limit: int = 200, sigma: float = 0.5,
                 rng: np.random.Generator | None = None, bin_s: float = 1.0):
        self.loop, self.workers, self.queue_limit, self.sigma = loop, int(workers), int(queue_limit), float(sigma)
        self.rng = rng or np.random.default_rng(0)
        self.busy = 0
        self.queue: deque = deque()
        self.calls = self.refused = self.completed = 0
        self.peak = 0
        self.over_s = 0.0       # time with in_flight > workers (calls queueing)
        self._last = 0.0
        self.bin_s = float(bin_s)
        self.peak_per_bin: dict[int, int] = {}
        self.calls_per_bin: dict[int, int] = {}
        self._z = self.rng.standard_normal(1 << 16)
        self._zi = 0

    @property
    def in_flight(self) -> int:
        return self.busy + len(self.queue)

    def _account(self) -> None:
        """Called before every change of in_flight: the calls in flight since the last change were in flight
        in every second from then to now (carried into the seconds without a change of their own)."""
        now, n = self.loop.now, self.in_flight
        if n > self.workers:
            self.over_s += now - self._last
        if n:
            for b in range(int(self._last // self.bin_s) + 1, math.ceil(now / self.bin_s)):
                self.peak_per_bin[b] = max(self.peak_per_bin.get(b, 0), n)
        self._last = now

    def _mark(self) -> None:
        n = self.in_flight
        self.peak = max(self.peak, n)
        b = int(self.loop.now // self.bin_s)
        if n > self.peak_per_bin.get(b, 0):
            self.peak_per_bin[b] = n

    def service_time(self, median_s: float) -> float:
        if self._zi >= len(self._z):
            self._z, self._zi = self.rng.standard_normal(1 << 16), 0
        z = self._z[self._zi]
        self._zi += 1
        return float(median_s * math.exp(self.sigma * z))

    def submit(self, median_s: float, done: Callable[[bool], None]) -> None:
        self._account()
        self.calls += 1
        b = int(self.loop.now // self.bin_s)
        self.calls_per_bin[b] = self.calls_per_bin.get(b, 0) + 1
        if self.busy < self.workers:
            self.busy += 1
            self.loop.at(self.loop.now + self.service_time(median_s), self._finish, done)
        elif len(self.queue) < self.queue_limit:
            self.queue.append((median_s, done))
        else:
            self.refused += 1
            self.loop.at(self.loop.now, done, False)
            return
        self._mark()

    def _finish(self, done) -> None:
        self._account()
        self.completed += 1
        if self.queue:
            median_s, nxt = self.queue.popleft()
            self.loop.at(self.loop.now + self.service_time(median_s), self._finish, nxt)
        else:
            self.busy -= 1
        done(True)

    def finish_accounting(self) -> None:
        self._account()
