"""A client of a mounted device's control file: submit commands, read completions."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cossd.emulator.errors import DeviceError, Status
from cossd.emulator.protocol import (
    COMPLETION,
    Completion,
    Opcode,
    decode_completion,
    encode_submission,
    f64_to_dwords,
    status_error,
)

ADMIN_FILE = ".admin"


class AdminClient:
    """One queue pair: an open() of MOUNTPOINT/.admin. Not thread-safe; open one per thread."""

    def __init__(self, mountpoint: str | os.PathLike[str]) -> None:
        self.mountpoint = Path(mountpoint)
        path = self.mountpoint / ADMIN_FILE
        try:
            self.fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.mountpoint} is not a mounted cossd device") from None
        self._cid = 0

    def close(self) -> None:
        # Forget the fd first: close() of a dead mount's file fails (ENOTCONN) yet frees it.
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

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
        os.write(self.fd, raw)
        header = self._read_exact(COMPLETION.itemsize)
        completion, data_len = decode_completion(header)
        data = self._read_exact(data_len) if data_len else b""
        return Completion(completion.cid, completion.status, completion.result, data)

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
