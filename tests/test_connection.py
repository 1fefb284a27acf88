"""The connection protocol of every ushash server: request heads bounded before the app sees them."""

import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httptools")

from ushash.serving import connection  # noqa: E402


async def _app(scope, receive, send):
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    sock = socket.socket(socket.AF_INET)
    sock.bind(("127.0.0.1", 0))
    cfg = uvicorn.Config(_app, http=connection.PROTOCOL, log_level="critical", lifespan="off",
                         **connection.SERVER_OPTIONS)
    srv = uvicorn.Server(cfg)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield sock.getsockname()
    srv.should_exit = True
    thread.join(10)


def _exchange(addr, data: bytes) -> bytes:
    """Send `data` (its last request closes the connection) and read every answer, to the end."""
    with socket.create_connection(addr, timeout=10) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass                       # the server answered and closed before the rest was sent
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def _request(header_bytes: int, body: bytes = b"", close: bool = True) -> bytes:
    head = (b"POST / HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * header_bytes +
            b"\r\ncontent-length: %d\r\n" % len(body) + (b"connection: close\r\n" if close else b"") + b"\r\n")
    return head + body


def test_a_head_over_the_limit_is_a_431_and_the_connection_closes(server):
    out = _exchange(server, _request(connection.MAX_HEAD_BYTES * 16))
    assert out.startswith(b"HTTP/1.1 431 "), out[:200]
    assert b"headers over" in out


def test_a_head_within_the_limit_and_a_large_body_pass(server):
    near = connection.MAX_HEAD_BYTES - 1024
    assert _exchange(server, _request(near)).startswith(b"HTTP/1.1 200 ")
    body = b"b" * (4 * connection.MAX_HEAD_BYTES)   # the body never counts toward the head
    out = _exchange(server, _request(100, body))
    assert out.startswith(b"HTTP/1.1 200 ") and out.endswith(body)


def test_each_request_of_a_kept_alive_connection_has_its_own_budget(server):
    # three requests, each head at 60 % of the limit, on one connection: 180 % in all, every one answered
    pad = int(connection.MAX_HEAD_BYTES * 0.6)
    out = _exchange(server, _request(pad, close=False) * 2 + _request(pad))
    assert out.count(b"HTTP/1.1 200 ") == 3, out[:300]


def test_the_bound_is_on_whichever_protocol_uvicorn_picks():
    """httptools' protocol (no limit of its own) gets the counting one; h11's bounds heads itself, at the same
    size. Recognised by class, not by name."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    if issubclass(AutoHTTPProtocol, H11Protocol):
        assert connection.SERVER_OPTIONS["h11_max_incomplete_event_size"] == connection.MAX_HEAD_BYTES
    else:
        assert "data_received" in connection.Protocol.__dict__
