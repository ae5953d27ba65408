"""The storage server: one device, its controller and I/O entry, served to TCP (or TLS)
clients, a thread per connection; the leases on steps whose client went away, the background
flushes of the power-loss-protected mode, the health figures saved now and then."""
from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time
from typing import Any

from ..emulator.face import AnyNamespace, Controller, Device, DeviceError, LinkTiming, LogLimiter, Namespace
from ..model.links import DEFAULT_LINK, LinkModel
from ..protocol import logpages
from ..protocol.logpages import SERVER_REFUSALS, LogId

from .connection import Connection, PreAuth
from .param_cache import ParamCache
from .recv_memory import DEFAULT_RECV_MEMORY, DEFAULT_RECV_WAIT_S, RecvMemory
from .security import token_matches

log = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_CONNECTIONS = 64
# Connections that have not authenticated yet (from accept to their CONNECT's answer), held
# apart from --max-connections: unauthenticated peers never take an authenticated place.
# Each is a thread, a socket and at most PREAUTH_MAX_DATA bytes of capsule data; when all
# are held, the one that has waited longest is closed to let the new one in, so peers that
# trickle their handshake cannot keep a token holder out.
DEFAULT_MAX_PREAUTH = 256
# The whole handshake (TLS, ICReq, CONNECT) must be done within this many seconds of the
# accept, on the monotonic clock, whatever the peer's pace (a per-recv timeout alone lets a
# peer that sends a byte every few seconds hold its place forever).
DEFAULT_HANDSHAKE_DEADLINE_S = 10.0
# How often the accept loop looks for handshakes past their deadline (the deadline's grain).
DEADLINE_SWEEP_S = 0.1
# Lines about what peers did (refusals, stalled readers, failed accepts) logged a second at
# most: a flood is counted in full but does not fill the disk; the next line logged says how
# many were left out.
REFUSAL_LOG_PER_S = 20
# An authenticated connection's send that makes no progress for this long (the peer stopped
# reading: a stopped or wedged process, its kernel still acking with a zero window, so
# keepalive never fires) ends the connection, and what it holds (a READ's pin on the
# committed copy, which the next commit waits for) is let go.
DEFAULT_SEND_TIMEOUT_S = 30.0
# accept() errors that say the process or the system is out of something (descriptors,
# buffers, memory): peers must not end the server this way, so it backs off this long (other
# connections close meanwhile, the handshake deadline frees their descriptors) and goes on.
ACCEPT_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_S = 0.1
# Failed accepts come in runs (one a back-off while the descriptors are out): one line a
# second at most, saying how many failed since the last.
ACCEPT_LOG_INTERVAL_S = 1.0
# accept() errors that are a pending connection's own (Linux passes its network errors on
# from accept(2), which says to retry): that connection is gone, the next one is served.
ACCEPT_PEER_GONE = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
                              errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                              errno.ENETUNREACH, errno.EPERM})
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


def _shut(fd: int) -> None:
    """Shut a socket down by descriptor (wakes the thread blocked in its recv; the thread
    closes it). The caller holds the server's lock, under which the descriptor stays open."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.detach()


class Server:
    """Serves `device` on `host`:`port` (0: any free port; `address` says which) until stop().

    `token`: what a client's CONNECT must carry (None: none asked, as with mutual TLS);
    `tls`: a server context (server/security.py) or None for plain TCP; `lease_s`: how long
    a step stays open after the client that had it open disconnects, before it is aborted;
    `param_cache_size`: bytes of committed params kept in memory for reads (0: none);
    `max_connections`: authenticated connections served at once (0: no limit), more are
    refused at their CONNECT; `max_preauth`: connections not yet authenticated at once (the
    longest waiting is closed for a new one); `handshake_deadline_s`: the time from accept to
    an answered CONNECT; `recv_memory`: bytes all connections' receive buffers may hold at
    once, waited for up to `recv_wait_s` (server/recv_memory.py); `send_timeout_s`: how long
    a send to an authenticated peer may make no progress before its connection is closed.
    """

    def __init__(self, device: Device, host: str, port: int, *, token: bytes | None = None,
                 tls: ssl.SSLContext | None = None, lease_s: float = DEFAULT_LEASE_S,
                 link: str = DEFAULT_LINK, param_cache_size: int = 0,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, recv_memory: int = DEFAULT_RECV_MEMORY,
                 recv_wait_s: float = DEFAULT_RECV_WAIT_S, max_preauth: int = DEFAULT_MAX_PREAUTH,
                 handshake_deadline_s: float = DEFAULT_HANDSHAKE_DEADLINE_S,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        if max_preauth < 1:
            raise ValueError(f"max_preauth must be >= 1, got {max_preauth}")
        if not handshake_deadline_s > 0:
            raise ValueError(f"handshake_deadline_s must be > 0, got {handshake_deadline_s}")
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s must be > 0, got {send_timeout_s}")
        self.device = device
        self.controller = Controller(device)  # no CMB: a client across a network cannot map it
        # The server's own log page (C5h), served by this controller only: a mount has none.
        self.controller.log_pages[LogId.SERVER] = lambda _command: logpages.encode_server_log(self.figures())
        self.max_connections = max_connections
        self.max_preauth = max_preauth
        self.handshake_deadline_s = handshake_deadline_s
        self.send_timeout_s = send_timeout_s
        self.recv_memory = RecvMemory(recv_memory, recv_wait_s)
        self.started_ns = time.time_ns()
        self.io = self.controller.io  # the device's one I/O entry (emulator/io.py)
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
        self.counters: dict[str, int] = {"connections": 0, "refused": 0, "leases_expired": 0,
                                         "send_timeouts": 0, "accept_errors": 0}
        self.refusals: dict[str, int] = dict.fromkeys(SERVER_REFUSALS, 0)
        self._places = 0  # authenticated connections until they close (the --max-connections count)
        # Unauthenticated connections, oldest first (insertion order), closed ones included
        # until their thread ends; and how they ended where the server ended them.
        self._preauth: dict[PreAuth, None] = {}
        self._preauth_waiting = 0  # those not closed yet: what --max-preauth-connections bounds
        self.preauth_counters = {"peak": 0, "deadline": 0, "evicted": 0, "too_large": 0}
        self._peer_log = LogLimiter(log, per_window=REFUSAL_LOG_PER_S)
        self._accept_log = LogLimiter(log, window_s=ACCEPT_LOG_INTERVAL_S)
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
        self.listener.settimeout(DEADLINE_SWEEP_S)  # to see stop() and the deadlines without a wakeup
        while not self._stopping.is_set():
            self._close_overdue()
            try:
                sock, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    break
                if exc.errno not in ACCEPT_EXHAUSTED and exc.errno not in ACCEPT_PEER_GONE:
                    raise  # the listener itself is broken: nothing to serve with
                self._accept_failed(exc, backoff=exc.errno in ACCEPT_EXHAUSTED)
                continue
            name = f"{peer[0]}:{peer[1]}"
            record = self._admit(sock, name)
            thread = threading.Thread(target=self._serve, args=(sock, name, record),
                                      name=f"cossd-conn-{peer[1]}", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:  # no thread to be had: as a failed accept, this peer closed
                with self._lock:
                    self._leave_preauth(record)
                sock.close()
                self._accept_failed(exc, backoff=True)
        self._shutdown()

    def _accept_failed(self, exc: BaseException, *, backoff: bool) -> None:
        """A connection could not be taken in (descriptors, memory or threads ran out, or
        the peer went first): counted, logged (rate-limited), and, where the process is out
        of something, a pause before the next accept rather than a spin or an exit."""
        with self._lock:
            self.counters["accept_errors"] += 1
            waiting, connections = self._preauth_waiting, len(self._connections)
        why = f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})" \
            if isinstance(exc, OSError) and exc.errno else str(exc)
        self._accept_log.warning(f"accepting a connection failed: {why}, with {connections} connections "
                                 f"authenticated and {waiting} waiting to; accepts go on"
                                 + (f" after a {ACCEPT_BACKOFF_S:g} s pause" if backoff else ""))
        if backoff:
            self._stopping.wait(ACCEPT_BACKOFF_S)

    def _admit(self, sock: socket.socket, peer: str) -> PreAuth:
        """A new connection's place among the unauthenticated, with its deadline; where all
        are held, the one that has waited longest is closed for it."""
        record = PreAuth(peer, sock.fileno(), time.monotonic() + self.handshake_deadline_s)
        with self._lock:
            if self._preauth_waiting >= self.max_preauth:
                oldest = next(r for r in self._preauth if r.closed_for is None)
                self.preauth_counters["evicted"] += 1
                self._close_preauth(oldest, f"closed before its CONNECT: {self.max_preauth} connections were "
                                            "waiting to authenticate (--max-preauth-connections) and this one "
                                            "the longest")
            self._preauth[record] = None
            self._preauth_waiting += 1
            self.preauth_counters["peak"] = max(self.preauth_counters["peak"], self._preauth_waiting)
        return record

    def _close_preauth(self, record: PreAuth, why: str) -> None:
        """(Under the lock.) End an unauthenticated connection: its thread, woken by the
        shutdown, reports `why` as its refusal and closes the socket."""
        record.closed_for = why
        self._preauth_waiting -= 1
        _shut(record.fd)

    def _close_overdue(self) -> None:
        """Close each connection whose handshake and CONNECT are not done by its deadline."""
        now = time.monotonic()
        with self._lock:
            for record in self._preauth:
                if record.deadline > now:
                    break  # oldest first, and every deadline is accept + the same span
                if record.closed_for is None:
                    self.preauth_counters["deadline"] += 1
                    self._close_preauth(record, f"no CONNECT within {self.handshake_deadline_s:g} s of its "
                                                "accept (--handshake-deadline-s): closed")

    def authenticated(self, record: PreAuth, connection: Connection) -> str | None:
        """The connection's CONNECT passed the token check: it leaves the unauthenticated and
        takes an authenticated place. None where it did; else why not (the server is full,
        or stopping), the text the peer is told."""
        with self._lock:
            self._leave_preauth(record)
            if record.closed_for is not None:
                return record.closed_for  # its deadline came as it authenticated: closed already
            if self._stopping.is_set():
                return "the server is stopping"
            if self.max_connections and self._places >= self.max_connections:
                return (f"the server has {self.max_connections} connections open, its most "
                        "(--max-connections); try again later")
            self._places += 1
            connection.placed = True
            self._connections[connection] = threading.current_thread()
            self.counters["connections"] += 1
            return None

    def _leave_preauth(self, record: PreAuth) -> None:
        """(Under the lock.) The record leaves the unauthenticated, once."""
        if record in self._preauth:
            del self._preauth[record]
            if record.closed_for is None:
                self._preauth_waiting -= 1

    def count_preauth(self, counter: str) -> None:
        with self._lock:
            self.preauth_counters[counter] += 1

    def _serve(self, sock: socket.socket, peer: str, record: PreAuth) -> None:
        connection: Connection | None = None
        try:
            _tune(sock)
            # Each recv of the handshake waits at most the whole deadline; the accept loop
            # closes the connection at the deadline itself, whatever its pace.
            sock.settimeout(self.handshake_deadline_s)
            if self.tls is not None:
                try:
                    # The handshake by hand: a failed one inside wrap_socket would close the
                    # descriptor while the deadline sweep may still shut it down by number.
                    sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                    sock.do_handshake()
                except (ssl.SSLError, OSError) as exc:
                    if record.closed_for is not None:
                        self.refused(peer, "handshake", record.closed_for)
                    else:
                        self.refused(peer, "tls", f"TLS handshake: {exc}")
                    return
            connection = Connection(self, sock, peer, record)
            connection.run()
        except OSError as exc:  # the socket failed before the connection ran
            self.refused(peer, "handshake", record.closed_for or f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                # Out of the unauthenticated before the socket closes: the deadline sweep
                # shuts sockets down by descriptor, which must still be this connection's.
                self._leave_preauth(record)
                if connection is not None and connection.placed:
                    self._places -= 1
            try:
                sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        """Stop accepting; the serving loop then closes every connection and returns."""
        # Safe in a signal handler: takes no lock (the lease thread sees the flag within 1 s).
        self._stopping.set()
        self._work.set()

    def _shutdown(self) -> None:
        self.listener.close()
        with self._lock:
            connections = dict(self._connections)
            for record in list(self._preauth):
                if record.closed_for is None:
                    self._close_preauth(record, "the server is stopping")
        for connection in connections:
            try:
                connection.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in [*connections.values(), *self._threads]:
            thread.join(timeout=30)
        self.controller.close()

    # ------------------------------------------------------------------ what connections report

    def check_token(self, offered: memoryview) -> tuple[str, str] | None:
        """(reason, why) a CONNECT's token is refused, or None where it is the server's (or
        none is asked)."""
        if self.token is None:
            return None
        if not len(offered):
            return "no_token", "no token (give the client token_file= or COSSD_TOKEN_FILE)"
        if not token_matches(offered, self.token):
            return "wrong_token", "wrong token"
        return None

    def refused(self, peer: str, reason: str, why: str) -> None:
        """A connection turned away: counted in all and under `reason` (SERVER_REFUSALS)."""
        with self._lock:
            self.counters["refused"] += 1
            self.refusals[reason] += 1
        self._limited_warning(f"refused {peer}: {why}")

    def send_timed_out(self, peer: str, why: str) -> None:
        """An authenticated peer stopped reading its answers: its connection is closed."""
        with self._lock:
            self.counters["send_timeouts"] += 1
        self._limited_warning(f"{peer}: {why}; closing the connection (--send-timeout-s)")

    def _limited_warning(self, line: str) -> None:
        """Log `line` unless REFUSAL_LOG_PER_S lines were logged this second already (peers
        decide how many such lines there are); the next one logged says how many were not."""
        self._peer_log.warning(line)

    def device_namespace(self, nsid: int) -> AnyNamespace | None:
        try:
            return self.device.namespace_by_id(nsid)
        except DeviceError:
            return None

    def _optimizer_namespace(self, nsid: int) -> Namespace | None:
        """Namespace `nsid` where it is an optimizer one (the kind that has steps), else None."""
        namespace = self.device_namespace(nsid)
        return None if namespace is None else namespace.as_optimizer()

    def adopt(self, nsid: int) -> None:
        """A client sends gradients to a namespace: a lease held on its open step ends, and the
        step goes on with this client."""
        with self._lock:
            lease = self._leases.pop(nsid, None)
        namespace = self._optimizer_namespace(nsid)
        if lease is not None and namespace is not None and namespace.step_open == lease[0]:
            log.info("namespace %s: step %d, left open by a client that went away, goes on with a new "
                     "connection's gradients (not aborted)", namespace.name, lease[0])

    def step_ended(self, nsid: int, how: str) -> None:
        """A client committed or aborted (`how`) a namespace's step: a lease held on it ends.
        Logged in the word the client used, as the trainer reports it."""
        with self._lock:
            lease = self._leases.pop(nsid, None)
        if lease is not None:
            namespace = self.device_namespace(nsid)
            name = namespace.name if namespace is not None else str(nsid)
            log.info("namespace %s: step %d, left open by a client that went away, %s by a new connection",
                     name, lease[0], how)

    def after_command(self) -> None:
        self._work.set()

    def disconnected(self, connection: Connection) -> None:
        """The connection ended: each step it had open stays open for the lease."""
        with self._lock:
            self._connections.pop(connection, None)
            for nsid, step in connection.steps.items():
                namespace = self._optimizer_namespace(nsid)
                if namespace is not None and namespace.step_open == step:
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
                namespace = self._optimizer_namespace(nsid)
                if namespace is None or namespace.step_open != step:
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
            counters = dict(self.counters) | {"open_connections": len(self._connections), "leases": len(self._leases),
                                              "max_connections": self.max_connections,
                                              "send_timeout_s": self.send_timeout_s,
                                              "refusals": dict(self.refusals),
                                              "preauth": dict(self.preauth_counters) | {
                                                  "open": self._preauth_waiting, "max": self.max_preauth,
                                                  "deadline_s": self.handshake_deadline_s}}
        return counters | {"link": self.link.snapshot(), "param_cache": self.param_cache.snapshot(),
                           "recv_memory": self.recv_memory.snapshot()}

    def figures(self) -> dict[str, int]:
        """The server's figures under the names of its log page (protocol/logpages.py's
        SERVER_LOG_FIELDS), which its Prometheus metrics (server/metrics.py) read too."""
        state = self.snapshot()
        link, cache, memory = state["link"], state["param_cache"], state["recv_memory"]
        return {
            "connections_open": state["open_connections"], "connections_total": state["connections"],
            "max_connections": self.max_connections, "refused_total": state["refused"],
            **{f"refused_{reason}": count for reason, count in state["refusals"].items()},
            "leases_open": state["leases"], "leases_expired": state["leases_expired"],
            "link_commands": link["commands"], "link_bytes_in": link["net_in_bytes"],
            "link_bytes_out": link["net_out_bytes"], "link_pdus_in": link["messages_in"],
            "link_pdus_out": link["messages_out"], "link_wire_ns": link["wire_ns"],
            "recv_memory_bytes": memory["capacity"], "recv_held_bytes": memory["held"],
            "recv_peak_bytes": memory["peak"], "recv_waits": memory["waits"],
            "recv_refused_too_large": memory["refused_too_large"], "recv_refused_timeout": memory["refused_timeout"],
            "recv_streamed_writes": memory["streamed_writes"], "recv_idle_releases": memory["idle_releases"],
            "cache_capacity": cache["capacity"], "cache_bytes": cache["bytes"], "cache_namespaces": cache["namespaces"],
            **{f"cache_{key}": cache[key] for key in ("hits", "misses", "fills", "hit_bytes", "fill_bytes",
                                                      "too_large", "invalidated")},
            "cache_evictions": cache["evicted"], "started_ns": self.started_ns,
            "send_timeouts": state["send_timeouts"], "accept_errors": state["accept_errors"],
        }
