"""A loopback HTTP server of images, for measuring `url` jobs (the bench and the doctor).

It serves what a CDN would: the bytes, a Content-Length and a strong ETag, and 304 Not
Modified to a matching If-None-Match. Threads serve the requests, so many fetches run at
once as they would against a real host. Paths are registered up front; anything else 404s.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class ImageServer:
    def __init__(self, images: Mapping[str, bytes], host: str = "127.0.0.1") -> None:
        """`images`: path (e.g. `/img/7`) -> encoded bytes (a lazy Mapping will do)."""
        self._images = images
        self._etags: dict[str, str] = {}
        self.not_modified = 0
        self.sent = 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            # Keep-alive, as a CDN: the worker's connection pool reuses connections.
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer._answer(self)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.host = host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gpufeed-image-server", daemon=True
        )

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def start(self) -> ImageServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ImageServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _answer(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path.split("?", 1)[0]
        data = self._images.get(path)
        if data is None:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        etag = self._etags.get(path)
        if etag is None:
            etag = '"' + hashlib.blake2b(data, digest_size=16).hexdigest() + '"'
            self._etags[path] = etag
        if h.headers.get("If-None-Match") == etag:
            with self._lock:
                self.not_modified += 1
            h.send_response(304)
            h.send_header("ETag", etag)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        with self._lock:
            self.sent += 1
        h.send_response(200)
        h.send_header("Content-Type", "image/jpeg")
        h.send_header("Content-Length", str(len(data)))
        h.send_header("ETag", etag)
        h.end_headers()
        h.wfile.write(data)
