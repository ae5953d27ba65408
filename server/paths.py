"""The device's tree as the network front-end names it: a path (as a local mount shows it)
resolved once, at OPEN, to a namespace and a file, with the open checks a mount makes; and
the text files (config.json, stats.json, step)."""
from __future__ import annotations

import dataclasses
import json

from ..emulator.face import DATA_ROLE, LOADABLE_ROLES, ROLES, AnyNamespace, Device, DeviceError, Status

TEXT_FILES = ("config.json", "stats.json", "step")


@dataclasses.dataclass(frozen=True)
class OpenFile:
    """A file an OPEN resolved: its namespace (by nsid: a namespace deleted since is
    INVALID_NAMESPACE at the next transfer), tensor (None: an NVM namespace's data) and role."""

    nsid: int
    tensor: str | None
    role: str
    writing: bool
    size: int
    path: str


def _parts(path: str) -> list[str]:
    parts = [part for part in path.split("/") if part]
    if not parts or parts[0] != "ns" or any(part in (".", "..") for part in parts):
        raise DeviceError(Status.INVALID_NAMESPACE, f"no file {path!r} on this device")
    return parts


def _namespace(device: Device, name: str, path: str) -> AnyNamespace:
    namespace = device.namespaces.get(name)
    if namespace is None:
        raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace {name!r} ({path})")
    return namespace


def resolve_open(device: Device, path: str, writing: bool) -> OpenFile:
    """The file at `path` (ns/<ns>/tensors/<t>/<role>, or ns/<ns>/data of an NVM namespace),
    refused as a mount's open refuses it: a missing name INVALID_NAMESPACE (ENOENT), a grad
    opened for reading or a param for writing ACCESS_DENIED (EACCES), a state file opened for
    writing after the first step STATE_SEALED (EROFS)."""
    parts = _parts(path)
    if len(parts) == 3 and parts[2] == DATA_ROLE:
        nvm = _namespace(device, parts[1], path).as_nvm()
        if nvm is None:
            raise DeviceError(Status.INVALID_NAMESPACE, f"{path}: namespace {parts[1]!r} has no data file")
        return OpenFile(nvm.nsid, None, DATA_ROLE, writing, nvm.capacity_bytes, path)
    if len(parts) != 5 or parts[2] != "tensors" or parts[4] not in ROLES:
        raise DeviceError(Status.INVALID_NAMESPACE, f"no file {path!r} on this device")
    namespace = _namespace(device, parts[1], path).as_optimizer()
    if namespace is None:
        raise DeviceError(Status.INVALID_NAMESPACE, f"{path}: namespace {parts[1]!r} has no tensors")
    tensor, role = parts[3], parts[4]
    if tensor not in namespace.tensors:
        raise DeviceError(Status.INVALID_NAMESPACE, f"namespace {parts[1]!r} has no tensor {tensor!r}")
    if role == "grad" and not writing:
        raise DeviceError(Status.ACCESS_DENIED, f"{path}: grad files are write-only")
    if role == "param" and writing:
        raise DeviceError(Status.ACCESS_DENIED, f"{path}: param files are read-only")
    if writing and role in LOADABLE_ROLES and not namespace.loading:
        raise DeviceError(Status.STATE_SEALED, f"{path}: state files are read-only after the first step "
                                               f"(namespace is at step {namespace.committed_step})")
    return OpenFile(namespace.nsid, tensor, role, writing, namespace.file_size(tensor, role), path)


def read_text(device: Device, path: str) -> bytes:
    """A namespace's text file, as a mount shows it (the same bytes)."""
    parts = _parts(path)
    if len(parts) != 3 or parts[2] not in TEXT_FILES:
        raise DeviceError(Status.INVALID_NAMESPACE, f"no text file {path!r} on this device")
    namespace = _namespace(device, parts[1], path)
    if parts[2] == "step":
        optimizer = namespace.as_optimizer()
        if optimizer is None:
            raise DeviceError(Status.INVALID_NAMESPACE, f"{path}: an NVM namespace has no step file")
        return f"{optimizer.committed_step}\n".encode()
    if parts[2] == "config.json":
        return (json.dumps(namespace.config(), indent=2) + "\n").encode()
    return (json.dumps(namespace.statistics(), indent=2, sort_keys=True) + "\n").encode()
