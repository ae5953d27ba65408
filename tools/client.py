"""A client of a mounted device's control file: submit commands, read completions."""
from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
import queue
import re
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from cossd.protocol import logpages
from cossd.protocol.status import DeviceError, Status
from cossd.protocol.logpages import LogId
from cossd.protocol.entries import (
    COMPLETION,
    NSID_ALL,
    Completion,
    Opcode,
    decode_completion,
    encode_submission,
    f64_to_dwords,
    status_error,
)

ADMIN_FILE = ".admin"
# How long a client waits for one answer before declaring the daemon hung (None: forever).
DEFAULT_TIMEOUT_S = 120.0

T = TypeVar("T")

# How a mount of the daemon shows in /proc/self/mountinfo (fs/daemon.py sets both).
MOUNT_FSTYPE = "fuse.cossd"
FSNAME_PREFIX = "cossd:"


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mounted_devices(mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> list[tuple[Path, Path]]:
    """(mountpoint, backing directory) of every cossd mount, in mount order."""
    devices = []
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            if not separator:
                continue
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if len(fields) < 5 or len(fs) < 2 or fs[0] != MOUNT_FSTYPE:
                continue
            source = _unescape_mountinfo(fs[1])
            backing = source.removeprefix(FSNAME_PREFIX)
            devices.append((Path(_unescape_mountinfo(fields[4])), Path(backing)))
    return devices


def mount_type_at(path: os.PathLike[str], mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> str | None:
    """The filesystem type mounted on `path` (the topmost mount there), or None if nothing is."""
    target = os.path.realpath(path)
    found = None
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if separator and len(fields) >= 5 and fs and _unescape_mountinfo(fields[4]) == target:
                found = fs[0]  # later lines are mounts on top of earlier ones
    return found


class DeviceTimeoutError(TimeoutError):
    """The daemon did not answer in time: stopped (SIGSTOP), hung or badly overloaded."""


class Watchdog:
    """Runs blocking calls on a worker thread, so a hung daemon becomes a DeviceTimeoutError.

    A system call on a FUSE file whose daemon is stopped blocks until the daemon resumes or
    dies. The worker is a daemon thread: if it stays stuck, it does not hold up exit. Once a
    call timed out, every later call fails at once (the worker is still stuck in the old one).
    """

    def __init__(self, mountpoint: Path, timeout_s: float | None) -> None:
        self.mountpoint = mountpoint
        self.timeout_s = timeout_s
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]" = (
            queue.SimpleQueue())
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stuck: str | None = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)

    def call(self, work: Callable[[], T], *, if_late: Callable[[T], None] | None = None) -> T:
        """work(), or DeviceTimeoutError after timeout_s. `if_late` receives the result of a
        call that completes after it timed out (to close a file that opened too late)."""
        if self.timeout_s is None:
            return work()
        if self._stuck is not None:
            raise DeviceTimeoutError(self._stuck)
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="cossd-io", daemon=True)
                self._worker.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((work, future))
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            if if_late is not None:
                future.add_done_callback(
                    lambda done: if_late(done.result()) if done.exception() is None else None)
            self._stuck = (
                f"the cossd daemon at {self.mountpoint} did not answer within {self.timeout_s:g} s "
                "(stopped, hung or overloaded?); check its process, then remount if it is gone"
            )
            raise DeviceTimeoutError(self._stuck) from None

    @property
    def stuck(self) -> bool:
        return self._stuck is not None

    def close_later(self, fd: int) -> None:
        """Close `fd` without waiting: a close is a request the daemon must answer too."""
        threading.Thread(target=_close_quietly, args=(fd,), name="cossd-close", daemon=True).start()

    def close(self) -> None:
        if self._worker is not None and self._stuck is None:
            self._jobs.put(None)
        self._worker = None


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class AdminClient:
    """One queue pair: an open() of MOUNTPOINT/.admin. Not thread-safe; open one per thread."""

    def __init__(self, mountpoint: str | os.PathLike[str],
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.mountpoint = Path(mountpoint)
        self.watchdog = Watchdog(self.mountpoint, timeout_s)
        self.fd = -1
        path = self.mountpoint / ADMIN_FILE
        try:
            self.fd = self.watchdog.call(lambda: os.open(path, os.O_RDWR), if_late=_close_quietly)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.mountpoint} is not a mounted cossd device") from None
        self._cid = 0

    def close(self) -> None:
        # Forget the fd first: close() of a dead mount's file fails (ENOTCONN) yet frees it.
        fd, self.fd = self.fd, -1
        try:
            if fd >= 0 and self.watchdog.stuck:
                self.watchdog.close_later(fd)
            elif fd >= 0:
                self.watchdog.call(lambda: os.close(fd))
        finally:
            self.watchdog.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _read_exact(self, count: int) -> bytes:
        chunks = []
        while count:
            chunk = os.read(self.fd, count)
            if not chunk:
                raise OSError("control file returned no completion")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def submit(self, opcode: int, *, payload: bytes = b"", **fields: int) -> Completion:
        """Send one command and return its completion (whatever its status).

        An OSError here is the errno channel: the submission itself was malformed.
        """
        self._cid = (self._cid + 1) & 0xFFFF
        raw = encode_submission(opcode, cid=self._cid, payload=payload, **fields)

        def exchange() -> Completion:
            os.write(self.fd, raw)
            header = self._read_exact(COMPLETION.itemsize)
            completion, data_len = decode_completion(header)
            data = self._read_exact(data_len) if data_len else b""
            return Completion(completion.cid, completion.status, completion.result, data)

        return self.watchdog.call(exchange)

    def call(self, opcode: int, *, allow: tuple[Status, ...] = (), **fields: Any) -> Completion:
        """Submit and raise DeviceError unless the status is SUCCESS (or in `allow`)."""
        completion = self.submit(opcode, **fields)
        if completion.status != Status.SUCCESS and completion.status not in allow:
            raise status_error(completion)
        return completion

    # ------------------------------------------------------------------ typed commands

    def describe(self) -> dict[str, Any]:
        return json.loads(self.call(Opcode.VENDOR_IDENTIFY).data)

    def nsid(self, name: str) -> int:
        for entry in self.describe()["namespaces"]:
            if entry["name"] == name:
                return int(entry["nsid"])
        raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace named {name!r}")

    def create_namespace(self, description: dict[str, Any]) -> int:
        payload = json.dumps(description).encode()
        return self.call(Opcode.CREATE_NAMESPACE, payload=payload).result

    def delete_namespace(self, nsid: int) -> None:
        self.call(Opcode.DELETE_NAMESPACE, nsid=nsid)

    def begin_step(self, nsid: int, step: int = 0, grad_scale: float = 1.0) -> int:
        low, high = f64_to_dwords(grad_scale)
        completion = self.call(
            Opcode.BEGIN_STEP, nsid=nsid, cdw10=step & 0xFFFFFFFF, cdw11=step >> 32,
            cdw12=low, cdw13=high,
        )
        return int(json.loads(completion.data)["step"])

    def commit_step(self, nsid: int) -> dict[str, Any]:
        """Commit; the result says whether the step was skipped (non-finite gradients)."""
        completion = self.call(Opcode.COMMIT_STEP, nsid=nsid, allow=(Status.STEP_SKIPPED_NONFINITE,))
        return json.loads(completion.data)

    def abort_step(self, nsid: int) -> int:
        return int(json.loads(self.call(Opcode.ABORT_STEP, nsid=nsid).data)["aborted_step"])

    def set_hyperparameters(self, nsid: int, **changes: Any) -> dict[str, Any]:
        payload = json.dumps(changes).encode()
        return json.loads(self.call(Opcode.SET_HYPERPARAMETERS, nsid=nsid, payload=payload).data)

    def statistics(self, nsid: int) -> dict[str, Any]:
        return json.loads(self.call(Opcode.NAMESPACE_STATISTICS, nsid=nsid).data)

    def flush(self, nsid: int) -> int:
        return self.call(Opcode.FLUSH, nsid=nsid).result

    def get_log_page(self, log_id: int, nsid: int = NSID_ALL, length: int | None = None,
                     offset: int = 0) -> bytes:
        """The raw bytes of log page `log_id` (cdw10 bits 7:0): the whole page, or `length`
        bytes (a multiple of 4, as NUMD counts dwords) from byte `offset`, fewer where the
        page ends first."""
        if length is None:
            numd = 0xFFFF_FFFF  # as many dwords as NUMD can ask for: the whole page
        elif length <= 0 or length % 4 or length > 1 << 34:
            raise ValueError(f"a log page length is a positive multiple of 4 up to 16 GiB, got {length}")
        else:
            numd = length // 4 - 1
        if not 0 <= offset < 1 << 64:
            raise ValueError(f"a log page offset is 0 to 2**64-1, got {offset}")
        return self.call(Opcode.GET_LOG_PAGE, nsid=nsid, cdw10=(log_id & 0xFF) | (numd & 0xFFFF) << 16,
                         cdw11=numd >> 16, cdw12=offset & 0xFFFF_FFFF, cdw13=offset >> 32).data

    def smart_log(self) -> dict[str, int]:
        """SMART / Health Information, keyed as nvme-cli's `smart-log -o json` prints it."""
        return logpages.decode_smart(self.get_log_page(LogId.SMART))

    def error_log(self) -> list[dict[str, int]]:
        """The valid Error Information entries, newest first, keyed as nvme-cli prints them."""
        return logpages.decode_error_log(self.get_log_page(LogId.ERROR))

    def optimizer_log(self, nsid: int = NSID_ALL) -> dict[str, Any]:
        """The vendor page C0h: per-namespace optimizer statistics, by namespace name."""
        return json.loads(self.get_log_page(LogId.OPTIMIZER_STATISTICS, nsid))

    def scrub(self, nsid: int = NSID_ALL) -> dict[str, Any]:
        """Verify block checksums: {namespace: {"blocks": N, "bad": [[tensor, block], ...]}}."""
        return json.loads(self.call(Opcode.SCRUB, nsid=nsid).data)

    def cmb(self) -> "CmbMapping | None":
        """The controller memory buffer, mapped into this process; None if the device has none."""
        info = self.describe().get("cmb")
        return CmbMapping(info["path"], int(info["size"])) if info else None

    def cmb_write(self, nsid: int, transfers: list[dict[str, Any]]) -> dict[str, Any]:
        """CMB_WRITE: tensor-file bytes from the CMB (each transfer: tensor, role (default
        grad), offset, length, cmb_offset). A step it completes and the device skips is
        reported in the result's "commit" rather than raised."""
        completion = self.call(Opcode.CMB_WRITE, nsid=nsid, payload=json.dumps(transfers).encode(),
                               allow=(Status.STEP_SKIPPED_NONFINITE,))
        return json.loads(completion.data)

    def cmb_read(self, nsid: int, transfers: list[dict[str, Any]]) -> dict[str, Any]:
        """CMB_READ: committed tensor-file bytes (role default param) into the CMB, all of
        one committed step."""
        completion = self.call(Opcode.CMB_READ, nsid=nsid, payload=json.dumps(transfers).encode())
        return json.loads(completion.data)


class CmbMapping:
    """A client's mapping of the device's controller memory buffer (see emulator/cmb.py)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view handed out is still alive; the mapping goes with it
