"""Servers started as child processes on the loopback (the tests' and benchmarks' servers, a model
service under the proxy): a free port to give one, and waiting until it answers.

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ushash.serve", "export=...", f"port={port}"])
    wait_until_up(f"http://127.0.0.1:{port}/healthz", proc)
"""

from __future__ import annotations

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
