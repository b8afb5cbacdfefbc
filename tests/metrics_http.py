"""A real HTTP `/metrics` endpoint over a render function, for tests that scrape metrics without the app."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve_metrics(render: Callable[[], bytes], token: str | None = None) -> Iterator[str]:
    """Serve `render()` (a Prometheus exposition) on every GET; yields `host:port` on loopback. With
    `token`, as the app does with a metrics token: only requests with `Authorization: Bearer <token>`
    get it, the others a 401."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if token is not None and not hmac.compare_digest(
                    self.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
                self.send_response(401)
                self.send_header("WWW-Authenticate", "Bearer")
                self.end_headers()
                return
            body = render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
