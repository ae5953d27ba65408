"""`cossd serve BACKING --listen HOST:PORT`: the storage server's verb (its options, the
foreground server, and the background start that returns once it listens, as `cossd mount`
does). `python -m cossd.server.command ...` runs it without the CLI."""
from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from ..emulator.face import (SUPERBLOCK_FILE, BackingDirectory, Device, DeviceConfig, DeviceError, Status,
                             raise_descriptor_limit)
from ..emulator.metrics.http import DEFAULT_METRICS_ADDR, MetricsEndpoint, MetricsPortError, load_token
from ..kernels import guard
from ..model.links import DEFAULT_LINK, LINKS, load_link
from ..model.profiles import DEFAULT_PROFILE, PROFILES, load_profile

from .metrics import ServerCollector
from .recv_memory import DEFAULT_RECV_MEMORY, DEFAULT_RECV_WAIT_S, MIN_RECV_MEMORY
from .security import SecurityError, check_listen, load_token as load_client_token, server_tls_context
from .server import (DEFAULT_HANDSHAKE_DEADLINE_S, DEFAULT_LEASE_S, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PREAUTH,
                     DEFAULT_SEND_TIMEOUT_S, Server)

log = logging.getLogger("cossd.server.command")  # also when run as __main__

READY_PREFIX = b"ready "
DEFAULT_LISTEN = "127.0.0.1:4420"  # NVMe/TCP's port, loopback only


def parse_listen(text: str) -> tuple[str, int]:
    """HOST:PORT ([v6]:PORT); port 0 takes any free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {port!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {port!r} (0-65535)")
    return host, number


def parse_cache_size(text: str) -> int:
    """A cache size in bytes: '0', '512M', '4G' (binary multiples; K, M, G, T)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = (text[:-1], units[text[-1].upper()]) if text[-1:].upper() in units else (text, 1)
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 0, 512M, 4G)")
    return int(number) * unit


def parse_memory_size(text: str) -> int:
    """A receive-memory budget: a size as parse_cache_size takes it, at least 32 MiB (a
    streamed WRITE's slot is one H2CData PDU, up to 16 MiB)."""
    value = parse_cache_size(text)
    if value < MIN_RECV_MEMORY:
        raise argparse.ArgumentTypeError(f"at least 32M: {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _at_least_one(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (1-65535)")
    return value


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("backing", type=Path, help="backing directory of a formatted device")
    parser.add_argument("--listen", type=parse_listen, default=parse_listen(DEFAULT_LISTEN), metavar="HOST:PORT",
                        help=f"address to serve on (default: {DEFAULT_LISTEN}; port 0: any free one). Off loopback, "
                             "TLS is required unless --insecure")
    parser.add_argument("--token-file", metavar="FILE",
                        help="clients must present this token (FILE's one word, not readable by every user) in "
                             "their CONNECT; clients read it from token_file= or $COSSD_TOKEN_FILE")
    parser.add_argument("--tls-cert", metavar="PEM", help="the server's TLS certificate (chain)")
    parser.add_argument("--tls-key", metavar="PEM", help="the server certificate's private key")
    parser.add_argument("--client-ca", metavar="PEM",
                        help="require client certificates signed by this CA (mutual TLS)")
    parser.add_argument("--insecure", action="store_true",
                        help="allow serving without any client check, or plain TCP off loopback")
    parser.add_argument("--lease-s", type=_positive, default=DEFAULT_LEASE_S, metavar="S",
                        help="how long a step stays open after its client disconnects before it is aborted "
                             "(default: %(default)s)")
    parser.add_argument("--param-cache-size", type=parse_cache_size, default=0, metavar="SIZE",
                        help="keep each optimizer namespace's committed params in server memory, up to SIZE "
                             "bytes in all (K/M/G suffixes), so param reads by many clients skip the media "
                             "(default: 0, off)")
    parser.add_argument("--max-connections", type=_count, default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                        help="authenticated connections served at once; more are refused at their CONNECT "
                             "with CONNECT_CONTROLLER_BUSY, logged and counted (default: %(default)s; 0: no limit). "
                             "Connections not yet authenticated do not count (--max-preauth-connections)")
    parser.add_argument("--max-preauth-connections", type=_at_least_one, default=DEFAULT_MAX_PREAUTH, metavar="N",
                        help="connections not yet authenticated (handshake and CONNECT under way) held at once; "
                             "when all N are held, the one that has waited longest is closed for a new one "
                             "(default: %(default)s)")
    parser.add_argument("--handshake-deadline-s", type=_positive, default=DEFAULT_HANDSHAKE_DEADLINE_S, metavar="S",
                        help="a connection's TLS handshake, ICReq and CONNECT must be done within S seconds of its "
                             "accept, else it is closed, logged and counted (default: %(default)s)")
    parser.add_argument("--send-timeout-s", type=_positive, default=DEFAULT_SEND_TIMEOUT_S, metavar="S",
                        help="an authenticated client that reads nothing of an answer for S seconds (a stopped or "
                             "wedged process) is disconnected, logged and counted, and what its command held (a "
                             "READ's hold on the committed step, which the next commit waits for) is let go "
                             "(default: %(default)s)")
    parser.add_argument("--recv-memory", type=parse_memory_size, default=DEFAULT_RECV_MEMORY, metavar="SIZE",
                        help="memory all connections' WRITE buffers may hold at once (K/M/G suffixes, at least "
                             "32M): gradient WRITEs from 4 MiB are received in pieces of at most 2 x 16 MiB, "
                             "others whole; a WRITE that does not fit waits (--recv-wait-s), one larger than "
                             "SIZE is refused (default: 2G, the largest WRITE the wire allows)")
    parser.add_argument("--recv-wait-s", type=_positive, default=DEFAULT_RECV_WAIT_S, metavar="S",
                        help="how long a WRITE waits for receive memory before it is refused with "
                             "COMMAND_INTERRUPTED (EAGAIN; nothing written) (default: %(default)s)")
    parser.add_argument("--metrics-port", type=_port, metavar="N",
                        help="serve Prometheus metrics (the device's and the server's; docs/metrics.md) on this "
                             "TCP port. Unauthenticated unless --metrics-token-file is given")
    parser.add_argument("--metrics-addr", default=DEFAULT_METRICS_ADDR, metavar="ADDR",
                        help="address the metrics endpoint listens on (default: 127.0.0.1, loopback only)")
    parser.add_argument("--metrics-token-file", metavar="FILE",
                        help="require 'Authorization: Bearer TOKEN' on every metrics request, TOKEN being FILE's "
                             "content (not readable by every user); needs --metrics-port")
    parser.add_argument("--foreground", action="store_true", help="serve in this process until signalled")
    parser.add_argument("--sync", action="store_true",
                        help="flush every commit before acknowledging it (default: power-loss-protected mode)")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE.json",
                        help=f"device profile of the timing model: {', '.join(PROFILES)}, or a JSON file "
                             f"(default: {DEFAULT_PROFILE})")
    parser.add_argument("--timed", action="store_true",
                        help="complete file I/O and step commands no earlier than their modeled device time")
    parser.add_argument("--verify", choices=("background", "open"), default="background",
                        help="when the device verifies each namespace's committed step: 'background' "
                             "(default) serves params at once, each param block checked as first read, the "
                             "rest in a thread before any step; 'open' checks everything before serving "
                             "(as `cossd mount --verify`)")
    parser.add_argument("--link", default=DEFAULT_LINK, metavar="NAME|FILE.json",
                        help=f"network link of the timing model (accounted per command; with --timed, honoured): "
                             f"{', '.join(LINKS)}, or a JSON file (default: {DEFAULT_LINK}; docs/timing-model.md)")
    parser.add_argument("--log-file", type=Path, help="server log (default: BACKING/server.log)")
    parser.add_argument("--debug", action="store_true", help="log at debug level")
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def _security(args: argparse.Namespace) -> tuple[bytes | None, object]:
    """The token and TLS context the options name, or SystemExit with a one-line reason."""
    try:
        if bool(args.tls_cert) != bool(args.tls_key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if args.client_ca and not args.tls_cert:
            raise SecurityError("--client-ca needs TLS (--tls-cert, --tls-key)")
        token = load_client_token(args.token_file) if args.token_file else None
        tls = server_tls_context(args.tls_cert, args.tls_key, args.client_ca) if args.tls_cert else None
        check_listen(args.listen[0], tls=tls is not None, token=token is not None,
                     client_ca=bool(args.client_ca), insecure=args.insecure)
        if args.metrics_token_file is not None:
            if args.metrics_port is None:
                raise SecurityError("--metrics-token-file goes with --metrics-port")
            load_token(args.metrics_token_file)
    except (SecurityError, MetricsPortError) as exc:
        raise SystemExit(f"cossd serve: {exc}") from None
    return token, tls


def serve(args: argparse.Namespace) -> int:
    """The verb: in the foreground, or started in the background and returned once listening."""
    if args.foreground:
        logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        run_foreground(args)
        return 0
    _security(args)  # a one-line error here rather than in the log
    pid, url = start_background(args)
    host = f"[{args.metrics_addr}]" if ":" in args.metrics_addr else args.metrics_addr  # IPv6
    metrics = f", metrics at http://{host}:{args.metrics_port}/metrics" if args.metrics_port else ""
    print(f"serving {args.backing} at {url} (server pid {pid}){metrics}; log: {_log_path(args)}", flush=True)
    return 0


def run_foreground(args: argparse.Namespace) -> None:
    token, tls = _security(args)
    soft, hard = raise_descriptor_limit()
    log.info("descriptor limit %d (hard %d)", soft, hard)
    guard.install()  # a state copy cut short under its mapping faults into the guard
    # The metrics port is bound before the device opens, as a mount's: a busy port starts nothing.
    try:
        metrics = (MetricsEndpoint.bind(args.metrics_port, args.metrics_addr, args.metrics_token_file)
                   if args.metrics_port is not None else None)
    except MetricsPortError as exc:
        raise SystemExit(f"cossd serve: {exc}") from None
    try:
        device = Device.open(Path(args.backing).resolve(),
                             DeviceConfig(sync=args.sync, profile=args.profile, timed=args.timed,
                                          verify=args.verify))
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    try:
        host, port = args.listen
        try:
            server = Server(device, host, port, token=token, tls=tls, lease_s=args.lease_s,  # type: ignore[arg-type]
                            link=args.link, param_cache_size=args.param_cache_size,
                            max_connections=args.max_connections, recv_memory=args.recv_memory,
                            recv_wait_s=args.recv_wait_s, max_preauth=args.max_preauth_connections,
                            handshake_deadline_s=args.handshake_deadline_s, send_timeout_s=args.send_timeout_s)
        except OSError as exc:
            raise SystemExit(f"cossd serve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        if metrics is not None:
            metrics.attach(ServerCollector(device, server.figures, server.controller.figures))
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: server.stop())
        where = server.address
        shown = f"[{where[0]}]" if ":" in where[0] else where[0]
        url = f"cossd://{shown}:{where[1]}"
        log.info("serving %s at %s (%s, %s)", args.backing, url, "TLS" if tls else "plain TCP",
                 "token" if token else ("client certificates" if args.client_ca else "no client check"))
        if args.ready_fd is not None:
            os.write(args.ready_fd, READY_PREFIX + url.encode() + b"\n")
            os.close(args.ready_fd)
        server.serve_forever()
        log.info("stopped: %s", server.snapshot())
    finally:
        if metrics is not None:
            metrics.close()  # before the device closes: a scrape reads the device
        device.close()
        log.info("device %s closed cleanly", args.backing)


def _log_path(args: argparse.Namespace) -> Path:
    return Path(args.log_file) if args.log_file else Path(args.backing) / "server.log"


def _open_log(path: Path, default: bool) -> int:
    """The log, appended to; in the backing directory never through a link or into a fifo."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    if default:
        flags |= os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise DeviceError(Status.INVALID_FIELD, f"refusing {path}: a link or a fifo (remove it)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DeviceError(Status.INVALID_FIELD, f"refusing {path}: not a regular file (remove it)")
    os.set_blocking(fd, True)
    return fd


def _child_command(args: argparse.Namespace, ready_fd: int) -> list[str]:
    host, port = args.listen
    command = [sys.executable, "-m", "cossd.server.command", str(Path(args.backing).resolve()), "--foreground",
               "--ready-fd", str(ready_fd), "--listen", f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
               "--lease-s", repr(args.lease_s), "--param-cache-size", str(args.param_cache_size),
               "--max-connections", str(args.max_connections), "--recv-memory", str(args.recv_memory),
               "--recv-wait-s", repr(args.recv_wait_s),
               "--max-preauth-connections", str(args.max_preauth_connections),
               "--handshake-deadline-s", repr(args.handshake_deadline_s),
               "--send-timeout-s", repr(args.send_timeout_s)]
    if args.metrics_port is not None:
        command += ["--metrics-port", str(args.metrics_port), "--metrics-addr", args.metrics_addr]
    for option in ("token_file", "tls_cert", "tls_key", "client_ca", "metrics_token_file"):
        value = getattr(args, option)
        if value:
            command += [f"--{option.replace('_', '-')}", str(Path(value).resolve())]
    command += ["--profile", args.profile if args.profile in PROFILES else str(Path(args.profile).resolve())]
    command += ["--link", args.link if args.link in LINKS else str(Path(args.link).resolve())]
    command += [flag for flag, on in (("--insecure", args.insecure), ("--sync", args.sync),
                                      ("--timed", args.timed), ("--debug", args.debug)) if on]
    return command


def start_background(args: argparse.Namespace, timeout_s: float = 60.0) -> tuple[int, str]:
    """Start a server process; (its pid, its cossd:// URL) once it listens."""
    backing = Path(args.backing)
    if not (backing / SUPERBLOCK_FILE).is_file():
        raise DeviceError(Status.INVALID_FIELD, f"{backing} is not a cossd device (run `cossd format {backing}`)")
    load_profile(args.profile)
    load_link(args.link)
    BackingDirectory.inspect(backing)
    BackingDirectory.lock(backing).close()  # in use by a mount or a server: refused here, clearly
    read_fd, write_fd = os.pipe()
    log_path = _log_path(args)
    try:
        log_fd = _open_log(log_path, default=args.log_file is None)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    with open(log_fd, "ab") as log_stream:
        process = subprocess.Popen(_child_command(args, write_fd), pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                                   stdout=log_stream, stderr=log_stream, start_new_session=True)
    os.close(write_fd)
    deadline = time.monotonic() + timeout_s
    message = b""
    try:
        with contextlib.closing(os.fdopen(read_fd, "rb", buffering=0)) as reader:
            # The child writes "ready URL" or dies (closing the pipe); a hung child times out.
            while time.monotonic() < deadline and not message.endswith(b"\n"):
                readable, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
                if not readable:
                    break
                chunk = reader.read(256)
                if not chunk:
                    break
                message += chunk
    except BaseException:
        # Interrupted while waiting (Ctrl-C, a bench's signal handler): the caller never gets
        # the pid, so nobody else could stop this server.
        process.kill()
        process.wait()
        raise
    if not message.startswith(READY_PREFIX):
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()  # reaped: no zombie behind the error
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
        raise RuntimeError(f"storage server failed to start (exit {process.returncode})"
                           + (f": {tail[0]}" if tail else "") + f"; log: {log_path}")
    return process.pid, message[len(READY_PREFIX):].strip().decode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cossd serve", description="Serve a device to clients across a network "
                                     "(docs/server.md); returns once it listens unless --foreground.")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return serve(args)
    except (DeviceError, RuntimeError) as exc:
        print(f"cossd serve: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
