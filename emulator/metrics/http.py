"""The Prometheus endpoint over HTTP, with its optional bearer token: bound before the device
opens, shared by both front-ends (the mount's --metrics-port, the server's)."""
from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import socket
import socketserver
import stat
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

from ...protocol.log_limit import LogLimiter

log = logging.getLogger(__name__)

DEFAULT_METRICS_ADDR = "127.0.0.1"
# Connections served at once (a thread each); more are closed at their accept. A scraper
# needs one, a few share an endpoint: peers that open connections and stall (before any
# token is checked) then hold at most this many threads, not one each.
MAX_METRICS_CONNECTIONS = 16
# A failed or turned-away connection is one line of the log at most this often (the next
# line says how many were left out): peers decide how many there are.
FAILURE_LOG_INTERVAL_S = 1.0


class MetricsPortError(RuntimeError):
    """The metrics endpoint could not be bound (port in use, bad address), or its token file
    is unusable."""


# ---------------------------------------------------------------------- access


def load_token(path: str | os.PathLike[str]) -> str:
    """The bearer token in `path`: its text without surrounding white space (Prometheus trims
    a credentials_file the same way). Refused: unreadable, empty, not one line, or readable
    by every user (the token would keep no local user out)."""
    where = Path(path)
    try:
        mode = where.stat().st_mode
        text = where.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MetricsPortError(f"cannot read the metrics token file {where}: {reason}") from None
    if not stat.S_ISREG(mode):
        raise MetricsPortError(f"metrics token file {where} is not a regular file")
    if mode & stat.S_IROTH:
        raise MetricsPortError(f"metrics token file {where} is readable by every user: chmod o-r {where}")
    if not text:
        raise MetricsPortError(f"metrics token file {where} is empty")
    if any(c.isspace() for c in text):
        raise MetricsPortError(f"metrics token file {where} must hold one token, without white space")
    return text


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def require_bearer(app: WsgiApp, token: str) -> WsgiApp:
    """`app` behind `Authorization: Bearer <token>`; any other request answers 401."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):  # in constant time
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="cossd metrics"')])
        return [b"401 Unauthorized: this endpoint needs Authorization: Bearer <token>\n"]

    return guarded


class _QuietHandler(WSGIRequestHandler):
    # A connection that sends nothing is dropped after this long, so that idle connections do
    # not keep threads of the daemon (or server) for ever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds would fill the daemon's (or server's) log


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow client cannot hold the others up; at most
    MAX_METRICS_CONNECTIONS at once. A connection that fails (timed out, reset) is one
    rate-limited line, not the standard library's traceback on stderr."""

    daemon_threads = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)
        self._lock = threading.Lock()
        self.failed = 0  # connections that ended in an error (timed out, reset, bad request)
        self.turned_away = 0  # connections closed at accept: MAX_METRICS_CONNECTIONS were open
        self._failure_log = LogLimiter(log, window_s=FAILURE_LOG_INTERVAL_S)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                self.turned_away += 1
            self._note(f"metrics endpoint: {_peer(client_address)} closed at once: {MAX_METRICS_CONNECTIONS} "
                       "connections are open, its most")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        with self._lock:
            self.failed += 1
        self._note(f"metrics endpoint: {_peer(client_address)}: {type(exc).__name__}: {exc}; connection closed")

    def _note(self, line: str) -> None:
        self._failure_log.warning(line)


def _peer(address: Any) -> str:
    return f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else str(address)


def _serve_http(port: int, addr: str, app: WsgiApp) -> tuple[WSGIServer, threading.Thread]:
    # The address decides the family (an IPv6 address needs AF_INET6).
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsHTTPServer", (_ThreadingServer,), {"address_family": family})
    httpd: WSGIServer = make_server(str(sockaddr[0]), port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="cossd-metrics", daemon=True)
    thread.start()
    return httpd, thread


@dataclasses.dataclass
class MetricsEndpoint:
    """The HTTP endpoint; bound before the device opens, so a busy port starts nothing."""

    addr: str
    port: int
    registry: CollectorRegistry
    httpd: WSGIServer
    thread: threading.Thread
    authenticated: bool = False

    @classmethod
    def bind(cls, port: int, addr: str = DEFAULT_METRICS_ADDR,
             token_file: str | os.PathLike[str] | None = None) -> "MetricsEndpoint":
        """Serve on addr:port; with `token_file`, only to requests that carry its token
        (load_token, require_bearer)."""
        token = load_token(token_file) if token_file is not None else None
        # An empty registry until attach(): a scrape in the few ms before the front-end is
        # ready gets an empty page, never a half-built device.
        registry = CollectorRegistry(auto_describe=False)
        app: WsgiApp = make_wsgi_app(registry)
        if token is not None:
            app = require_bearer(app, token)
        try:
            httpd, thread = _serve_http(port, addr, app)
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise MetricsPortError(f"cannot serve metrics on {addr}:{port}: {reason}") from None
        if token is None:
            log.warning("metrics on http://%s:%d/metrics without authentication: anyone who can reach it "
                        "reads them, namespace names included (--metrics-token-file restricts it)", addr, port)
        else:
            log.info("metrics on http://%s:%d/metrics, bearer token required", addr, port)
        return cls(addr, port, registry, httpd, thread, token is not None)

    def attach(self, collector: Collector) -> None:
        """Serve `collector`'s figures from now on (until then a scrape gets an empty page)."""
        self.registry.register(collector)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
