"""One optimizer namespace on a mounted cossd device, seen through its files and control file."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...client import DEFAULT_TIMEOUT_S, AdminClient, CmbRegion, Credentials, is_remote
from ...client.lost import DeviceLostError, device_lost
from ...client.step_transport import FileTransport, Range, open_step_transport
from ...protocol.status import DeviceError, Status

log = logging.getLogger(__name__)

# What the device calls each wire dtype, and the torch dtype it holds.
WIRE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Bytes per gradient element of each grad_dtype a namespace may have.
GRAD_ITEMSIZE = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The torch dtype a gradient crosses in, per grad_dtype (FP8 codes go as their uint8 bits).
GRAD_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
                     "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

# DeviceLostError lives in the client (client/lost.py, the one translation); named here too,
# where the trainer has always exported it from.
__all__ = ["GRAD_ITEMSIZE", "GRAD_TORCH_DTYPES", "WIRE_DTYPES", "DeviceLostError", "NamespaceFiles", "committed_steps",
           "pin_for_cuda", "unpin_for_cuda"]


def _clear_cuda_error() -> None:
    """Read (and so clear) CUDA's last error: a failed cudaHostRegister or Unregister leaves
    it set, and torch would report it as its own at the next kernel launch. torch does not
    bind cudaGetLastError, so it is called in the libcudart this process has loaded."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                ctypes.CDLL(line.split()[-1]).cudaGetLastError()
                return
    log.warning("no libcudart in this process to clear CUDA's last error with; torch may report "
                "the failed page-locking at its next kernel launch")


# cudaHostRegisterPortable: every CUDA context sees the memory as page-locked, not only the
# current device's.
_CUDA_HOST_REGISTER_PORTABLE = 1


def pin_for_cuda(pointer: int, size: int, device: torch.device) -> bool:
    """Page-lock host memory for the GPUs (cudaHostRegister, portable, made with `device`
    current), so copies between a GPU and it go by DMA at the link's speed rather than
    through CUDA's staging buffer. False, with a warning, where CUDA refuses (the copies
    still work, only slower)."""
    with torch.cuda.device(device):
        status = int(torch.cuda.cudart().cudaHostRegister(pointer, size, _CUDA_HOST_REGISTER_PORTABLE))
    if status == 0:
        return True
    _clear_cuda_error()
    log.warning("cudaHostRegister of the CMB failed (CUDA error %d); GPU copies to and from it "
                "go through CUDA's staging buffer", status)
    return False


def unpin_for_cuda(pointer: int) -> None:
    """Undo pin_for_cuda (before the memory is unmapped)."""
    status = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if status != 0:
        _clear_cuda_error()
        log.warning("cudaHostUnregister of the CMB failed (CUDA error %d)", status)


class _TorchBytes:
    """How the step transports see the trainer's arrays: 1-D torch uint8 tensors, on any device."""

    def window(self, memory: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(memory)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source)

    def host_buffer(self, array: torch.Tensor) -> memoryview:
        return array.to("cpu").numpy().data


def _bytes_of(values: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a 1-D uint8 tensor on its own device (a copy only where it is not contiguous)."""
    return values.detach().contiguous().view(-1).view(torch.uint8)


class NamespaceFiles:
    """Gradient, param and state files of one namespace, opened once and kept open.

    Every transfer is a positional read or write of whole tensors: the device reassembles
    gradient blocks itself, and direct_io means nothing is cached on the trainer's side.
    How they cross (the files, the CMB, Execute Program over it) is the step transport's,
    chosen once at the first transfer (client/step_transport.py).
    """

    def __init__(self, mountpoint: str | os.PathLike[str], name: str,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, use_cmb: bool = True,
                 credentials: Credentials | None = None, command_set: str = "vendor") -> None:
        # A storage server's URL (cossd://HOST:PORT) stays a string: a Path folds its "//".
        self.mountpoint: Path | str = os.fspath(mountpoint) if is_remote(mountpoint) else Path(mountpoint)
        self.use_cmb = use_cmb  # False: the tensor files only, even where the device has a CMB
        # "cp": a step's gradients in the CMB go through the standard's Execute Program
        # (adamw_step, client/computational.py) instead of CMB_WRITE.
        self.command_set = command_set
        self.name = name
        self.root = self._root(name)
        # A server's token and TLS files (None: from the environment); kept so that a new
        # NamespaceFiles for another namespace of the same device (rebind) shows them too.
        self.credentials = credentials
        try:
            self.admin = AdminClient(self.mountpoint, timeout_s, credentials=credentials)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.mountpoint} is not a mounted cossd device (start one with `cossd mount`)"
            ) from None
        # Every file operation goes through it (a local mount's: under its watchdog, so a
        # stopped daemon becomes a DeviceTimeoutError).
        self.transport = self.admin.transport
        self.nsid: int | None = None
        self._fds: dict[tuple[str, str, bool], int] = {}
        # How this namespace's tensors cross, once chosen (step_transport()); it holds this
        # client's part of the CMB, if any.
        self._step: FileTransport | None = None
        self._cmb_pinned = 0  # the address cudaHostRegister took, to unregister at close
        # The namespace's gradient dtype and each tensor's element count, read from config.json
        # at the first gradient write (None: not yet), to refuse a gradient of the wrong size
        # here with its reason rather than as the device's bare EFBIG or EINVAL.
        self._grad_layout: tuple[str, dict[str, int]] | None = None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every handle; a dead mount's handles fail to close cleanly, which is fine."""
        self._close_files()
        if self._cmb_pinned:
            unpin_for_cuda(self._cmb_pinned)
            self._cmb_pinned = 0
        if self._step is not None:
            self._step.close()  # unmaps this client's part of the CMB, then lets go of its lock
        # Closed, nothing is chosen again: the files (whose handles fail now) from here on.
        self._step = FileTransport(self.admin, self._fd, _TorchBytes())
        try:
            self.admin.close()
        except OSError:
            pass

    def exists(self) -> bool:
        try:
            self.nsid = self.command(self.admin.nsid, self.name)
        except DeviceError as exc:
            if exc.status == Status.INVALID_NAMESPACE:
                return False
            raise
        return True

    def create(self, description: dict[str, Any]) -> None:
        self._grad_layout = None
        self.nsid = self.command(self.admin.create_namespace, description)

    def delete(self) -> None:
        self._close_files()
        if self.nsid is not None:
            self.command(self.admin.delete_namespace, self.nsid)
        self.nsid = None
        self._grad_layout = None

    def retarget(self, name: str, nsid: int | None) -> None:
        """Point these files at another namespace with the same tensors (the staging
        namespace of an atomic replace, trainer/namespace/swap.py); the CMB part stays."""
        self._close_files()
        self.name, self.root, self.nsid = name, self._root(name), nsid
        self._grad_layout = None
        self.step_began()

    def _root(self, name: str) -> Path | str:
        if isinstance(self.mountpoint, Path):
            return self.mountpoint / "ns" / name
        return f"{self.mountpoint}/ns/{name}"

    def _close_files(self) -> None:
        fds = list(self._fds.values())
        self._fds.clear()
        for fd in fds:
            try:
                self.transport.close_file(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------ control file

    def lost_guard(self) -> contextlib.AbstractContextManager[None]:
        """device_lost (client/lost.py) for this namespace's device: the one translation."""
        return device_lost(self.mountpoint, reachable=self.transport.reachable)

    def command(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one AdminClient call, turning a vanished daemon into DeviceLostError."""
        with self.lost_guard():
            return method(*args, **kwargs)

    def config(self) -> dict[str, Any]:
        return json.loads(self._read_text("config.json"))

    def statistics(self) -> dict[str, Any]:
        return self.command(self.admin.statistics, self.nsid)

    def _read_text(self, name: str) -> str:
        with self.lost_guard():
            return self.transport.read_text(f"ns/{self.name}/{name}")

    # ------------------------------------------------------------------ tensor files

    def _fd(self, tensor: str, role: str, writing: bool) -> int:
        # Separate read and write handles: state files turn read-only once the first step
        # seals them, so a handle opened for both would fail after loading.
        key = (tensor, role, writing)
        fd = self._fds.get(key)
        if fd is None:
            # Direct I/O for grad and param: on a local mount, the kernel's asynchronous
            # direct I/O sends a large write or read as several 1 MiB requests at once,
            # which the daemon serves in parallel.
            with self.lost_guard():
                fd = self.transport.open_file(f"ns/{self.name}/tensors/{tensor}/{role}", writing,
                                              direct=role in ("grad", "param"))
            self._fds[key] = fd
        return fd

    def check_grad(self, tensor: str, values: torch.Tensor, first: int | None = None) -> None:
        """Refuse, with the reason, gradients that do not fit `tensor`'s grad file: the whole
        tensor (first None) of another byte size, or a piece from element `first` whose
        elements are not the namespace's size or that runs past the end; and FP16 where the
        namespace takes BF16 or the other way round (the same size, read as the wrong numbers).
        The device would refuse the size too, but only as "File too large" or EINVAL."""
        if self._grad_layout is None:
            config = self.config()
            self._grad_layout = (config["grad_dtype"], {t["name"]: int(t["numel"]) for t in config["tensors"]})
        dtype, numels = self._grad_layout
        if tensor not in numels:
            return  # the device names an unknown tensor itself
        itemsize = GRAD_ITEMSIZE.get(dtype, 2)
        convert = f"convert to {dtype} (.to({GRAD_TORCH_DTYPES.get(dtype, torch.float16)}))"
        given = WIRE_DTYPES.get(values.dtype)
        if given is not None and given != dtype:
            raise ValueError(f"gradient for {tensor} is {given}, the namespace {self.name!r} takes {dtype}: {convert}")
        size = values.numel() * values.element_size()
        if first is None:
            if size != numels[tensor] * itemsize:
                raise ValueError(f"gradient for {tensor} has {size} bytes, the namespace {self.name!r} expects "
                                 f"{numels[tensor] * itemsize} bytes ({numels[tensor]} elements of {dtype}): "
                                 + (convert if values.numel() == numels[tensor] else "check the tensor it is for"))
        elif values.element_size() != itemsize or first < 0 or first + values.numel() > numels[tensor]:
            raise ValueError(f"gradient piece for {tensor} has {values.numel()} elements of {values.element_size()} "
                             f"bytes from element {first}, the namespace {self.name!r} expects {itemsize}-byte "
                             f"{dtype} elements within its {numels[tensor]}: "
                             + (convert if values.element_size() != itemsize else "check the range"))

    def write(self, tensor: str, role: str, values: torch.Tensor) -> int:
        """Write a tensor's bytes (copied to the host first if they are elsewhere) at offset 0
        of one of a tensor's files, through the file whatever the step transport; gradients
        are checked first (check_grad)."""
        if role == "grad":
            self.check_grad(tensor, values)
        return self.step_transport().write_files([(tensor, role, 0, _bytes_of(values))])

    def read_into(self, tensor: str, role: str, out: torch.Tensor) -> int:
        """Fill a contiguous CPU tensor with the committed bytes of one of a tensor's files."""
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU tensor")
        ranges: list[Range] = [(tensor, role, 0, out.view(-1).view(torch.uint8))]
        return self._complete(ranges, self.step_transport().read_files(ranges))

    def read(self, tensor: str, role: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self.read_into(tensor, role, out)
        return out

    @staticmethod
    def _complete(ranges: Sequence[Range], counts: list[int]) -> int:
        """The bytes read, where every range came whole; else EIO naming the file that ended."""
        for (tensor, role, start, array), count in zip(ranges, counts):
            if count != array.numel():
                raise OSError(errno.EIO, f"{tensor}/{role}: file ended at byte {start + count}")
        return sum(counts)

    # ------------------------------------------------------------------ the step transport

    def step_transport(self) -> FileTransport:
        """How this namespace's tensors cross, chosen at the first call (open_step_transport:
        the CMB, Execute Program over it, or the files) and the same from then on. Its CMB
        part is a range this client locks (OFD locks, which every cossd client takes), as
        large as a step's gradients and params where that much is free."""
        if self._step is None:
            self._step = open_step_transport(self.admin, self._fd, _TorchBytes(), use_cmb=self.use_cmb,
                                             command_set=self.command_set, config=self.config)
        return self._step

    def cmb(self) -> CmbRegion | None:
        """This client's part of the device's controller memory buffer; None where the step
        transport is the files."""
        return self.step_transport().cmb

    def pin_cmb_for_cuda(self, device: torch.device) -> bool:
        """Page-lock this client's part of the CMB for the GPUs' copies (see pin_for_cuda;
        `device` is a GPU the model is on). False where there is no part, or CUDA refused."""
        cmb = self.cmb()
        if cmb is None:
            return False
        if not self._cmb_pinned:
            pointer = cmb.array.ctypes.data
            if pin_for_cuda(pointer, cmb.size, device):
                self._cmb_pinned = pointer
        return bool(self._cmb_pinned)

    def step_began(self) -> None:
        """A new step: params put in the CMB by an earlier one are no longer the ones to read."""
        if self._step is not None:
            self._step.take_params_back()

    def stream_slots(self) -> dict[str, tuple[int, int, int, int]] | None:
        """Each tensor's fixed places in this client's CMB part, {tensor: (gradient offset,
        param offset, gradient bytes, param bytes)} (offsets in the part), where the part holds every tensor's
        gradients and params at once; else None. A step's gradients go there, streamed one
        tensor at a time (write_streamed) or all at once (write_many); without places,
        streamed gradients go through the files and whole steps through the CMB in batches."""
        return self.step_transport().slots()

    def write_streamed(self, grads: list[tuple[str, torch.Tensor, "torch.cuda.Event | None"]]) -> int:
        """Some tensors' gradients of the open step, (tensor, values, ready), from any device
        (a GPU's included) where stream_slots() has a place for them, in one command; else
        from the host, through each one's file. Through the CMB the device also puts each
        tensor's new params there as its kernel computes them, for read_many_into after the
        step's end. Returns once the tensors' complete blocks have run. `ready`: an event
        recorded where a GPU gradient was made (backward's stream), which this thread's copy
        must wait for."""
        for tensor, values, ready in grads:
            if ready is not None:
                ready.synchronize()
            self.check_grad(tensor, values)
        slots = self.stream_slots()
        if slots is None:
            return sum(self.write(tensor, "grad", values) for tensor, values, _ in grads)
        arrays = []
        for tensor, values, _ in grads:
            array = _bytes_of(values)
            if array.numel() != slots[tensor][2]:
                raise ValueError(f"{tensor}: {array.numel()} bytes of gradients, the tensor takes {slots[tensor][2]}")
            arrays.append((tensor, array))
        return self.step_transport().write_step_grads(self.nsid, arrays)

    def write_many(self, items: list[tuple[str, str, torch.Tensor]], params_back: bool = False) -> int:
        """write() of several (tensor, role, tensor) at offset 0 by the step transport: through
        the CMB, a copy into shared memory (from the tensor's own device, a GPU's included)
        and one command per CMB-full, instead of a FUSE write per tensor (each a copy in the
        kernel); through a storage server, one WRITE for all.

        params_back=True (gradients): where gradients and params fit the CMB together (each
        tensor has its places, stream_slots()), the device also puts each tensor's new
        params there as it computes them; the read_many_into of those params that follows
        the step's end then needs no command.
        """
        self.step_began()
        for tensor, role, values in items:
            if role == "grad":
                self.check_grad(tensor, values)
        if any(role in ("exp_avg", "exp_avg_sq") for _, role, _ in items) \
                and self.config().get("state_dtype") in ("fp16", "int8"):
            # Block-scaled moments are encoded per 256-element block: each goes whole through
            # its file (a one-off load), one pwrite; the device holds a block that the kernel's
            # requests (or a CMB batch) cut until its rest arrives (docs/media-format.md).
            moments = [item for item in items if item[1] in ("exp_avg", "exp_avg_sq")]
            rest = [item for item in items if item[1] not in ("exp_avg", "exp_avg_sq")]
            written = sum(self.write(tensor, role, values) for tensor, role, values in moments)
            return written + (self.write_many(rest) if rest else 0)
        step = self.step_transport()
        arrays = [_bytes_of(values) for _, _, values in items]
        slots = step.slots() if params_back else None
        if slots is not None and all(role == "grad" and tensor in slots and slots[tensor][2] == array.numel()
                                     for (tensor, role, _), array in zip(items, arrays)):
            return step.write_step_grads(self.nsid, [(tensor, array) for (tensor, _, _), array in zip(items, arrays)])
        return step.write(self.nsid, [(tensor, role, 0, array) for (tensor, role, _), array in zip(items, arrays)])

    def write_pieces(self, items: list[tuple[str, int, torch.Tensor]], role: str = "grad") -> int:
        """Pieces (tensor, first element, values) of one file of several tensors: a sharded
        optimizer's part of each tensor, its gradients (in the wire dtype, of the open step)
        or, with role="master", its FP32 master weights (before the first step seals the
        loading: each rank of an FSDP2 job loads its own rows). By the step transport: one
        command per CMB-full, a storage server's batched WRITE, or a file write per piece at
        its offset. Each piece's offset is its first element times the values' element size."""
        if role == "grad":
            for tensor, first, values in items:
                self.check_grad(tensor, values, first)
        # On the host first (as this always has), whichever way they then cross.
        ranges: list[Range] = [(tensor, role, first * values.element_size(), _bytes_of(values.detach().to("cpu")))
                               for tensor, first, values in items]
        return self.step_transport().write(self.nsid, ranges)

    def read_pieces_into(self, items: list[tuple[str, str, int, torch.Tensor]]) -> int:
        """Ranges of committed files: (tensor, role, first element, contiguous `out`) fills
        `out` with the file's elements first..first + out.numel() - 1 (an FSDP2 rank's own
        rows, a ZeRO-1 rank's shard). By the step transport: CMB_READ at the range's offset
        (`out` on any device, a GPU's included), a storage server's batched READ, or a
        positional read of each file (`out` on the host)."""
        for _, _, _, out in items:
            if not out.is_contiguous():
                raise ValueError("read_pieces_into needs contiguous tensors")
        step = self.step_transport()
        if not step.reaches_device_memory and any(out.device.type != "cpu" for *_, out in items):
            raise ValueError("read_pieces_into through the files needs CPU tensors")
        ranges: list[Range] = [(tensor, role, first * out.element_size(), out.view(-1).view(torch.uint8))
                               for tensor, role, first, out in items]
        return self._complete(ranges, step.read(self.nsid, ranges))

    def read_many_into(self, items: list[tuple[str, str, torch.Tensor]]) -> int:
        """read_into() of several (tensor, role, contiguous tensor) by the step transport (see
        write_many): through the CMB `out` may be on any device (a GPU's included), and params
        the step that ended put there need no command; through the files it must be on the host."""
        step = self.step_transport()
        for _, _, out in items:
            if step.reaches_device_memory and not out.is_contiguous():
                raise ValueError("read_many_into needs contiguous tensors")
            if not step.reaches_device_memory and (not out.is_contiguous() or out.device.type != "cpu"):
                raise ValueError("read_many_into through the files needs contiguous CPU tensors")
        arrays = [out.view(-1).view(torch.uint8) for _, _, out in items]
        back = step.take_params_back()
        cmb = step.cmb
        if cmb is not None and back and all(role == "param" and back.get(tensor, (0, -1))[1] == array.numel()
                                            for (tensor, role, _), array in zip(items, arrays)):
            # The step that ended put them there (write_many(params_back=True)).
            window = torch.from_numpy(cmb.array)
            for (tensor, _, _), array in zip(items, arrays):
                at, length = back[tensor]
                array.copy_(window[at : at + length])
            return sum(array.numel() for array in arrays)
        ranges: list[Range] = [(tensor, role, 0, array) for (tensor, role, _), array in zip(items, arrays)]
        return self._complete(ranges, step.read(self.nsid, ranges))


def committed_steps(members: Sequence[NamespaceFiles]) -> list[int]:
    """Each device's committed step of one namespace, as the device says now (one small
    command each): what every check that the devices are at one step asks."""
    return [int(files.statistics()["committed_step"]) for files in members]
