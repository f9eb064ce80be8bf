"""A real HTTP server for the tests, serving a folder as object storage and model hubs do: HEAD, GET with
byte ranges (206), 404 for what is not there, and faults on demand."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


class FaultyHandler(SimpleHTTPRequestHandler):
    """Static files with byte ranges. `server.failures[path] = n`: the next n requests for it answer 503.
    `server.cuts[path] = n`: the next n GETs of it from a byte past 0 send half their bytes and drop the
    connection (a broken transfer in the middle of a file). `server.requests` counts requests by path."""

    def handle_one_request(self):
        with contextlib.suppress(ConnectionError):
            super().handle_one_request()

    def send_head(self):
        server = self.server
        server.requests[self.path] = server.requests.get(self.path, 0) + 1
        if server.failures.get(self.path, 0) > 0:
            server.failures[self.path] -= 1
            self.send_error(503, "Slow Down")
            return None
        wanted = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not wanted or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        first, _, last = wanted.removeprefix("bytes=").partition("-")
        start, end = int(first), min(int(last) if last else size - 1, size - 1)
        if start >= size:
            self.send_error(416, "Range Not Satisfiable")
            return None
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(end - start + 1)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if self.command == "GET" and start > 0 and server.cuts.get(self.path, 0) > 0:
            server.cuts[self.path] -= 1
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return None
        if self.command == "GET":
            self.wfile.write(body)
        return None

    def end_headers(self):
        if not self.headers.get("Range"):
            self.send_header("Accept-Ranges", "bytes")
        super().end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(folder):
    """An HTTP server for `folder` on a free local port: yields (base URL, server)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(FaultyHandler, directory=str(folder)))
    server.failures, server.cuts, server.requests = {}, {}, {}
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server
    finally:
        server.shutdown()
        server.server_close()
