"""One optimizer namespace on a mounted cossd device, seen through its files and control file."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import torch

from cossd.emulator.errors import DeviceError, Status
from cossd.tools.client import DEFAULT_TIMEOUT_S, AdminClient, DeviceTimeoutError

# What the device calls each wire dtype, and the torch dtype it holds.
WIRE_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

# errnos that mean the daemon is gone or wedged rather than that a request was wrong.
# (EIO is not among them: the daemon answers EIO for a request it failed, and stays up.)
_LOST_ERRNOS = {errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV, errno.ESHUTDOWN}


class DeviceLostError(RuntimeError):
    """The device stopped answering (daemon killed, mount gone); the committed step is safe."""


def _lost(mountpoint: Path, exc: OSError) -> DeviceLostError:
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
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.mountpoint = Path(mountpoint)
        self.name = name
        self.root = self.mountpoint / "ns" / name
        try:
            self.admin = AdminClient(self.mountpoint, timeout_s)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.mountpoint} is not a mounted cossd device (start one with `cossd mount`)"
            ) from None
        # Every file operation goes through it: a stopped daemon becomes a DeviceTimeoutError.
        self._call: Any = self.admin.watchdog.call
        self.nsid: int | None = None
        self._fds: dict[tuple[str, str, bool], int] = {}

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every handle; a dead mount's handles fail to close cleanly, which is fine."""
        self._close_files()
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
        self.nsid = self.command(self.admin.create_namespace, description)

    def delete(self) -> None:
        self._close_files()
        if self.nsid is not None:
            self.command(self.admin.delete_namespace, self.nsid)
        self.nsid = None

    def _close_files(self) -> None:
        fds = list(self._fds.values())
        self._fds.clear()
        for fd in fds:
            if self.admin.watchdog.stuck:
                self.admin.watchdog.close_later(fd)
                continue
            try:
                self._call(lambda fd=fd: os.close(fd))
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
            return self._call((self.root / name).read_text)
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS or not (self.mountpoint / ".admin").exists():
                raise _lost(self.mountpoint, exc) from exc
            raise

    # ------------------------------------------------------------------ tensor files

    def _fd(self, tensor: str, role: str, writing: bool) -> int:
        # Separate read and write handles: state files turn read-only once the first step
        # seals them, so a handle opened for both would fail after loading.
        key = (tensor, role, writing)
        fd = self._fds.get(key)
        if fd is None:
            flags = os.O_WRONLY if writing else os.O_RDONLY
            if role in ("grad", "param"):
                # The kernel's asynchronous direct I/O: a large write or read goes out as
                # several 1 MiB requests at once, which the daemon serves in parallel.
                flags |= os.O_DIRECT
            try:
                fd = self._call(lambda: os.open(self.root / "tensors" / tensor / role, flags),
                                if_late=os.close)
            except OSError as exc:
                if exc.errno in _LOST_ERRNOS or not (self.mountpoint / ".admin").exists():
                    raise _lost(self.mountpoint, exc) from exc
                raise
            self._fds[key] = fd
        return fd

    def write(self, tensor: str, role: str, values: torch.Tensor) -> int:
        """Write a CPU tensor's bytes at offset 0 of one of a tensor's files."""
        array = values.detach().contiguous().view(-1)
        buffer = memoryview(array.view(torch.uint8).numpy())
        fd = self._fd(tensor, role, writing=True)
        offset = 0
        try:
            while offset < len(buffer):
                offset += self._call(lambda: os.pwrite(fd, buffer[offset:], offset))
        except OSError as exc:
            if exc.errno in _LOST_ERRNOS:
                raise _lost(self.mountpoint, exc) from exc
            raise OSError(exc.errno, f"writing {tensor}/{role}: {exc.strerror}") from exc
        return offset

    def read_into(self, tensor: str, role: str, out: torch.Tensor) -> int:
        """Fill a contiguous CPU tensor with the committed bytes of one of a tensor's files."""
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("read_into needs a contiguous CPU tensor")
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        fd = self._fd(tensor, role, writing=False)
        offset = 0
        try:
            while offset < len(buffer):
                count = self._call(lambda: os.preadv(fd, [buffer[offset:]], offset))
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

