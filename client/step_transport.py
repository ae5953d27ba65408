"""How one namespace's tensors cross to the device, chosen once: the files, the CMB, or Execute Program over it.

`open_step_transport` is the one place that decides. The optimizer (through the trainer's
NamespaceFiles) then calls the object it returns for every transfer of a step, and never asks
again which kind it holds:

- `FileTransport`: each range a positional write or read of a tensor file, as the byte
  transport moves them (`Transport.write_many`/`read_many`: a local mount's pwrite per range,
  a storage server's one WRITE or READ for many).
- `CmbTransport`: the device's controller memory buffer (a part this client locks), one
  CMB_WRITE or CMB_READ per CMB-full; where the part holds a step's gradients and params at
  once, each tensor has fixed places there and one CMB_WRITE also brings the params back.
- `ProgramTransport`: as CmbTransport, but a step's gradients go through the standard's
  Execute Program (adamw_step, client/computational.py) instead of CMB_WRITE.

Every call runs inside `device_lost` (client/lost.py). Arrays are the caller's (torch
tensors for the trainer): a `ByteOps` says how to copy them and see their bytes, so this module
imports neither torch nor the device.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Protocol

import numpy as np

from ..protocol import param_fp8
from .admin import AdminClient
from .cmb import CMB_ALIGN, CmbMapping, CmbRegion, plan_cmb_batches
from .computational import CmbProgram
from .lost import device_lost
from .transport import Transport

log = logging.getLogger(__name__)

# One range of a tensor file: (tensor, role, first byte in the file, a 1-D byte array).
Range = tuple[str, str, int, Any]
# Where a tensor sits in a CMB part holding a whole step: (gradient offset, param offset,
# gradient bytes, param bytes); the two sizes differ where the gradients are not 16-bit, or
# the params come back as FP8 (a namespace's param_wire_dtype: param_fp8's header and codes).
Slot = tuple[int, int, int, int]
# Bytes of one gradient element per grad_dtype (the params come back in 2).
GRAD_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}


class ByteOps(Protocol):
    """How a step transport handles the caller's 1-D byte arrays (torch uint8 tensors for the
    trainer, on any device; numpy arrays here)."""

    def window(self, memory: np.ndarray) -> Any:
        """The CMB part's bytes as the caller's array type (sliced, then copied to and from)."""
        ...

    def copy(self, destination: Any, source: Any) -> None:
        """Copy `source` into `destination`, arrays of one length (either may be the window's)."""
        ...

    def host_buffer(self, array: Any) -> memoryview:
        """The array's bytes in host memory (a copy where it lives elsewhere), for the files."""
        ...


class NumpyBytes:
    """ByteOps for numpy byte arrays."""

    def window(self, memory: np.ndarray) -> Any:
        return memory

    def copy(self, destination: Any, source: Any) -> None:
        np.copyto(destination, source)

    def host_buffer(self, array: Any) -> memoryview:
        return memoryview(array)


# Opens (or finds open) one of a tensor's files: (tensor, role, writing) -> a transport handle.
OpenFile = Callable[[str, str, bool], int]


class FileTransport:
    """Every range through the tensor files (a device without a CMB, or a client without a part of it)."""

    kind = "files"
    # Whether a read may fill, and a write take, arrays off the host (a GPU's): the files need host memory.
    reaches_device_memory = False

    def __init__(self, admin: AdminClient, open_file: OpenFile, ops: ByteOps) -> None:
        self.admin = admin
        self.transport: Transport = admin.transport
        self.open_file = open_file
        self.ops = ops
        self.location = self.transport.location

    def guard(self, doing: str | None = None) -> Any:
        """device_lost for this transport's device."""
        return device_lost(self.location, reachable=self.transport.reachable, doing=doing)

    @property
    def cmb(self) -> CmbRegion | None:
        """This client's part of the CMB (None: the files serve)."""
        return None

    def slots(self) -> dict[str, Slot] | None:
        """Each tensor's fixed places in the CMB part, where it holds a whole step; else None."""
        return None

    def take_params_back(self) -> dict[str, tuple[int, int]]:
        """The params the last step's gradients had the device put in the CMB, {tensor: (CMB
        offset, bytes)}, forgotten as they are handed over."""
        return {}

    def close(self) -> None:
        """Let go of what this transport holds (the files' handles belong to their opener)."""

    # ------------------------------------------------------------------ through the files

    def write_files(self, ranges: Sequence[Range]) -> int:
        """Write ranges through the tensor files (whatever the transport's kind: moments that load
        only whole go this way), in as few commands as the byte transport takes."""
        doing = f"writing {ranges[0][0]}/{ranges[0][1]}" if len(ranges) == 1 else None
        with self.guard(doing):
            items = [(self.open_file(tensor, role, True), self.ops.host_buffer(array), start)
                     for tensor, role, start, array in ranges]
            return self.transport.write_many(items)

    def read_files(self, ranges: Sequence[Range]) -> list[int]:
        """Fill ranges from the tensor files; each range's byte count (short past a file's end).
        The arrays must be in host memory."""
        with self.guard():
            items = [(self.open_file(tensor, role, False), memoryview(self.ops.host_buffer(array)), start)
                     for tensor, role, start, array in ranges]
            return self.transport.read_many(items)

    # ------------------------------------------------------------------ a step's ranges

    def write(self, nsid: int | None, ranges: Sequence[Range]) -> int:
        """Write ranges of the namespace's files by this transport's way."""
        return self.write_files(ranges)

    def read(self, nsid: int | None, ranges: Sequence[Range]) -> list[int]:
        """Fill ranges of the namespace's files by this transport's way; each one's byte count."""
        return self.read_files(ranges)

    def write_step_grads(self, nsid: int | None, grads: Sequence[tuple[str, Any]]) -> int:
        """A step's gradients, (tensor, bytes of the size slots() gives), sent so that the device
        puts each tensor's new params in its place (only where slots() is not None)."""
        raise RuntimeError(f"{self.location}: the {self.kind} transport has no places for a step's params")


class CmbTransport(FileTransport):
    """Ranges through this client's part of the device's controller memory buffer."""

    kind = "cmb"
    reaches_device_memory = True

    def __init__(self, admin: AdminClient, open_file: OpenFile, ops: ByteOps, region: CmbRegion,
                 tensors: Sequence[tuple[str, int]], grad_itemsize: int = 2, fp8_params: bool = False) -> None:
        super().__init__(admin, open_file, ops)
        self.region = region
        self.grad_itemsize = grad_itemsize
        self._slots = _step_slots(tensors, region.size, grad_itemsize, fp8_params)
        # Params the device is putting in the CMB with this step's gradients (write_step_grads).
        self._params_back: dict[str, tuple[int, int]] = {}

    @property
    def cmb(self) -> CmbRegion | None:
        return self.region

    def slots(self) -> dict[str, Slot] | None:
        return self._slots

    def take_params_back(self) -> dict[str, tuple[int, int]]:
        back, self._params_back = self._params_back, {}
        return back

    def close(self) -> None:
        self.region.mapping.close()  # unmaps, then lets go of the lock

    def write(self, nsid: int | None, ranges: Sequence[Range]) -> int:
        window = self.ops.window(self.region.array)
        with self.guard():
            for batch in plan_cmb_batches([_length(array) for *_, array in ranges], self.region.size):
                for item, offset, length, at in batch:
                    self.ops.copy(window[at : at + length], ranges[item][3][offset : offset + length])
                self.admin.cmb_write(_opened(nsid), [
                    {"tensor": ranges[item][0], "role": ranges[item][1], "offset": ranges[item][2] + offset,
                     "length": length, "cmb_offset": self.region.base + at} for item, offset, length, at in batch])
        return sum(_length(array) for *_, array in ranges)

    def read(self, nsid: int | None, ranges: Sequence[Range]) -> list[int]:
        window = self.ops.window(self.region.array)
        with self.guard():
            for batch in plan_cmb_batches([_length(array) for *_, array in ranges], self.region.size):
                self.admin.cmb_read(_opened(nsid), [
                    {"tensor": ranges[item][0], "role": ranges[item][1], "offset": ranges[item][2] + offset,
                     "length": length, "cmb_offset": self.region.base + at} for item, offset, length, at in batch])
                for item, offset, length, at in batch:
                    self.ops.copy(ranges[item][3][offset : offset + length], window[at : at + length])
        return [_length(array) for *_, array in ranges]

    def write_step_grads(self, nsid: int | None, grads: Sequence[tuple[str, Any]]) -> int:
        """Gradients copied into their fixed places and sent in one command, which has the
        device put each tensor's new params in its params place (take_params_back)."""
        slots = self._slots
        if slots is None:
            return super().write_step_grads(nsid, grads)
        window = self.ops.window(self.region.array)
        for tensor, array in grads:
            grad_at, _, size, _ = slots[tensor]
            self.ops.copy(window[grad_at : grad_at + size], array)
        with self.guard():
            self._send_step(nsid, slots, [tensor for tensor, _ in grads])
        self._params_back.update({tensor: (slots[tensor][1], slots[tensor][3]) for tensor, _ in grads})
        return sum(slots[tensor][2] for tensor, _ in grads)

    def _send_step(self, nsid: int | None, slots: dict[str, Slot], tensors: list[str]) -> None:
        base = self.region.base
        self.admin.cmb_write(_opened(nsid), [{"tensor": tensor, "length": slots[tensor][2], "cmb_offset": base + slots[tensor][0],
                                     "param_cmb_offset": base + slots[tensor][1]} for tensor in tensors])


class ProgramTransport(CmbTransport):
    """A step's gradients through Execute Program (adamw_step) over the CMB; other ranges as CmbTransport."""

    kind = "cp"

    def __init__(self, admin: AdminClient, open_file: OpenFile, ops: ByteOps, region: CmbRegion,
                 tensors: Sequence[tuple[str, int]], state_itemsize: int, grad_itemsize: int = 2) -> None:
        super().__init__(admin, open_file, ops, region, tensors, grad_itemsize)
        if self._slots is None:
            region.mapping.close()
            raise RuntimeError(f"{self.location}: transport='cp' sends each step through Execute Program over "
                               "the CMB, which must hold a step's gradients and params at once (a larger "
                               "`cossd mount --cmb-size`, or another client's part freed)")
        # Each tensor's first element in the namespace's table order: its span's start.
        self._first_element: dict[str, int] = {}
        at = 0
        for name, numel in tensors:
            self._first_element[name] = at
            at += numel
        self._state_itemsize = state_itemsize
        self._program: CmbProgram | None = None  # made at the first step (it activates the program)

    def _send_step(self, nsid: int | None, slots: dict[str, Slot], tensors: list[str]) -> None:
        if self._program is None:
            self._program = CmbProgram(self.admin)
        base = self.region.base
        spans = [(self._first_element[t], slots[t][3] // 2, base + slots[t][0], base + slots[t][1]) for t in tensors]
        self._program.adamw_step(_opened(nsid), spans, state_itemsize=self._state_itemsize,
                                 grad_itemsize=self.grad_itemsize)


def _opened(nsid: int | None) -> int:
    """The nsid a CMB command names; None: the namespace is not open (a caller's slip)."""
    if nsid is None:
        raise RuntimeError("no namespace is open to move tensors through the CMB for")
    return nsid


def _length(array: Any) -> int:
    return int(array.shape[0])


def _param_place_bytes(numel: int, fp8_params: bool) -> int:
    """A tensor's params in a CMB step: 2 bytes an element, or param_fp8's header and codes."""
    return param_fp8.out_bytes(numel) if fp8_params else 2 * numel


def _step_slots(tensors: Sequence[tuple[str, int]], capacity: int, grad_itemsize: int = 2,
                fp8_params: bool = False) -> dict[str, Slot] | None:
    """Each tensor's fixed gradient and param places in a CMB part of `capacity` bytes, where
    every tensor's gradients (grad_itemsize bytes an element) and params (2-byte, or FP8 with
    fp8_params) fit at once; else None."""
    grad_sizes = [grad_itemsize * numel for _, numel in tensors]
    param_sizes = [_param_place_bytes(numel, fp8_params) for _, numel in tensors]
    batches = plan_cmb_batches(grad_sizes + param_sizes, capacity)
    if len(batches) != 1:
        return None
    placed = {item: at for item, _, _, at in batches[0]}
    return {name: (placed[item], placed[len(tensors) + item], grad_size, param_size)
            for item, ((name, _), grad_size, param_size) in enumerate(zip(tensors, grad_sizes, param_sizes))}


def open_step_transport(admin: AdminClient, open_file: OpenFile, ops: ByteOps, *, use_cmb: bool,
                        command_set: str, config: Callable[[], dict[str, Any]]) -> FileTransport:
    """The one choice of how a namespace's tensors cross: through a part of the device's CMB
    (as large as a step's gradients and params, 4 bytes a parameter with 16-bit gradients, where that much is free,
    else the largest part that is), by Execute Program over it where `command_set` is "cp",
    else through the files (use_cmb False, no CMB, every part taken, or a CMB this process may
    not open: the daemon's /proc/PID/fd of another user). `config` reads the namespace's
    config.json, only where a CMB part is to be claimed."""
    mapping = _map_cmb(admin) if use_cmb else None
    if mapping is None:
        return FileTransport(admin, open_file, ops)
    try:
        described = config()
    except BaseException:
        mapping.close()
        raise
    tensors = [(str(entry["name"]), int(entry["numel"])) for entry in described["tensors"]]
    grad_itemsize = GRAD_ITEMSIZE.get(str(described.get("grad_dtype", "fp16")), 2)
    fp8_params = described.get("param_wire_dtype") is not None
    if fp8_params and command_set == "cp":
        mapping.close()
        raise RuntimeError(f"{admin.transport.location}: namespace {described.get('name')!r} sends FP8 params "
                           f"(param_wire_dtype={described.get('param_wire_dtype')!r}), which Execute Program's "
                           "adamw_step does not: use the vendor transport")
    region = _claim(mapping, tensors, grad_itemsize, fp8_params)
    if region is None:
        return FileTransport(admin, open_file, ops)
    if command_set == "cp":
        state_itemsize = 2 if described.get("state_dtype") == "bf16" else 4
        return ProgramTransport(admin, open_file, ops, region, tensors, state_itemsize, grad_itemsize)
    return CmbTransport(admin, open_file, ops, region, tensors, grad_itemsize, fp8_params)


def _map_cmb(admin: AdminClient) -> CmbMapping | None:
    with device_lost(admin.transport.location):
        try:
            return admin.cmb()
        except PermissionError as exc:
            log.warning("%s: the device's memory buffer cannot be opened (%s); using the files",
                        admin.transport.location, exc)
            return None


def _claim(mapping: CmbMapping, tensors: Sequence[tuple[str, int]], grad_itemsize: int = 2,
           fp8_params: bool = False) -> CmbRegion | None:
    # Gradients and params, each tensor's padded to a cache line (plan_cmb_batches).
    wanted = sum(-(-size // CMB_ALIGN) * CMB_ALIGN for _, numel in tensors
                 for size in (grad_itemsize * numel, _param_place_bytes(numel, fp8_params)))
    region = mapping.claim(wanted)
    if region is None:
        mapping.close()
    return region
