"""CLI verbs that run or look at a device on this node: format, mount, serve, umount, list.

The only verbs that import the device itself (cossd.emulator, cossd.fs, cossd.server): format
formats a backing directory, mount starts the FUSE daemon and serve the network server with
their options' defaults and bounds, list reads a crashed mount's backing directory. The import contracts in pyproject.toml name each import.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from ... import settings
from ...protocol.status import DeviceError, Status
from ..arguments import VerbFactory, bounded_int, device_location, parse_port, parse_size, parse_threads
from ..output import emit


def parse_cmb_size(text: str) -> int:
    """A CMB size: 0, or a multiple of 4 KiB up to 1 TiB."""
    from ...emulator.geometry import MAX_CMB_BYTES

    size = parse_size(text)
    if size and (size % 4096 or size > MAX_CMB_BYTES):
        raise argparse.ArgumentTypeError(f"not a CMB size: {text!r} (0, or a multiple of 4K up to 1T)")
    return size


def parse_connections(text: str) -> int:
    """A remote mount's connections at most: 1-64."""
    count = parse_threads(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"not a connection count: {text!r} (1-64)")
    return count


def cmd_format(args: argparse.Namespace) -> int:
    from ...emulator import Device

    identity = Device.format(args.backing, capacity_bytes=args.capacity, serial=args.serial, force=args.force)
    emit(args, identity, lambda i: f"formatted {args.backing}: serial {i['serial']}, "
         f"capacity {i['capacity_bytes']} bytes, model {i['model']!r}")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    if isinstance(args.backing, str):  # cossd://HOST:PORT: a storage server's device
        return _mount_remote(args)
    for option, given in (("--token-file", args.token_file), ("--ca", args.ca), ("--timeout", args.timeout),
                          ("--connections", args.connections)):
        if given is not None:
            raise SystemExit(f"cossd mount: {option} is for a server's device (cossd://HOST:PORT), "
                             f"not a backing directory")
    from ...fs.mount_options import MountOptions

    options = MountOptions.from_args(args)
    if args.foreground:
        from ...fs import daemon
        from ...fs.launch import check_mountpoint

        check_mountpoint(options.mountpoint)
        logging.basicConfig(
            level=logging.DEBUG if options.debug else logging.INFO,
            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        )
        daemon.serve(options, ready_fd=args.ready_fd)
        return 0
    # The daemon's launcher alone: the daemon's own imports (trio, pyfuse3, numpy) are its
    # process's to pay, not this one's before it starts it.
    from ...fs import launch

    if options.metrics_token_file is not None:  # a one-line error before anything starts
        from ...fs.metrics import MetricsPortError, load_token

        if options.metrics_port is None:
            raise MetricsPortError("--metrics-token-file goes with --metrics-port")
        load_token(options.metrics_token_file)
    try:
        pid = launch.start(options, log_file=args.log_file)
    except DeviceError as exc:
        where = _mounted_at(args.backing) if exc.status == Status.NAMESPACE_NOT_READY else []
        if where:
            raise DeviceError(exc.status, f"{args.backing} is already mounted at "
                                          f"{', '.join(map(str, where))}") from None
        raise
    metrics = None
    if options.metrics_port is not None:
        from ...fs.metrics import DEFAULT_METRICS_ADDR  # the daemon's imports: paid only with metrics

        addr = options.metrics_addr or DEFAULT_METRICS_ADDR
        host = f"[{addr}]" if ":" in addr else addr  # IPv6
        metrics = f"http://{host}:{options.metrics_port}/metrics"
    emit(args, {"mountpoint": str(args.mountpoint), "pid": pid} | ({"metrics": metrics} if metrics else {}),
         lambda v: f"mounted {args.backing} at {v['mountpoint']} (daemon pid {v['pid']})"
         + (f", metrics at {metrics}" if metrics else ""))
    return 0


def _mount_remote(args: argparse.Namespace) -> int:
    """`cossd mount cossd://HOST:PORT MNT`: the server's tree as a FUSE mount on this node
    (fs/remote/daemon.py); the device's own options are the server's (`cossd serve`)."""
    from ...fs.remote import daemon as remote_daemon
    from ...fs.mount_options import MountOptions
    from ...fs.remote.lanes import DEFAULT_LANES, Credentials

    given = MountOptions.from_args(args).device_options_given()
    if given:
        raise SystemExit(f"cossd mount: {', '.join(given)} set the device's own behaviour, which is the "
                         f"server's (`cossd serve`); not for a remote mount of {args.backing}")
    credentials = Credentials(token_file=args.token_file, ca=args.ca)
    timeout_s = args.timeout if args.timeout is not None else 120.0
    lanes = args.connections if args.connections is not None else DEFAULT_LANES
    try:
        if args.foreground:
            logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO,
                                format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
            remote_daemon.serve(args.backing, args.mountpoint, credentials, timeout_s=timeout_s,
                                allow_other=args.allow_other, debug=args.debug, ready_fd=args.ready_fd,
                                lanes=lanes)
            return 0
        pid, log_path = remote_daemon.start_background(
            args.backing, args.mountpoint, credentials, timeout_s=timeout_s, allow_other=args.allow_other,
            debug=args.debug, log_file=args.log_file, lanes=lanes)
    except (RuntimeError, ValueError, OSError) as exc:  # RemoteMountError, a bad URL, refused
        if args.foreground and args.ready_fd is not None:
            return 1  # the reason went to the parent, which prints it
        raise SystemExit(f"cossd mount: {exc}") from None
    emit(args, {"mountpoint": str(args.mountpoint), "pid": pid, "server": args.backing, "log": str(log_path)},
         lambda v: f"mounted {v['server']} at {v['mountpoint']} (daemon pid {v['pid']}); log: {v['log']}")
    return 0


def _mounted_at(backing: Path) -> list[Path]:
    """The mountpoints where the device in `backing` is mounted now (from mountinfo)."""
    from ...client import mounted_devices

    target = os.path.realpath(backing)
    return [mountpoint for mountpoint, source in mounted_devices() if os.path.realpath(source) == target]


# How long fusermount3 itself may take: it asks the kernel only, but a stuck one must not
# hang `cossd umount`.
FUSERMOUNT_TIMEOUT_S = 30.0


def cmd_umount(args: argparse.Namespace) -> int:
    from ...client import MOUNT_FSTYPE, REMOTE_MOUNT_FSTYPE, AdminClient, mount_type_at
    from ...client.mounts import mount_holders

    # Only ever a cossd mount: fusermount3 would detach any FUSE mount of this user, and as
    # root any filesystem at all (a tmpfs, an ext4 loop mount).
    fstype = mount_type_at(args.mountpoint)
    if fstype is None:
        raise SystemExit(f"cossd umount: nothing is mounted at {args.mountpoint}")
    if fstype not in (MOUNT_FSTYPE, REMOTE_MOUNT_FSTYPE):
        raise SystemExit(f"cossd umount: {args.mountpoint} is a {fstype} mount, not a cossd device "
                         f"({MOUNT_FSTYPE} or {REMOTE_MOUNT_FSTYPE}); refusing to unmount it")
    pid = None
    if fstype == REMOTE_MOUNT_FSTYPE:
        from ...fs.remote.daemon import daemon_pid

        # The server holds the state (nothing to flush here): wait only for this node's daemon
        # to close its connections. VENDOR_IDENTIFY's pid would be the server's.
        pid = daemon_pid(args.mountpoint)
    else:
        try:
            with AdminClient(args.mountpoint, timeout_s=min(args.timeout, 10.0)) as client:
                pid = client.describe()["pid"]
        except (OSError, DeviceError):
            pass  # not answering (crashed daemon): still detach the mount
    command = ["fusermount3", "-u"] + (["-z"] if args.lazy else []) + [str(args.mountpoint)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=FUSERMOUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"cossd umount: fusermount3 did not return within {FUSERMOUNT_TIMEOUT_S:g} s "
                         f"for {args.mountpoint}; try --lazy") from None
    if result.returncode != 0:
        if "busy" in result.stderr.lower():
            holders = mount_holders(args.mountpoint)
            raise SystemExit(f"cossd umount: {args.mountpoint} is in use"
                             + (f" by {'; '.join(holders)}" if holders else "")
                             + ": close those files or cd out of it, or use --lazy (detach now; the daemon "
                               "exits once they are closed)")
        raise SystemExit(f"cossd umount: {result.stderr.strip() or 'fusermount3 failed'}")
    if pid is not None:
        # The daemon flushes the committed state after the unmount (a remote one only closes
        # its connections); wait for it, never longer than --timeout.
        deadline = time.monotonic() + args.timeout
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _running(pid):
            what = ("its remote mount daemon" if fstype == REMOTE_MOUNT_FSTYPE
                    else "its daemon, still flushing the state?")
            raise SystemExit(f"cossd umount: {args.mountpoint} is detached, but {what} (pid {pid}) is still "
                             f"running after {args.timeout:g} s; see its log, or `kill {pid}`")
    return 0


def _running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, exited but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class _Shadowed(OSError):
    """A mount that another is mounted on top of: listed from its backing directory."""


def cmd_list(args: argparse.Namespace) -> int:
    """nvme-cli's list: -o json as 2.3 (a flat entry per namespace), with -v as 2.11 (hosts,
    subsystems, controllers, namespaces); every cossd mount, also a crashed one, under "cossd"."""
    from ...client import AdminClient
    from ...client.mounts import FSNAME_PREFIX, MOUNT_FSTYPE, mount_entries, shadowed_mount_ids
    from ...emulator.device import SUPERBLOCK_FILE
    from .. import nvme_json

    devices, controllers = [], []
    entries = mount_entries(args.mountinfo)
    # A mount with another on top of it: its path reaches the top one's `.admin`, so what it
    # says of itself is read from its own backing directory instead (one made before cossd
    # refused mounting onto a mount, or by hand).
    shadowed = shadowed_mount_ids(entries)
    for mount in entries:
        if mount.fstype != MOUNT_FSTYPE:
            continue
        mountpoint, backing = mount.mountpoint, Path(mount.source.removeprefix(FSNAME_PREFIX))
        entry: dict[str, Any] = {"DevicePath": str(mountpoint), "Backing": str(backing)}
        try:
            if mount.mount_id in shadowed:
                raise _Shadowed(f"shadowed: another mount is on top of it at {mountpoint}")
            with AdminClient(mountpoint, timeout_s=args.timeout) as client:
                described = client.describe()
                controllers.append(nvme_json.listed_controller(client, mountpoint, backing,
                                                               described["namespaces"]))
            identity = described["identity"]
            namespaces = [{"NameSpace": ns["nsid"], "Name": ns["name"]} for ns in described["namespaces"]]
            entry |= {"State": "live", "Pid": described["pid"],
                      "UsedBytes": described["allocated_bytes"]}
        except (OSError, DeviceError, ValueError, KeyError) as exc:
            # A crashed or stopped daemon: what the backing directory itself says (it has
            # no identify pages to answer nvme-cli's part with, so it is only listed here).
            entry |= {"State": str(exc) if isinstance(exc, _Shadowed) else f"not answering ({exc})"}
            try:
                stored = json.loads((backing / SUPERBLOCK_FILE).read_text())
                identity = stored["identity"]
                namespaces = [{"NameSpace": nsid, "Name": name}
                              for name, nsid in sorted(stored["namespaces"].items(), key=lambda kv: kv[1])]
            except (OSError, ValueError, KeyError):
                identity, namespaces = {}, []
        entry |= {"SerialNumber": identity.get("serial", ""), "ModelNumber": identity.get("model", ""),
                  "Firmware": identity.get("firmware_revision", ""),
                  "PhysicalSize": identity.get("capacity_bytes", 0), "Namespaces": namespaces}
        devices.append(entry)

    def normal(value: dict[str, Any]) -> str:
        rows = [("Node", "Backing", "SN", "Namespaces"), ("-" * 24, "-" * 32, "-" * 20, "-" * 24)]
        for device in value[nvme_json.VENDOR_KEY]["Devices"]:
            names = ", ".join(f"{ns['Name']}({ns['NameSpace']})" for ns in device["Namespaces"]) or "-"
            if device["State"] != "live":
                names += f" [{device['State']}]"
            rows.append((device["DevicePath"], device["Backing"], device["SerialNumber"], names))
        return "\n".join(f"{a:<24} {b:<32} {c:<20} {d}" for a, b, c, d in rows)

    shaped = (nvme_json.detail_list(controllers, nvme_json.host_identity()) if args.verbose
              else nvme_json.simple_list(controllers))
    emit(args, shaped | {nvme_json.VENDOR_KEY: {"Devices": devices}}, normal, sort_keys=False)
    return 0


def register(verb: VerbFactory) -> None:
    sub = verb("format", cmd_format, "Create an empty device in a backing directory.")
    sub.add_argument("backing", type=Path, help="backing directory (created if missing)")
    sub.add_argument("--capacity", type=parse_size, help="device capacity, e.g. 64G (default: free space)")
    sub.add_argument("--serial", help="serial number (default: random)")
    sub.add_argument("--force", action="store_true", help="erase an existing device in BACKING")

    _register_mount(verb)
    if verb.wants("serve"):  # its options come with the network server's imports
        _register_serve(verb)

    sub = verb("umount", cmd_umount, "Unmount; waits until the daemon has flushed the state.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--lazy", action="store_true", help="detach even if busy (fusermount3 -z)")
    sub.add_argument("--timeout", type=float, default=120.0,
                     help="seconds to wait for the daemon to flush and exit (default: %(default)s)")

    sub = verb("list", cmd_list, "List the mounted cossd devices (from /proc/self/mountinfo); -o json "
               "as nvme-cli 2.3 (one entry per namespace), with -v as nvme-cli 2.11 (subsystems, "
               "controllers, namespaces).")
    sub.add_argument("-v", "--verbose", action="store_true",
                     help="nvme-cli 2.11's JSON layout (Subsystems/Controllers/Namespaces)")
    # Which mounts to list; $COSSD_MOUNTINFO lets a test show a script only its own mount.
    sub.add_argument("--mountinfo", default=settings.MOUNTINFO.read(),
                     help=argparse.SUPPRESS)
    sub.add_argument("--timeout", type=float, default=5.0,
                     help="seconds to wait for each daemon (default: 5)")


def _register_serve(verb: VerbFactory) -> None:
    from ...server.command import add_serve_arguments, serve

    sub = verb("serve", serve, "Serve a device on the network (cossd://HOST:PORT); returns once it listens.")
    add_serve_arguments(sub)


def _register_mount(verb: VerbFactory) -> None:
    from ...fs.mount_options import VERIFY_CHOICES, MountOptions
    from ...model.profiles import PROFILES

    # The options' defaults are MountOptions' (a flag left out is None, and from_args then
    # keeps the field's default); the help quotes them from there.
    sub = verb("mount", cmd_mount, "Mount a device; returns once the mount is ready. BACKING is a device's "
               "backing directory on this node, or a storage server's cossd://HOST[:PORT][?digest=...] "
               "(`cossd serve`, docs/server.md): the server's tree mounted here, every file operation and "
               "command going to the server (--token-file, --ca, --timeout, --connections; the device's "
               "own options are the server's).")
    sub.add_argument("backing", type=device_location, metavar="BACKING|cossd://HOST:PORT",
                     help="a backing directory (`cossd format`), or a storage server's URL: cossd://HOST[:PORT]"
                          "[?digest=none|header|data|both] (port 4420 by default; IPv6 in brackets)")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    sub.add_argument("--token-file", metavar="FILE",
                     help="cossd:// only: the server's token (default: $COSSD_TOKEN_FILE)")
    sub.add_argument("--ca", metavar="PEM",
                     help="cossd:// only: the CA that signed a TLS server's certificate (default: $COSSD_CA; "
                          "a client certificate from $COSSD_CLIENT_CERT and $COSSD_CLIENT_KEY)")
    sub.add_argument("--timeout", type=float, metavar="S",
                     help="cossd:// only: seconds a request waits for the server before it fails with "
                          "ETIMEDOUT (default: 120); a server gone fails them at once with ENOTCONN")
    sub.add_argument("--connections", type=parse_connections, metavar="N",
                     help="cossd:// only: connections to the server at most, opened as needed (default: 4)")
    sub.add_argument("--sync", action="store_true",
                     help="flush every commit before acknowledging it (default: power-loss-protected "
                          "mode, commits reach the media in the background, one step behind at most)")
    sub.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    sub.add_argument("--debug", action="store_true", help="log every FUSE request")
    sub.add_argument("--log-file", type=Path, help="daemon log (default: BACKING/daemon.log; for cossd://, "
                     "~/.cache/cossd/remote-mount-MOUNTPOINT.log)")
    sub.add_argument("--ready-fd", type=bounded_int(0, 0x7FFF_FFFF), help=argparse.SUPPRESS)  # a C int
    sub.add_argument("--metrics-port", type=parse_port, metavar="N",
                     help="serve Prometheus metrics on this TCP port (docs/metrics.md). Unauthenticated "
                          "unless --metrics-token-file is given: any local user (and anyone who can reach "
                          "ADDR) can read them, namespace names included, even without --allow-other")
    sub.add_argument("--metrics-addr", metavar="ADDR",
                     help="address the metrics endpoint listens on (default: 127.0.0.1, loopback only)")
    sub.add_argument("--metrics-token-file", metavar="FILE",
                     help="require 'Authorization: Bearer TOKEN' on every metrics request, TOKEN being "
                          "FILE's content (one word; the file must not be readable by every user); others "
                          "get 401. Prometheus: authorization: {credentials_file: FILE}")
    sub.add_argument("--profile", metavar="NAME|FILE.json",
                     help=f"device profile of the timing model: {', '.join(PROFILES)}, or a JSON file "
                          f"of profile fields (default: {MountOptions.profile}; `cossd model --list-profiles`)")
    sub.add_argument("--timed", action="store_true",
                     help="complete file I/O and step commands no earlier than their modeled device time")
    sub.add_argument("--io-threads", type=parse_threads, metavar="N",
                     help="threads that serve tensor reads and writes in front of pyfuse3; 0 leaves "
                          "them to pyfuse3's single event loop (default: $COSSD_IO_THREADS, else one "
                          "per core and at least 2; docs/architecture.md, the data path)")
    sub.add_argument("--cmb-size", type=parse_cmb_size, dest="cmb_bytes", metavar="SIZE",
                     help="controller memory buffer: shared memory that CMB_WRITE/CMB_READ move tensor "
                          "bytes through without FUSE copies; memory is used only as clients touch it; "
                          f"0 turns it off (default: {MountOptions.cmb_bytes >> 30}G; docs/command-set.md)")
    sub.add_argument("--verify", choices=VERIFY_CHOICES,
                     help="when a restart verifies each namespace's committed step: 'background' (default) "
                          "serves params at once, checking each param block against its own checksum as "
                          "it is first read, and verifies master and moments in a thread before any step, "
                          "snapshot or state read; 'open' checks every block before the mount is ready "
                          "(slower at scale). A block that fails stops the namespace; a remount then "
                          "recovers the step before (docs/reliability.md)")
