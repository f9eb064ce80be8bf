"""A real HTTP server for the tests, serving a folder as object storage and model hubs do: HEAD, GET with
byte ranges (206), 404 for what is not there, and faults on demand; and a real S3 API server (moto) behind a proxy
that injects faults."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer


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


SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce your '
             b'request rate.</Message></Error>')


class FaultyProxy(BaseHTTPRequestHandler):
    """Forwards GET and HEAD to `server.upstream` (a real S3 API server), with the faults of `FaultyHandler` by
    object path (no query): `failures` answer S3's 503 SlowDown, `cuts` send half of a ranged GET past byte 0 and
    drop the connection. `requests` counts requests by path."""

    protocol_version = "HTTP/1.1"

    def do_HEAD(self):
        self._forward()

    def do_GET(self):
        self._forward()

    def _forward(self):
        import http.client

        server = self.server
        path = self.path.split("?", 1)[0]
        server.requests[path] = server.requests.get(path, 0) + 1
        if server.failures.get(path, 0) > 0:
            server.failures[path] -= 1
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(SLOW_DOWN)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(SLOW_DOWN)
            return
        upstream = http.client.HTTPConnection(*server.upstream, timeout=60)
        try:
            upstream.request(self.command, self.path, headers=dict(self.headers.items()))
            answer = upstream.getresponse()
            body = answer.read()
        finally:
            upstream.close()
        self.send_response(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                self.send_header(name, value)
        length = answer.getheader("Content-Length") if self.command == "HEAD" else str(len(body))
        self.send_header("Content-Length", length or "0")
        self.end_headers()
        if self.command != "GET":
            return
        ranged_past_0 = self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0] not in ("", "0")
        if ranged_past_0 and server.cuts.get(path, 0) > 0:
            server.cuts[path] -= 1
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)

    def handle_one_request(self):
        with contextlib.suppress(ConnectionError):
            super().handle_one_request()

    def log_message(self, *args):
        pass


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def serve_s3():
    """A real S3 API server (moto's server mode) on a free local port, behind a proxy that injects faults. Yields
    (the standard AWS variables that point a client at the proxy, a boto3 client of the server itself for
    uploads, the proxy server with its `failures`, `cuts` and `requests`)."""
    import boto3
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), FaultyProxy)
    proxy.upstream = moto.get_host_and_port()
    proxy.failures, proxy.cuts, proxy.requests = {}, {}, {}
    proxy.daemon_threads = True
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    host, port = moto.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    env = {**S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.server_address[1]}"}
    try:
        yield env, client, proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        moto.stop()


def upload_folder(client, folder, bucket: str, prefix: str) -> list[str]:
    """Every file below `folder` as s3://bucket/prefix/<relative path>; returns the keys."""
    keys = []
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            key = f"{prefix}/{os.path.relpath(path, folder)}"
            client.upload_file(path, bucket, key)
            keys.append(key)
    return keys


@contextlib.contextmanager
def serve_gcs(bucket: str):
    """A Google Cloud Storage API server (gcp-storage-emulator, in memory) with `bucket`, on a free local port,
    behind the fault-injecting proxy. Yields (STORAGE_EMULATOR_HOST pointing at the proxy, at the server itself,
    the proxy)."""
    import socket

    from gcp_storage_emulator.server import create_server

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    emulator = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    emulator.start()
    proxy = ThreadingHTTPServer(("127.0.0.1", 0), FaultyProxy)
    proxy.upstream = ("127.0.0.1", port)
    proxy.failures, proxy.cuts, proxy.requests = {}, {}, {}
    proxy.daemon_threads = True
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{proxy.server_address[1]}", f"http://127.0.0.1:{port}", proxy
    finally:
        proxy.shutdown()
        proxy.server_close()
        emulator.stop()
