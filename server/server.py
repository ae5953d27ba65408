"""The storage server: one device, its controller and I/O entry, served to TCP (or TLS)
clients, a thread per connection; the leases on steps whose client went away, the background
flushes of the power-loss-protected mode, the health figures saved now and then."""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any

from ..emulator import Device, DeviceError
from ..emulator.accounting import LinkTiming
from ..emulator.controller import Controller
from ..emulator.io import DeviceIO
from ..emulator.kinds import AnyNamespace
from ..emulator.namespace import Namespace
from ..model.links import DEFAULT_LINK, LinkModel

from .connection import HANDSHAKE_TIMEOUT_S, Connection
from .param_cache import ParamCache
from .security import token_matches

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
HEALTH_SAVE_INTERVAL_S = 60.0
# TCP keepalive: a peer that vanished without a FIN (node down, link cut) is found within
# idle + interval * count seconds, and its steps go to the lease.
KEEPALIVE = (10, 5, 3)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class Server:
    """Serves `device` on `host`:`port` (0: any free port; `address` says which) until stop().

    `token`: what a client's CONNECT must carry (None: none asked, as with mutual TLS);
    `tls`: a server context (server/security.py) or None for plain TCP; `lease_s`: how long
    a step stays open after the client that had it open disconnects, before it is aborted;
    `param_cache_size`: bytes of committed params kept in memory for reads (0: none).
    """

    def __init__(self, device: Device, host: str, port: int, *, token: bytes | None = None,
                 tls: ssl.SSLContext | None = None, lease_s: float = DEFAULT_LEASE_S,
                 link: str = DEFAULT_LINK, param_cache_size: int = 0) -> None:
        self.device = device
        self.controller = Controller(device)  # no CMB: a client across a network cannot map it
        self.io = DeviceIO(self.controller)
        # Committed params in server memory (server/param_cache.py); 0 bytes: off.
        self.param_cache = ParamCache(param_cache_size)
        self.token = token
        self.tls = tls
        self.lease_s = lease_s
        # The network link's accounting (model/links.py), timed as the device is.
        self.link = LinkTiming(LinkModel.named(link), timed=device.config.timed)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.listener = socket.create_server((host, port), family=family, backlog=128)
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.counters: dict[str, int] = {"connections": 0, "refused": 0, "leases_expired": 0}
        self._lock = threading.Condition()
        self._connections: dict[Connection, threading.Thread] = {}
        self._leases: dict[int, tuple[int, float]] = {}  # nsid -> (step, deadline)
        self._stopping = threading.Event()
        self._work = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ serving

    def serve_forever(self) -> None:
        """Accept connections until stop() (from another thread or a signal handler)."""
        for target, name in ((self._reap_leases, "cossd-leases"), (self._background, "cossd-flush")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        self.listener.settimeout(0.2)  # to see stop() without a wakeup
        while not self._stopping.is_set():
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    break
                raise
            thread = threading.Thread(target=self._serve, args=(sock, f"{peer[0]}:{peer[1]}"),
                                      name=f"cossd-conn-{peer[1]}", daemon=True)
            thread.start()
        self._shutdown()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        _tune(sock)
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                self.refused(peer, f"TLS handshake: {exc}")
                sock.close()
                return
        connection = Connection(self, sock, peer)
        with self._lock:
            if self._stopping.is_set():
                sock.close()
                return
            self._connections[connection] = threading.current_thread()
            self.counters["connections"] += 1
        connection.run()

    def stop(self) -> None:
        """Stop accepting; the serving loop then closes every connection and returns."""
        # Safe in a signal handler: takes no lock (the lease thread sees the flag within 1 s).
        self._stopping.set()
        self._work.set()

    def _shutdown(self) -> None:
        self.listener.close()
        with self._lock:
            connections = dict(self._connections)
        for connection in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in [*connections.values(), *self._threads]:
            thread.join(timeout=30)
        self.controller.close()

    # ------------------------------------------------------------------ what connections report

    def check_token(self, offered: memoryview) -> str | None:
        """Why a CONNECT's token is refused, or None where it is the server's (or none is asked)."""
        if self.token is None:
            return None
        if not len(offered):
            return "no token (give the client token_file= or COSSD_TOKEN_FILE)"
        if not token_matches(offered, self.token):
            return "wrong token"
        return None

    def refused(self, peer: str, why: str) -> None:
        with self._lock:
            self.counters["refused"] += 1
        log.warning("refused %s: %s", peer, why)

    def device_namespace(self, nsid: int) -> AnyNamespace | None:
        try:
            return self.device.namespace_by_id(nsid)
        except DeviceError:
            return None

    def adopt(self, nsid: int) -> None:
        """A client sends gradients to a namespace: a lease held on its step is taken over."""
        with self._lock:
            if self._leases.pop(nsid, None) is not None:
                log.info("namespace %d: the leased step was taken over by a new connection", nsid)

    def after_command(self) -> None:
        self._work.set()

    def disconnected(self, connection: Connection) -> None:
        """The connection ended: each step it had open stays open for the lease."""
        with self._lock:
            self._connections.pop(connection, None)
            for nsid, step in connection.steps.items():
                namespace = self.device_namespace(nsid)
                if isinstance(namespace, Namespace) and namespace.step_open == step:
                    self._leases[nsid] = (step, time.monotonic() + self.lease_s)
                    log.info("%s went away with step %d of namespace %s open: aborted in %g s unless "
                             "a client takes it over", connection.peer, step, namespace.name, self.lease_s)
            self._lock.notify_all()

    # ------------------------------------------------------------------ background work

    def _reap_leases(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                now = time.monotonic()
                due = [(nsid, step) for nsid, (step, deadline) in self._leases.items() if deadline <= now]
                for nsid, _ in due:
                    del self._leases[nsid]
                if not due:
                    wait = min((deadline for _, deadline in self._leases.values()), default=now + 1.0) - now
                    self._lock.wait(timeout=max(0.01, min(wait, 1.0)))
                    continue
            for nsid, step in due:
                namespace = self.device_namespace(nsid)
                if not isinstance(namespace, Namespace) or namespace.step_open != step:
                    continue  # committed or aborted meanwhile
                try:
                    namespace.abort_step()
                except DeviceError as exc:
                    log.warning("namespace %s: aborting step %d after its lease: %s", namespace.name, step, exc)
                    continue
                with self._lock:
                    self.counters["leases_expired"] += 1
                log.warning("namespace %s: the client of step %d went away %g s ago; step aborted (state stays "
                            "at step %d)", namespace.name, step, self.lease_s, namespace.committed_step)

    def _background(self) -> None:
        """Flush committed steps in the background (plp mode, as a mount does after each
        command) and save the health figures every HEALTH_SAVE_INTERVAL_S."""
        saved = time.monotonic()
        while not self._stopping.is_set():
            self._work.wait(timeout=1.0)
            self._work.clear()
            for namespace in list(self.device.namespaces.values()):
                if self.io.flush_wanted(namespace):
                    try:
                        namespace.flush()
                    except Exception:
                        log.exception("background flush of namespace %s failed", namespace.name)
            if time.monotonic() - saved >= HEALTH_SAVE_INTERVAL_S:
                saved = time.monotonic()
                try:
                    self.device.save_health()
                except Exception:
                    log.exception("saving the health figures failed")

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters) | {"open_connections": len(self._connections), "leases": len(self._leases)}
        return counters | {"link": self.link.snapshot(), "param_cache": self.param_cache.snapshot()}
