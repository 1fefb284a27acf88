"""Servers started as child processes on the loopback (the tests' and benchmarks' servers, a model
service under the proxy, a throwaway Redis): a free port to give one, waiting until it answers, and a bare
keep-alive connection that sends it prepared request bytes (the benchmarks' load generator).

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ushash.serve", "export=...", f"port={port}"])
    wait_until_up(f"http://127.0.0.1:{port}/healthz", proc)
    conn = await Connection.open(f"http://127.0.0.1:{port}")
    status, head, body = await conn.request(request_bytes("GET", "/healthz"))

    with LocalRedis() as srv:          # redis-server on a free port, answering PING
        cache = SemanticCache(head, {"l2": {"url": srv.url}})
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's choice; another process may take it before it is bound)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until_up(url: str, proc: subprocess.Popen | None = None, seconds: float = 180.0) -> None:
    """Poll `url` until it answers 200; a RuntimeError with the process's last output if `proc` exits first
    (when its output is a pipe), or when `seconds` pass."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout is not None else ""
            out = out.decode(errors="replace") if isinstance(out, bytes) else (out or "")
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode} before answering"
                               + (f": {out[-2000:]}" if out else ""))
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {seconds:g} s")


class LocalRedis:
    """A redis-server child process on the loopback for tests and benchmarks: no persistence, on a free port
    (or `port`), answering PING when the constructor returns. `extra`: more server arguments (a cluster
    node's, a debug command). `url` (database 0), `client` (redis-py), `stop()`; a context manager. A
    FileNotFoundError when redis-server is not on PATH; a RuntimeError when it exits (with its stderr: its log
    is discarded) or does not answer within `seconds`."""

    def __init__(self, *extra: str, port: int | None = None, host: str = "127.0.0.1", seconds: float = 10.0):
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not found on PATH (apt-get install redis-server; ./run test "
                                    "installs it)")
        self.host, self.port = host, int(port) if port else free_port(host)
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", host, "--save", "", "--appendonly",
                                      "no", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.client = redis.Redis(host=host, port=self.port)
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # one try per probe: redis-py's default retries a refused connection with backoff for seconds
        probe = redis.Redis(host=host, port=self.port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + float(seconds)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with code {self.proc.returncode}: "
                                   f"{self.proc.stderr.read().decode(errors='replace')[-500:]}")
            try:
                if probe.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer within {seconds:g} s")
                time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        self.proc.stderr.close()

    def __enter__(self) -> "LocalRedis":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Connection:
    """One keep-alive HTTP/1.1 connection sending prepared request bytes and reading each response by its
    Content-Length: the same few microseconds of client work for every request, so that the server, not the
    client, sets the rate and the latency (an httpx client spends 0.5-1 ms of CPU per request, more than
    the server's work on a small one, and more for a JSON POST than for a GET)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> "Connection":
        host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(port)))

    async def request(self, raw: bytes) -> tuple[int, bytes, bytes]:
        """Send one request; returns the response's status code, its head (status line and headers, as
        sent) and its body."""
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = None
        for line in head.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
                break
        if length is None:
            raise RuntimeError(f"response without Content-Length: {head[:200]!r}")
        return int(head[9:12]), head, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def request_bytes(method: str, path: str, body: bytes = b"", host: str = "127.0.0.1") -> bytes:
    """The bytes of one keep-alive request (a JSON body when given)."""
    head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
    if body:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def run_loop(coro):
    """asyncio.run on uvloop where it is installed (as the servers run)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
