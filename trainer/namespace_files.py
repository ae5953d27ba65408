"""One optimizer namespace on a mounted cossd device, seen through its files and control file."""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..client import (DEFAULT_TIMEOUT_S, AdminClient, CmbRegion, Credentials, DeviceTimeoutError, is_remote,
                      plan_cmb_batches)
from ..client.cmb import CMB_ALIGN
from ..client.computational import CmbProgram
from ..protocol.status import DeviceError, Status

log = logging.getLogger(__name__)

# What the device calls each wire dtype, and the torch dtype it holds.
WIRE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# Bytes per gradient element of each grad_dtype a namespace may have.
GRAD_ITEMSIZE = {"fp16": 2, "bf16": 2}

# errnos that mean the daemon is gone or wedged rather than that a request was wrong.
# (EIO is not among them: the daemon answers EIO for a request it failed, and stays up.)
_LOST_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV, errno.ESHUTDOWN}


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


class DeviceLostError(RuntimeError):
    """The device stopped answering (daemon killed, mount gone); the committed step is safe."""


def _lost(mountpoint: Path | str, exc: OSError) -> DeviceLostError:
    return DeviceLostError(
        f"cossd device at {mountpoint} stopped answering ({exc.strerror or exc}); the last "
        "committed step is intact: remount it and create the optimizer again to resume"
    )


class NamespaceFiles:
    """Gradient, param and state files of one namespace, opened once and kept open.

    Every transfer is a positional read or write of whole tensors: the device reassembles
    gradient blocks itself, and direct_io means nothing is cached on the trainer's side.
    """

    def __init__(self, mountpoint: str | os.PathLike[str], name: str,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, use_cmb: bool = True,
                 credentials: Credentials | None = None, command_set: str = "vendor") -> None:
        # A storage server's URL (cossd://HOST:PORT) stays a string: a Path folds its "//".
        self.mountpoint: Path | str = os.fspath(mountpoint) if is_remote(mountpoint) else Path(mountpoint)
        self.use_cmb = use_cmb  # False: the tensor files only, even where the device has a CMB
        # "cp": a step's gradients in the CMB go through the standard's Execute Program
        # (adamw_step, client/computational.py) instead of CMB_WRITE; made on first use.
        self.command_set = command_set
        self._program: CmbProgram | None = None
        self._first_element: dict[str, int] = {}  # each tensor's first element in table order
        self._state_itemsize = 4
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
        # The part of the controller memory buffer this client holds (its mapping holds the
        # lock), once asked for (False: not yet).
        self._cmb: CmbRegion | None | bool = False
        self._cmb_pinned = 0  # the address cudaHostRegister took, to unregister at close
        # Params the device is putting in the CMB with this step's write_many(params_back=True)
        # or write_streamed: tensor -> (CMB offset, bytes); the step's end fills them (see
        # read_many_into).
        self._params_back: dict[str, tuple[int, int]] = {}
        # Streaming: each tensor's fixed place in this client's CMB part, once worked out
        # (False: not yet; None: the part cannot hold every gradient and param at once).
        self._stream_slots: dict[str, tuple[int, int, int]] | None | bool = False
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
        if isinstance(self._cmb, CmbRegion):
            self._cmb.mapping.close()  # unmaps, then lets go of the lock
        self._cmb = None
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
        namespace of an atomic replace, trainer/namespace_swap.py); the CMB part stays."""
        self._close_files()
        self.name, self.root, self.nsid = name, self._root(name), nsid
        self._grad_layout = None
        self._params_back = {}

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

    def command(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one AdminClient call, turning a vanished daemon into DeviceLostError."""
        try:
            return method(*args, **kwargs)
        except DeviceTimeoutError:
            raise
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS or exc.errno is None:
                # errno None: the control file returned no completion (a dead queue pair).
                raise _lost(self.mountpoint, exc) from exc
            raise

    def config(self) -> dict[str, Any]:
        return json.loads(self._read_text("config.json"))

    def statistics(self) -> dict[str, Any]:
        return self.command(self.admin.statistics, self.nsid)

    def _read_text(self, name: str) -> str:
        try:
            return self.transport.read_text(f"ns/{self.name}/{name}")
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS or not self.transport.reachable():
                raise _lost(self.mountpoint, exc) from exc
            raise

    # ------------------------------------------------------------------ tensor files

    def _fd(self, tensor: str, role: str, writing: bool) -> int:
        # Separate read and write handles: state files turn read-only once the first step
        # seals them, so a handle opened for both would fail after loading.
        key = (tensor, role, writing)
        fd = self._fds.get(key)
        if fd is None:
            try:
                # Direct I/O for grad and param: on a local mount, the kernel's asynchronous
                # direct I/O sends a large write or read as several 1 MiB requests at once,
                # which the daemon serves in parallel.
                fd = self.transport.open_file(f"ns/{self.name}/tensors/{tensor}/{role}", writing,
                                              direct=role in ("grad", "param"))
            except OSError as exc:
                if exc.errno in _LOST_ERRNOS or not self.transport.reachable():
                    raise _lost(self.mountpoint, exc) from exc
                raise
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
        convert = f"convert to {dtype} (.to(torch.{'bfloat16' if dtype == 'bf16' else 'float16'}))"
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
        of one of a tensor's files; gradients are checked first (check_grad)."""
        if role == "grad":
            self.check_grad(tensor, values)
        array = values.detach().to("cpu").contiguous().view(-1)
        buffer = array.view(torch.uint8).numpy().data
        fd = self._fd(tensor, role, writing=True)
        offset = 0
        try:
            while offset < len(buffer):
                offset += self.transport.write_at(fd, buffer[offset:], offset)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise OSError(exc.errno, f"writing {tensor}/{role}: {exc.strerror}") from exc
        return offset

    def read_into(self, tensor: str, role: str, out: torch.Tensor) -> int:
        """Fill a contiguous CPU tensor with the committed bytes of one of a tensor's files."""
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU tensor")
        buffer = out.view(-1).view(torch.uint8).numpy().data
        fd = self._fd(tensor, role, writing=False)
        offset = 0
        try:
            while offset < len(buffer):
                count = self.transport.read_at(fd, buffer[offset:], offset)
                if count == 0:
                    raise OSError(errno.EIO, f"{tensor}/{role}: file ended at byte {offset}")
                offset += count
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise
        return offset

    def read(self, tensor: str, role: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype)
        self.read_into(tensor, role, out)
        return out

    # ------------------------------------------------------------------ the CMB

    def cmb(self) -> CmbRegion | None:
        """This client's part of the device's controller memory buffer: a range it locks
        (OFD locks, which every cossd client takes), as large as a step's gradients and
        params (4 bytes a parameter) where that much is free, else the largest part that is.
        None where the device has none, other clients hold all of it, or this process may
        not open it (the daemon's /proc/PID/fd of another user): then the files serve."""
        if self._cmb is False:
            self._cmb = None
            if not self.use_cmb:
                return None
            try:
                mapping = self.command(self.admin.cmb)
            except PermissionError as exc:
                log.warning("%s: the device's memory buffer cannot be opened (%s); using the files",
                            self.mountpoint, exc)
                return None
            if mapping is not None:
                # Gradients and params, each tensor's padded to a cache line (plan_cmb_batches).
                wanted = 2 * sum(-(-2 * int(t["numel"]) // CMB_ALIGN) * CMB_ALIGN
                                 for t in self.config()["tensors"])
                region = mapping.claim(wanted)
                if region is not None:
                    self._cmb = region
                else:
                    mapping.close()
        return self._cmb if isinstance(self._cmb, CmbRegion) else None

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
        self._params_back = {}

    def stream_slots(self) -> dict[str, tuple[int, int, int]] | None:
        """Each tensor's fixed places in this client's CMB part, {tensor: (gradient offset,
        param offset, bytes)} (offsets in the part), where the part holds every tensor's
        gradients and params at once; else None. A step's gradients go there, streamed one
        tensor at a time (write_streamed) or all at once (write_many); without places,
        streamed gradients go through the files and whole steps through the CMB in batches."""
        if self._stream_slots is False:
            slots = None
            cmb = self.cmb()
            if cmb is not None:
                tensors = [(t["name"], 2 * int(t["numel"])) for t in self.config()["tensors"]]
                sizes = [size for _, size in tensors]
                batches = plan_cmb_batches(sizes + sizes, cmb.size)
                if len(batches) == 1:
                    placed = {item: at for item, _, _, at in batches[0]}
                    slots = {name: (placed[item], placed[len(tensors) + item], size)
                             for item, (name, size) in enumerate(tensors)}
            self._stream_slots = slots  # only once worked out: a failed read is tried again
        return self._stream_slots if isinstance(self._stream_slots, dict) else None

    def write_streamed(self, tensor: str, values: torch.Tensor,
                       ready: "torch.cuda.Event | None" = None) -> int:
        """One tensor's gradients of the open step (from any device, a GPU's included, where
        stream_slots() has a place for them; else from the host, through its file). Through
        the CMB the device also puts the tensor's new params there as its kernel computes
        them, for read_many_into after the step's end. The command returns once the
        tensor's complete blocks have run. `ready`: an event recorded where a GPU gradient
        was made (backward's stream), which this thread's copy must wait for."""
        if ready is not None:
            ready.synchronize()
        self.check_grad(tensor, values)
        slots = self.stream_slots()
        if slots is None:
            return self.write(tensor, "grad", values)
        array = values.detach().contiguous().view(-1).view(torch.uint8)
        if array.numel() != slots[tensor][2]:
            raise ValueError(f"{tensor}: {array.numel()} bytes of gradients, the tensor takes {slots[tensor][2]}")
        return self._grads_to_slots([(tensor, array)])

    def _grads_to_slots(self, grads: list[tuple[str, torch.Tensor]]) -> int:
        """Gradients (tensor, their bytes, of the size stream_slots() gives) copied into their
        fixed places in the CMB and sent in one CMB_WRITE, which has the device put each
        tensor's new params in its params place; noted for read_many_into."""
        cmb, slots = self.cmb(), self.stream_slots()
        assert cmb is not None and slots is not None
        window = torch.from_numpy(cmb.array)
        for tensor, array in grads:
            grad_at, _, size = slots[tensor]
            window[grad_at : grad_at + size].copy_(array)
        if self.command_set == "cp":
            self._execute_program(cmb.base, slots, [tensor for tensor, _ in grads])
        else:
            self.command(self.admin.cmb_write, self.nsid, [
                {"tensor": tensor, "length": slots[tensor][2], "cmb_offset": cmb.base + slots[tensor][0],
                 "param_cmb_offset": cmb.base + slots[tensor][1]} for tensor, _ in grads])
        self._params_back.update({tensor: slots[tensor][1:] for tensor, _ in grads})
        return sum(slots[tensor][2] for tensor, _ in grads)

    def _execute_program(self, base: int, slots: dict[str, tuple[int, int, int]], tensors: list[str]) -> None:
        """_grads_to_slots through Execute Program: each tensor's span of the namespace's
        elements (table order), its gradients and params at their CMB places."""
        if self._program is None:
            config = self.config()
            self._first_element, at = {}, 0
            for entry in config["tensors"]:
                self._first_element[entry["name"]] = at
                at += int(entry["numel"])
            self._state_itemsize = 2 if config.get("state_dtype") == "bf16" else 4
            self._program = self.command(CmbProgram, self.admin)
        spans = [(self._first_element[t], slots[t][2] // 2, base + slots[t][0], base + slots[t][1]) for t in tensors]
        self.command(self._program.adamw_step, self.nsid, spans, state_itemsize=self._state_itemsize)

    def write_many(self, items: list[tuple[str, str, torch.Tensor]], params_back: bool = False) -> int:
        """write() of several (tensor, role, tensor) at offset 0, through the CMB where there
        is one: a copy into shared memory (from the tensor's own device, a GPU's included)
        and one command per CMB-full, instead of a FUSE write per tensor (each a copy in the
        kernel).

        params_back=True (gradients): where gradients and params fit the CMB together (each
        tensor has its places, stream_slots()), the device also puts each tensor's new
        params there as it computes them; the read_many_into of those params that follows
        the step's end then needs no command.
        """
        self._params_back = {}
        for tensor, role, values in items:
            if role == "grad":
                self.check_grad(tensor, values)
        if any(role in ("exp_avg", "exp_avg_sq") for _, role, _ in items) \
                and self.config().get("state_dtype") in ("fp16", "int8"):
            # Block-scaled moments load only in whole 256-element blocks, and the CMB may cut
            # a tensor anywhere: each moment goes whole through its file (a one-off load).
            moments = [item for item in items if item[1] in ("exp_avg", "exp_avg_sq")]
            rest = [item for item in items if item[1] not in ("exp_avg", "exp_avg_sq")]
            written = sum(self.write(tensor, role, values) for tensor, role, values in moments)
            return written + (self.write_many(rest) if rest else 0)
        cmb = self.cmb()
        if cmb is None:
            many = getattr(self.transport, "write_many", None)  # a storage server's WRITE
            if many is not None and len(items) > 1:
                return self._write_batched(many, items)
            return sum(self.write(tensor, role, values) for tensor, role, values in items)
        arrays = [values.detach().contiguous().view(-1).view(torch.uint8) for _, _, values in items]
        sizes = [array.numel() for array in arrays]
        slots = self.stream_slots() if params_back else None
        if self.command_set == "cp" and params_back and slots is None:
            raise RuntimeError(f"{self.mountpoint}: transport='cp' sends each step through Execute Program over "
                               "the CMB, which must hold a step's gradients and params at once (a larger "
                               "`cossd mount --cmb-size`, or another client's part freed)")
        if slots is not None and all(role == "grad" and tensor in slots and slots[tensor][2] == size
                                     for (tensor, role, _), size in zip(items, sizes)):
            return self._grads_to_slots([(tensor, array) for (tensor, _, _), array in zip(items, arrays)])
        window = torch.from_numpy(cmb.array)
        for batch in plan_cmb_batches(sizes, cmb.size):
            for item, offset, length, at in batch:
                window[at : at + length].copy_(arrays[item][offset : offset + length])
            self.command(self.admin.cmb_write, self.nsid, [
                {"tensor": items[item][0], "role": items[item][1], "offset": offset, "length": length,
                 "cmb_offset": cmb.base + at} for item, offset, length, at in batch])
        return sum(sizes)

    def write_pieces(self, items: list[tuple[str, int, torch.Tensor]], role: str = "grad") -> int:
        """Pieces (tensor, first element, values) of one file of several tensors: a sharded
        optimizer's part of each tensor, its gradients (in the wire dtype, of the open step)
        or, with role="master", its FP32 master weights (before the first step seals the
        loading: each rank of an FSDP2 job loads its own rows). Through the CMB where there is
        one (one command per CMB-full), else a storage server's batched WRITE, else a file
        write per piece at its offset. Each piece's offset is its first element times the
        values' element size."""
        if role == "grad":
            for tensor, first, values in items:
                self.check_grad(tensor, values, first)
        arrays = [values.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for _, _, values in items]
        starts = [first * values.element_size() for _, first, values in items]
        cmb = self.cmb()
        if cmb is not None:
            window = torch.from_numpy(cmb.array)
            for batch in plan_cmb_batches([array.numel() for array in arrays], cmb.size):
                for item, offset, length, at in batch:
                    window[at : at + length].copy_(arrays[item][offset : offset + length])
                self.command(self.admin.cmb_write, self.nsid, [
                    {"tensor": items[item][0], "role": role, "offset": starts[item] + offset, "length": length,
                     "cmb_offset": cmb.base + at} for item, offset, length, at in batch])
            return sum(array.numel() for array in arrays)
        ranges = [(self._fd(tensor, role, writing=True), array.numpy().data, at)
                  for (tensor, _, _), array, at in zip(items, arrays, starts)]
        many = getattr(self.transport, "write_many", None)  # a storage server's WRITE
        try:
            if many is not None and len(ranges) > 1:
                return many(ranges)
            for fd, buffer, at in ranges:
                done = 0
                while done < len(buffer):
                    done += self.transport.write_at(fd, buffer[done:], at + done)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise
        return sum(len(buffer) for _, buffer, _ in ranges)

    def read_pieces_into(self, items: list[tuple[str, str, int, torch.Tensor]]) -> int:
        """Ranges of committed files: (tensor, role, first element, contiguous `out`) fills
        `out` with the file's elements first..first + out.numel() - 1 (an FSDP2 rank's own
        rows, a ZeRO-1 rank's shard). Through the CMB (CMB_READ at the range's offset; `out`
        on any device, a GPU's included), else a storage server's batched READ, else a
        positional read of each file (`out` on the host)."""
        for _, _, _, out in items:
            if not out.is_contiguous():
                raise ValueError("read_pieces_into needs contiguous tensors")
        arrays = [out.view(-1).view(torch.uint8) for _, _, _, out in items]
        starts = [first * out.element_size() for _, _, first, out in items]
        cmb = self.cmb()
        if cmb is not None:
            window = torch.from_numpy(cmb.array)
            for batch in plan_cmb_batches([array.numel() for array in arrays], cmb.size):
                self.command(self.admin.cmb_read, self.nsid, [
                    {"tensor": items[item][0], "role": items[item][1], "offset": starts[item] + offset,
                     "length": length, "cmb_offset": cmb.base + at} for item, offset, length, at in batch])
                for item, offset, length, at in batch:
                    arrays[item][offset : offset + length].copy_(window[at : at + length])
            return sum(array.numel() for array in arrays)
        for _, _, _, out in items:
            if out.device.type != "cpu":
                raise ValueError("read_pieces_into through the files needs CPU tensors")
        ranges = [(self._fd(tensor, role, writing=False), array.numpy().data, at)
                  for (tensor, role, _, _), array, at in zip(items, arrays, starts)]
        many = getattr(self.transport, "read_many", None)  # a storage server's READ
        try:
            if many is not None and len(ranges) > 1:
                counts = many(ranges)
            else:
                counts = []
                for fd, buffer, at in ranges:
                    done = 0
                    while done < len(buffer):
                        count = self.transport.read_at(fd, buffer[done:], at + done)
                        if count == 0:
                            break
                        done += count
                    counts.append(done)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise
        for (tensor, role, _, _), (_, buffer, at), count in zip(items, ranges, counts):
            if count != len(buffer):
                raise OSError(errno.EIO, f"{tensor}/{role}: file ended at byte {at + count}")
        return sum(counts)

    def read_many_into(self, items: list[tuple[str, str, torch.Tensor]]) -> int:
        """read_into() of several (tensor, role, contiguous tensor), through the CMB where
        there is one (see write_many), and then `out` may be on any device (a GPU's
        included); through the files it must be on the host."""
        cmb = self.cmb()
        if cmb is None:
            many = getattr(self.transport, "read_many", None)  # a storage server's READ
            if many is not None and len(items) > 1:
                return self._read_batched(many, items)
            return sum(self.read_into(tensor, role, out) for tensor, role, out in items)
        for _, _, out in items:
            if not out.is_contiguous():
                raise ValueError("read_many_into needs contiguous tensors")
        arrays = [out.view(-1).view(torch.uint8) for _, _, out in items]
        window = torch.from_numpy(cmb.array)
        back, self._params_back = self._params_back, {}
        if back and all(role == "param" and back.get(tensor, (0, -1))[1] == array.numel()
                        for (tensor, role, _), array in zip(items, arrays)):
            # The step that ended put them there (write_many(params_back=True)).
            for (tensor, _, _), array in zip(items, arrays):
                at, length = back[tensor]
                array.copy_(window[at : at + length])
            return sum(array.numel() for array in arrays)
        for batch in plan_cmb_batches([array.numel() for array in arrays], cmb.size):
            self.command(self.admin.cmb_read, self.nsid, [
                {"tensor": items[item][0], "role": items[item][1], "offset": offset, "length": length,
                 "cmb_offset": cmb.base + at} for item, offset, length, at in batch])
            for item, offset, length, at in batch:
                arrays[item][offset : offset + length].copy_(window[at : at + length])
        return sum(array.numel() for array in arrays)

    # ------------------------------------------------------------------ batched transfers

    def _write_batched(self, many: Any, items: list[tuple[str, str, torch.Tensor]]) -> int:
        """write() of several tensors in as few commands as the transport's write_many takes
        (a storage server's WRITE: a step's gradients in one, from the tensors' own host
        memory to the socket)."""
        arrays = [values.detach().to("cpu").contiguous().view(-1).view(torch.uint8) for _, _, values in items]
        ranges = [(self._fd(tensor, role, writing=True), array.numpy().data, 0)
                  for (tensor, role, _), array in zip(items, arrays)]
        try:
            return many(ranges)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise

    def _read_batched(self, many: Any, items: list[tuple[str, str, torch.Tensor]]) -> int:
        """read_into() of several tensors in as few commands as the transport's read_many
        takes (a storage server's READ: every param of a step in one, each received straight
        into its tensor)."""
        for _, _, out in items:
            if not out.is_contiguous() or out.device.type != "cpu":
                raise ValueError("read_many_into through the files needs contiguous CPU tensors")
        ranges = [(self._fd(tensor, role, writing=False), out.view(-1).view(torch.uint8).numpy().data, 0)
                  for tensor, role, out in items]
        try:
            counts = many(ranges)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise
        for (tensor, role, _), (_, buffer, _), count in zip(items, ranges, counts):
            if count != len(buffer):
                raise OSError(errno.EIO, f"{tensor}/{role}: file ended at byte {count}")
        return sum(counts)
