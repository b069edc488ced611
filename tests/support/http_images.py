"""A real HTTP server on loopback for the `url` tests, with the misbehaviours they need.

Routes (GET):
    /img/NAME          the image registered as NAME, with an ETag; 304 to If-None-Match
    /status/CODE       an empty answer with that status
    /flaky/NAME        500 on the first request for NAME, then the image
    /hang              accepts, reads the request, never answers (until the server stops)
    /endless           200 without a length, then bytes until the client goes away
    /redirect?to=URL   302 to URL
    /held/NAME         waits until the test releases NAME, then the image
    /trickle           200 announcing 1 MiB, then one byte every TRICKLE_S until the server stops

`keep_alive=True` answers in HTTP/1.1 and keeps connections open between requests, as a
CDN does (the default, HTTP/1.0, closes each one).

Every request is counted by path; `conditional` counts those answered 304.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

ENDLESS_CAP = 256 * 1024 * 1024  # bounded: even an endless body stops somewhere
TRICKLE_S = 0.5


class _Server(ThreadingHTTPServer):
    # Above http.server's 5: many connections opened at once would otherwise see their
    # SYNs dropped and retried a second later.
    request_queue_size = 128


class ImageServer:
    def __init__(self, host: str = "127.0.0.1", *, keep_alive: bool = False) -> None:
        self.images: dict[str, bytes] = {}
        self.hits: Counter[str] = Counter()
        self.conditional = 0
        self.stopping = threading.Event()
        self._held: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def do_GET(self) -> None:
                outer._handle(self)

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = _Server((host, 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def start(self) -> ImageServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for event in self._held.values():
            event.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def hold(self, name: str) -> None:
        self._held[name] = threading.Event()

    def release(self, name: str) -> None:
        self._held[name].set()

    # ------------------------------------------------------------------ routes
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        path = parts.path
        with self._lock:
            self.hits[path] += 1
            nth = self.hits[path]
        if path.startswith("/img/"):
            self._image(h, path[5:])
        elif path.startswith("/status/"):
            self._empty(h, int(path[8:]))
        elif path.startswith("/flaky/"):
            if nth == 1:
                self._empty(h, 500)
            else:
                self._image(h, path[7:])
        elif path == "/hang":
            self.stopping.wait(30)
        elif path == "/endless":
            self._endless(h)
        elif path == "/trickle":
            self._trickle(h)
        elif path == "/redirect":
            target = parse_qs(parts.query).get("to", [""])[0]
            h.send_response(302)
            h.send_header("Location", target)
            h.send_header("Content-Length", "0")
            h.end_headers()
        elif path.startswith("/held/"):
            name = path[6:]
            self._held[name].wait(30)
            self._image(h, name)
        else:
            self._empty(h, 404)

    def _image(self, h: BaseHTTPRequestHandler, name: str) -> None:
        data = self.images.get(name)
        if data is None:
            self._empty(h, 404)
            return
        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
        if h.headers.get("If-None-Match") == etag:
            with self._lock:
                self.conditional += 1
            h.send_response(304)
            h.send_header("ETag", etag)
            h.end_headers()
            return
        h.send_response(200)
        h.send_header("Content-Type", "image/jpeg")
        h.send_header("Content-Length", str(len(data)))
        h.send_header("ETag", etag)
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _empty(h: BaseHTTPRequestHandler, status: int) -> None:
        h.send_response(status)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def _trickle(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/jpeg")
        h.send_header("Content-Length", str(1024 * 1024))
        h.end_headers()
        try:
            while not self.stopping.wait(TRICKLE_S):
                h.wfile.write(b"\xff")
                h.wfile.flush()
        except OSError:
            return

    def _endless(self, h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "image/jpeg")
        h.end_headers()
        chunk = b"\xff" * 65536
        sent = 0
        try:
            while sent < ENDLESS_CAP and not self.stopping.is_set():
                h.wfile.write(chunk)
                sent += len(chunk)
        except OSError:
            return  # the client stopped reading: what the test wants
