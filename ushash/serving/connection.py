"""The HTTP connection protocol every ushash server runs under uvicorn (`ushash.serve`, `ushash.proxy`, the
model service): uvicorn's own (httptools, or h11 where httptools is missing), with two changes.

- TCP_NODELAY on each connection. A worker accepts on the socket uvicorn's parent bound, made as
  socket.socket(AF_INET) with protocol 0, and asyncio sets TCP_NODELAY only on sockets whose protocol reads
  IPPROTO_TCP: without this, every keep-alive response (headers and body written apart) waited ~40 ms for a
  delayed ACK (Nagle).
- The request line and headers are bounded (`MAX_HEAD_BYTES`), before any of it reaches the app or the
  token check: uvicorn's httptools protocol has no such limit, and one 100 MB header cost 8 s of CPU and
  200 MB of memory. Over the limit the client gets a 431 and the connection is closed. uvicorn's h11 protocol
  has its own limit (h11_max_incomplete_event_size), which `SERVER_OPTIONS` sets to the same number.

uvicorn.run(app, http=PROTOCOL, **SERVER_OPTIONS, ...). The class is made on first use, so that importing this
module does not import uvicorn.
"""

from __future__ import annotations

import functools

MAX_HEAD_BYTES = 64 * 1024   # request line + headers; nginx's default large_client_header_buffers is 4 x 8 KB
PROTOCOL = "ushash.serving.connection:Protocol"
SERVER_OPTIONS = {"h11_max_incomplete_event_size": MAX_HEAD_BYTES}
_TOO_LARGE = (b"request line and headers over %d bytes; send shorter headers (a large value belongs in the body)"
              % MAX_HEAD_BYTES)


@functools.lru_cache(maxsize=None)
def _protocol():
    import socket

    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.h11_impl import H11Protocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:   # httptools not installed: uvicorn's auto protocol is h11's
        HttpToolsProtocol = None
    bounded = HttpToolsProtocol is not None and issubclass(AutoHTTPProtocol, HttpToolsProtocol)
    if not bounded and not issubclass(AutoHTTPProtocol, H11Protocol):   # h11 bounds heads itself (SERVER_OPTIONS)
        raise RuntimeError(f"uvicorn's HTTP protocol {AutoHTTPProtocol.__name__} is neither httptools' nor h11's: "
                           f"the request-head bound of ushash.serving.connection cannot be applied to it")

    class Protocol(AutoHTTPProtocol):
        def connection_made(self, transport):
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)

        if bounded:
            _head_bytes, _in_head = 0, True   # of the request being read (each connection's own once counted)

            def data_received(self, data: bytes) -> None:
                if self._in_head:
                    self._head_bytes += len(data)
                super().data_received(data)
                # checked after the parser has had the bytes: a request whose headers end within this read is
                # never refused for the body that came with them (at most one read past the limit is held)
                if self._in_head and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                    self.logger.warning("request head over %d bytes: 431", MAX_HEAD_BYTES)
                    self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                         b"content-type: text/plain; charset=utf-8\r\n"
                                         b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                                         % (len(_TOO_LARGE), _TOO_LARGE))
                    self.transport.close()

            def on_headers_complete(self) -> None:
                self._in_head = False
                super().on_headers_complete()

            def on_message_complete(self) -> None:
                super().on_message_complete()
                self._head_bytes, self._in_head = 0, True   # the next request on this connection

    return Protocol


def __getattr__(name):
    if name == "Protocol":
        return _protocol()
    raise AttributeError(name)
