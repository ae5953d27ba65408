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
import threading
from pathlib import Path
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

DEFAULT_METRICS_ADDR = "127.0.0.1"


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
    """One thread per scrape, so a slow client cannot hold the others up."""

    daemon_threads = True


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
