"""The namespace kinds a device holds (optimizer, nvm, and the standard's compute and memory): which one a create payload asks for, what each
allocates, and how each is created and opened."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Union

from ..protocol.status import DeviceError, Status
from .media import read_json
from .namespace import Namespace
from .namespace.verify import VERIFY_OPEN
from .nvm import KIND as NVM_KIND
from .nvm import NvmNamespace, NvmSpec
from .spec import NamespaceSpec
# The standard's compute and memory namespaces (NvmNamespace to the rest of the device).
from .computational.namespaces import (COMPUTE_KIND, MEMORY_KIND, ComputeNamespace, ComputeSpec,
                                       MemoryNamespace, MemorySpec)

OPTIMIZER_KIND = "optimizer"
KINDS = (OPTIMIZER_KIND, NVM_KIND, COMPUTE_KIND, MEMORY_KIND)

AnySpec = Union[NamespaceSpec, NvmSpec, ComputeSpec, MemorySpec]
AnyNamespace = Union[Namespace, NvmNamespace]


def spec_from_payload(value: Any) -> AnySpec:
    """Parse a CREATE_NAMESPACE payload; "kind" (default "optimizer") picks the spec."""
    if not isinstance(value, dict):
        raise DeviceError(Status.INVALID_FIELD, "namespace description must be a JSON object")
    kind = value.get("kind", OPTIMIZER_KIND)
    if kind == NVM_KIND:
        return NvmSpec.from_json(value)
    if kind == COMPUTE_KIND:
        return ComputeSpec.from_json(value)
    if kind == MEMORY_KIND:
        return MemorySpec.from_json(value)
    if kind == OPTIMIZER_KIND:
        # The optimizer payload and its meta.json stay as they were: "kind" is not stored.
        return NamespaceSpec.from_json({k: v for k, v in value.items() if k != "kind"})
    raise DeviceError(Status.INVALID_FIELD, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")


def allocation_bytes(spec: AnySpec) -> int:
    """Device capacity a namespace of `spec` takes: both state copies, or every NVM block."""
    if isinstance(spec, NamespaceSpec):  # the spec (not a namespace kind) whose size needs its layout
        _, copy_bytes = spec.layout()
        return 2 * copy_bytes
    return spec.allocation_bytes


# How each kind's spec creates its namespace, keyed by the spec's class.
_CREATORS: dict[type, Callable[[Path, int, Any, bool], AnyNamespace]] = {
    NamespaceSpec: Namespace.create,
    NvmSpec: NvmNamespace.create,
    ComputeSpec: lambda directory, nsid, spec, sync: ComputeNamespace.create(directory, nsid, spec),
    MemorySpec: lambda directory, nsid, spec, sync: MemoryNamespace.create(directory, nsid, spec),
}


def create(directory: Path, nsid: int, spec: AnySpec, sync: bool) -> AnyNamespace:
    return _CREATORS[type(spec)](directory, nsid, spec, sync)


def open_namespace(directory: Path, sync: bool, verify: str = VERIFY_OPEN, *, durable: bool = False) -> AnyNamespace:
    """Open a registered namespace; its meta.json says the kind (none: an optimizer).
    `verify` and `durable` (the device closed cleanly last time) apply to optimizer
    namespaces (Namespace.open, in emulator/namespace/open.py)."""
    kind = read_json(directory / "meta.json").get("kind", OPTIMIZER_KIND)
    if kind == NVM_KIND:
        return NvmNamespace.open(directory, sync)
    if kind == COMPUTE_KIND:
        return ComputeNamespace.open(directory)
    if kind == MEMORY_KIND:
        return MemoryNamespace.open(directory)
    return Namespace.open(directory, sync, verify, durable=durable)
