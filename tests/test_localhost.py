"""ushash.serving.localhost's bare keep-alive client (the benchmarks' load generator) against a real
uvicorn server on the loopback: status, head and body of each answer, several requests on one connection."""

import asyncio
import json
import socket

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ushash.serving.localhost import Connection, request_bytes


def test_request_bytes_is_one_http_request():
    assert request_bytes("GET", "/healthz") == b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    raw = request_bytes("POST", "/v1/x", b'{"a":1}')
    assert raw == (b"POST /v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 7\r\n\r\n{\"a\":1}")


def test_connection_reads_each_answer_on_one_keep_alive_connection():
    import uvicorn

    app = FastAPI()
    opened = []

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body}, status_code=201 if body.get("created") else 200, headers={"X-Seen": "yes"})

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        conn = await Connection.open(f"http://127.0.0.1:{port}/")
        out = []
        for i, created in enumerate((False, True, False)):
            out.append(await conn.request(request_bytes("POST", "/echo", json.dumps({"i": i, "created": created}).encode())))
        opened.append(len(server.server_state.connections))
        conn.close()
        server.should_exit = True
        await task
        return out

    out = asyncio.run(main())
    assert [status for status, _, _ in out] == [200, 201, 200]
    assert [json.loads(body)["got"]["i"] for _, _, body in out] == [0, 1, 2]
    assert all(head.startswith(b"HTTP/1.1 ") and b"\r\nx-seen: yes\r\n" in head.lower() for _, head, _ in out)
    assert opened == [1]   # the three requests went over the one connection
