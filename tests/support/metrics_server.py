"""A real HTTP server on 127.0.0.1 that answers GET PATH with a fixed text (404 for any other path) and records
every path asked: what SGLang servers' /metrics look like to the e2e harness's readers."""

from __future__ import annotations

import contextlib
import http.server
import threading
from typing import Iterator


@contextlib.contextmanager
def serving(texts: dict[str, str], hits: list[str] | None = None) -> Iterator[str]:
    """Serve `texts` (path -> body) until the block ends; yields the base URL. Every path asked is appended
    to `hits` when given."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if hits is not None:
                hits.append(self.path)
            body = texts.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
