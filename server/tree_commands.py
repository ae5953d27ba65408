"""The wire's tree commands for a remote mount (fs/remote_*.py): STAT of any path of the tree a
local mount shows (its kind, mode, size, time, and a directory's entries), and READ_PATH of
the files OPEN does not serve (a snapshot's arrays and step).

The attributes are a local mount's, rule for rule: the modes of fs/tree.py and
fs/snapshot_tree.py, the times of fs/times.py (which this layer may not import: fs and server
are siblings), so `ls -l`, `stat` and `rsync` see the same tree either way;
tests/e2e/test_remote_mount.py compares the two.
"""
from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct
import time
from pathlib import Path
from typing import Any

from ..emulator.face import LOADABLE_ROLES, ROLES, AnyNamespace, Device, DeviceError, Namespace, Snapshot, Status
from ..protocol.entries import Completion
from ..protocol.wire import STAT_ENTRIES, FabricsType

from .paths import read_text

FCTYPES = frozenset({FabricsType.STAT, FabricsType.READ_PATH})
# The most bytes one READ_PATH returns (a FUSE read asks for at most 1 MiB).
MAX_READ_PATH_BYTES = 16 << 20
# The registry, rewritten whole when a namespace is created or deleted: the time of `/` and `ns/`.
_REGISTRY_FILE = "superblock.json"
_SNAPSHOT_ROLES = ("param", "master", "exp_avg", "exp_avg_sq")  # a snapshot keeps no gradient
_DIR = stat.S_IFDIR | 0o755
_SNAPSHOT_DIR = stat.S_IFDIR | 0o555
_READ_ONLY = stat.S_IFREG | 0o444


@dataclasses.dataclass(frozen=True)
class _Node:
    """A resolved path: its namespace, and where under it (the path's parts after ns/<ns>)."""

    parts: tuple[str, ...]
    namespace: AnyNamespace | None = None
    snapshot: Snapshot | None = None


def _missing(path: str) -> DeviceError:
    return DeviceError(Status.INVALID_NAMESPACE, f"no such file or directory: {path!r}")


def _resolve(device: Device, path: str) -> _Node:
    """The node at `path`, or INVALID_NAMESPACE (ENOENT) as a local mount's lookup."""
    parts = tuple(part for part in path.split("/") if part)
    if any(part in (".", "..") for part in parts):
        raise _missing(path)
    if not parts:
        return _Node(())
    if parts[0] != "ns":
        raise _missing(path)
    if len(parts) == 1:
        return _Node(parts)
    namespace = device.namespaces.get(parts[1])
    if namespace is None:
        raise _missing(path)
    rest = parts[2:]
    node = _Node(parts, namespace)
    optimizer = namespace.as_optimizer()
    if optimizer is None:  # a namespace of one data file (NVM, and the computational kinds)
        if len(rest) <= 1 and (not rest or rest[0] in ("config.json", "stats.json", "data")):
            return node
        raise _missing(path)
    return _resolve_optimizer(path, parts, rest, optimizer)


def _resolve_optimizer(path: str, parts: tuple[str, ...], rest: tuple[str, ...], namespace: Namespace) -> _Node:
    """The node at `path` under an optimizer namespace's directory (`rest`: the parts below it)."""
    node = _Node(parts, namespace)
    if not rest or (len(rest) == 1 and rest[0] in ("config.json", "step", "stats.json", "tensors", "snapshots")):
        return node
    if rest[0] == "tensors" and rest[1] in namespace.tensors and (
            len(rest) == 2 or (len(rest) == 3 and rest[2] in ROLES)):
        return node
    if rest[0] != "snapshots":
        raise _missing(path)
    snapshot = namespace.snapshots.find(rest[1])
    if snapshot is None:
        raise _missing(path)
    node = _Node(parts, namespace, snapshot)
    inner = rest[2:]
    if not inner or inner in (("step",), ("tensors",)):
        return node
    if inner[0] == "tensors" and inner[1] in namespace.tensors and (
            len(inner) == 2 or (len(inner) == 3 and inner[2] in _SNAPSHOT_ROLES)):
        return node
    raise _missing(path)


def _mtime_ns(path: Path, fallback: int) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return fallback


def _snapshot_time(snapshot: Snapshot | None, fallback: int) -> int:
    if snapshot is None:
        return fallback
    return _mtime_ns(snapshot.state_path, _mtime_ns(snapshot.directory, fallback))


def _attributes(device: Device, node: _Node) -> dict[str, Any]:
    """mode (type and permission bits), size, time_ns and key of a node: the key (nsid,
    snapshot id) tells a namespace deleted and created again, or a tag taken again, from
    the one a client saw before, as a local mount's inodes do."""
    now = time.time_ns()
    parts, namespace, snapshot = node.parts, node.namespace, node.snapshot
    if namespace is None:  # `/` or `ns/`
        return {"mode": _DIR, "size": 0, "time_ns": _mtime_ns(device.path / _REGISTRY_FILE, now), "key": [0, 0]}
    key = [namespace.nsid, snapshot.snapshot_id if snapshot is not None else 0]
    created = _mtime_ns(namespace.directory / "meta.json", now)
    rest = parts[2:]
    nvm = namespace.as_nvm()
    if nvm is not None:
        if not rest:
            return {"mode": _DIR, "size": 0, "time_ns": created, "key": key}
        if rest[0] == "data":
            return {"mode": stat.S_IFREG | 0o644, "size": nvm.capacity_bytes,
                    "time_ns": _mtime_ns(nvm.path, now), "key": key}
        text = read_text(device, "/".join(parts))
        time_ns = _mtime_ns(nvm.path, now) if rest[0] == "stats.json" else created
        return {"mode": _READ_ONLY, "size": len(text), "time_ns": time_ns, "key": key}
    return _optimizer_attributes(device, parts, namespace.as_optimizer(), snapshot, key, created, now)


def _optimizer_attributes(device: Device, parts: tuple[str, ...], namespace: Namespace | None,
                          snapshot: Snapshot | None, key: list[int], created: int, now: int) -> dict[str, Any]:
    """_attributes of a node under an optimizer namespace's directory."""
    assert namespace is not None  # every kind is an optimizer one or has one data file (as_nvm)
    rest = parts[2:]
    if snapshot is not None:
        inner = rest[2:]
        when = _snapshot_time(snapshot, now)
        if inner == ("step",):
            return {"mode": _READ_ONLY, "size": len(f"{snapshot.step}\n"), "time_ns": when, "key": key}
        if len(inner) == 3:
            return {"mode": _READ_ONLY, "size": namespace.file_size(inner[1], inner[2]), "time_ns": when, "key": key}
        return {"mode": _SNAPSHOT_DIR, "size": 0, "time_ns": when, "key": key}
    if not rest or rest == ("tensors",) or (rest[0] == "tensors" and len(rest) == 2):
        return {"mode": _DIR, "size": 0, "time_ns": created, "key": key}
    if rest == ("snapshots",):
        times = [_snapshot_time(namespace.snapshots.find(tag), now) for tag in namespace.snapshots.tags()]
        return {"mode": _SNAPSHOT_DIR, "size": 0, "time_ns": max(times + [created]), "key": key}
    if rest[0] == "tensors":  # an array
        role = rest[2]
        if role == "grad":
            mode = stat.S_IFREG | 0o200
        elif role in LOADABLE_ROLES and namespace.loading:
            mode = stat.S_IFREG | 0o644
        else:
            mode = _READ_ONLY
        return {"mode": mode, "size": namespace.file_size(rest[1], role), "time_ns": namespace.changed_ns,
                "key": key}
    text = read_text(device, "/".join(parts))  # config.json, step, stats.json
    time_ns = {"stats.json": now, "config.json": namespace.config_changed_ns}.get(rest[0], namespace.changed_ns)
    return {"mode": _READ_ONLY, "size": len(text), "time_ns": time_ns, "key": key}


def _children(device: Device, node: _Node) -> list[str]:
    """A directory's entry names, in a local mount's order."""
    parts, namespace, snapshot = node.parts, node.namespace, node.snapshot
    if not parts:
        return ["ns"]  # `.admin` is the front-end's own: a mount's queue pairs
    if namespace is None:
        return [ns.name for ns in sorted(device.namespaces.values(), key=lambda ns: ns.nsid)]
    rest = parts[2:]
    optimizer = namespace.as_optimizer()
    if optimizer is None:  # one data file (NVM, and the computational kinds)
        return ["config.json", "stats.json", "data"]
    namespace = optimizer
    if snapshot is not None:
        inner = rest[2:]
        if not inner:
            return ["step", "tensors"]
        if inner == ("tensors",):
            return [layout.name for layout in namespace.layouts]
        return list(_SNAPSHOT_ROLES)
    if not rest:
        return ["config.json", "step", "stats.json", "tensors", "snapshots"]
    if rest == ("tensors",):
        return [layout.name for layout in namespace.layouts]
    if rest == ("snapshots",):
        return [tag for tag in namespace.snapshots.tags() if namespace.snapshots.find(tag) is not None]
    return list(ROLES)  # a tensor's directory


def stat_path(device: Device, path: str, entries: bool) -> dict[str, Any]:
    """STAT: the node's attributes, and with `entries` a directory's entries with theirs
    (an entry that vanished while listed is left out, as a local readdir would not show it)."""
    node = _resolve(device, path)
    answer = _attributes(device, node)
    if entries and stat.S_ISDIR(answer["mode"]):
        listed = []
        for name in _children(device, node):
            child = "/".join((*node.parts, name))
            try:
                listed.append([name, _attributes(device, _resolve(device, child))])
            except DeviceError:
                continue
        answer["entries"] = listed
    return answer


def read_path(device: Device, path: str, offset: int, length: int, snapshot_id: int) -> bytes:
    """READ_PATH: bytes of a snapshot's array or step file (the snapshot `snapshot_id`: one
    deleted since, or its tag taken again, is SNAPSHOT_NOT_FOUND), `length` at `offset`."""
    node = _resolve(device, path)
    inner = node.parts[4:]
    optimizer = None if node.namespace is None else node.namespace.as_optimizer()
    if node.snapshot is None or optimizer is None or (inner != ("step",) and len(inner) != 3):
        raise DeviceError(Status.INVALID_FIELD, f"{path}: READ_PATH reads a snapshot's files; "
                                                "open other files with OPEN")
    if node.snapshot.snapshot_id != snapshot_id:
        raise DeviceError(Status.SNAPSHOT_NOT_FOUND, f"{path}: the snapshot was deleted (or taken again)")
    if length > MAX_READ_PATH_BYTES:
        raise DeviceError(Status.INVALID_FIELD, f"READ_PATH of {length} bytes; at most {MAX_READ_PATH_BYTES}")
    if len(inner) == 1:  # ("step",): the check above lets through only it and a 3-part path
        return f"{node.snapshot.step}\n".encode()[offset : offset + length]
    if length == 0:
        return b""
    return optimizer.snapshots.read(node.snapshot.tag, snapshot_id, inner[1], inner[2], offset, length)


def serve(device: Device, fctype: int, cid: int, submission: memoryview, data: memoryview) -> Completion:
    """One tree command (its fctype in FCTYPES): the completion, a refusal's status in it."""
    try:
        path = bytes(data).decode()
    except UnicodeDecodeError:
        return Completion(cid, Status.INVALID_FIELD, data=b"a path must be UTF-8")
    cdw10, cdw11, cdw12, _cdw13, cdw14, cdw15 = struct.unpack_from("<6I", submission, 40)
    try:
        if fctype == FabricsType.STAT:
            answer = stat_path(device, path, bool(cdw10 & STAT_ENTRIES))
            return Completion(cid, Status.SUCCESS, data=json.dumps(answer).encode())
        offset = cdw10 | cdw11 << 32
        return Completion(cid, Status.SUCCESS, data=read_path(device, path, offset, cdw12, cdw14 | cdw15 << 32))
    except DeviceError as exc:
        return Completion(cid, exc.status, data=exc.message.encode())
