"""AdminClient: a device's commands over a Transport (today a local mount's control file)."""
from __future__ import annotations

import json
import operator
import os
from typing import Any

from ..protocol import logpages
from ..protocol.entries import NSID_ALL, Completion, Opcode, encode_submission, f64_to_dwords, status_error
from ..protocol.logpages import LogId
from ..protocol.status import DeviceError, Status
from .cmb import CmbMapping
from .remote import Credentials, RemoteTransport, is_remote
from .transport import LocalMount, Transport
from .watchdog import DEFAULT_TIMEOUT_S


# The submission entry's fields a caller fills, and their widths in bits (protocol/entries.py,
# SUBMISSION): submit refuses a value that does not fit rather than let it be cut.
SUBMISSION_FIELD_BITS = {"opcode": 8, "nsid": 32, **{f"cdw{n}": 32 for n in range(10, 16)}}


def check_field(what: str, value: Any, bits: int) -> int:
    """`value` as an unsigned field of `bits` bits, or a ValueError that names `what` and the
    field's range: never cut to fit, which would send another command than the one asked for."""
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if not 0 <= number < 1 << bits:
        raise ValueError(f"{what} {number} is out of range 0..{(1 << bits) - 1} ({bits} bits)")
    return number


def split_u64(what: str, value: int) -> tuple[int, int]:
    """A 64-bit field (a step, a byte offset) as its two dwords, low first; out of range: ValueError."""
    number = check_field(what, value, 64)
    return number & 0xFFFF_FFFF, number >> 32


class AdminClient:
    """One queue pair of a device. Not thread-safe; open one per thread.

    Takes a mountpoint (a LocalMount: one open() of MOUNTPOINT/.admin), a storage server's
    URL cossd://HOST:PORT (a RemoteTransport: the token from `token_file` or
    $COSSD_TOKEN_FILE, TLS trusting `ca` or $COSSD_CA where one is named, or all of them,
    client certificate included, as one `credentials`), or any Transport.
    """

    def __init__(self, where: str | os.PathLike[str] | Transport,
                 timeout_s: float | None = DEFAULT_TIMEOUT_S, *,
                 token_file: str | os.PathLike[str] | None = None,
                 ca: str | os.PathLike[str] | None = None,
                 credentials: Credentials | None = None) -> None:
        self.transport: Transport
        if is_remote(where):
            self.transport = RemoteTransport(where, timeout_s, token_file=token_file, ca=ca,  # type: ignore[arg-type]
                                             credentials=credentials)
        elif isinstance(where, (str, os.PathLike)):
            self.transport = LocalMount(where, timeout_s)
        else:
            self.transport = where
        self.mountpoint = self.transport.location
        self._cid = 0

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> "AdminClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def submit(self, opcode: int, *, payload: bytes = b"", **fields: int) -> Completion:
        """Send one command and return its completion (whatever its status).

        An OSError here is the errno channel: the submission itself was malformed. A field
        out of its width (SUBMISSION_FIELD_BITS) is a ValueError, and nothing is sent.
        """
        check_field("opcode", opcode, 8)
        for name, value in fields.items():
            if name in SUBMISSION_FIELD_BITS:
                check_field(name, value, SUBMISSION_FIELD_BITS[name])
        self._cid = (self._cid + 1) & 0xFFFF
        raw = encode_submission(opcode, cid=self._cid, payload=payload, **fields)
        return self.transport.exchange(raw)

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

    def namespace_config(self, name: str) -> dict[str, Any]:
        """The namespace's config.json (its tensors with their shapes, dtypes, hyperparameters),
        read through the transport: a local mount's file, or a server's READ_TEXT."""
        return json.loads(self.transport.read_text(f"ns/{name}/config.json"))

    def delete_namespace(self, nsid: int) -> None:
        self.call(Opcode.DELETE_NAMESPACE, nsid=nsid)

    def begin_step(self, nsid: int, step: int = 0, grad_scale: float = 1.0,
                   grad_scales: dict[str, Any] | None = None) -> int:
        """BEGIN_STEP; grad_scales: each FP8 tensor's scale (or slice object), the payload
        {"grad_scales": {...}}; naming the open step, it adds them to it."""
        step_low, step_high = split_u64("step", step)
        low, high = f64_to_dwords(grad_scale)
        payload = json.dumps({"grad_scales": grad_scales}).encode() if grad_scales else b""
        completion = self.call(
            Opcode.BEGIN_STEP, nsid=nsid, cdw10=step_low, cdw11=step_high,
            cdw12=low, cdw13=high, payload=payload,
        )
        return int(json.loads(completion.data)["step"])

    def commit_step(self, nsid: int) -> dict[str, Any]:
        """Commit; the result says whether the step was skipped (non-finite gradients)."""
        completion = self.call(Opcode.COMMIT_STEP, nsid=nsid, allow=(Status.STEP_SKIPPED_NONFINITE,))
        return json.loads(completion.data)

    def abort_step(self, nsid: int) -> int:
        return int(json.loads(self.call(Opcode.ABORT_STEP, nsid=nsid).data)["aborted_step"])

    def revert_step(self, nsid: int, step: int) -> dict[str, Any]:
        """REVERT_STEP: undo committed step `step` (its copy of step - 1 still intact);
        {"committed_step", "reverted"} (false where the namespace is at step - 1 already)."""
        low, high = split_u64("step", step)
        completion = self.call(Opcode.REVERT_STEP, nsid=nsid, cdw10=low, cdw11=high)
        return json.loads(completion.data)

    # ------------------------------------------------------------------ shared steps

    def begin_shared_step(self, nsid: int, step: int, grad_scale: float, *, job: int, seq: int, ranks: int,
                          rank: int, groups: list[dict[str, float]] | None = None,
                          grad_scales: dict[str, Any] | None = None) -> dict[str, Any]:
        """BEGIN_STEP of a job's step that its `ranks` ranks share (the job's `seq`th shared
        step): opens it with `groups`' hyperparameters, or joins it (the same step, seq,
        scale and hyperparameters); grad_scales, the FP8 scales of this rank's slices."""
        payload: dict[str, Any] = {"job": job, "seq": seq, "ranks": ranks, "rank": rank}
        if groups is not None:
            payload["groups"] = groups
        if grad_scales:
            payload["grad_scales"] = grad_scales
        step_low, step_high = split_u64("step", step)
        low, high = f64_to_dwords(grad_scale)
        completion = self.call(Opcode.BEGIN_STEP, nsid=nsid, cdw10=step_low, cdw11=step_high,
                               cdw12=low, cdw13=high, payload=json.dumps(payload).encode())
        return json.loads(completion.data)

    def commit_shared_step(self, nsid: int, step: int, *, job: int, seq: int, ranks: int, rank: int) -> dict[str, Any]:
        """COMMIT_STEP of a shared step: its one result (skipped or not), or {"waiting": why}
        while ranks or gradients are still missing (ask again, within a bound)."""
        payload = json.dumps({"job": job, "seq": seq, "ranks": ranks, "rank": rank, "step": step}).encode()
        completion = self.call(Opcode.COMMIT_STEP, nsid=nsid, payload=payload,
                               allow=(Status.STEP_SKIPPED_NONFINITE,))
        return json.loads(completion.data)

    def abort_shared_step(self, nsid: int, step: int, *, job: int, seq: int, ranks: int, rank: int,
                          reason: str) -> int:
        """ABORT_STEP of a shared step: every rank's next COMMIT_STEP hears `reason`."""
        payload = json.dumps({"job": job, "seq": seq, "ranks": ranks, "rank": rank, "step": step,
                              "reason": reason})
        return int(json.loads(self.call(Opcode.ABORT_STEP, nsid=nsid, payload=payload.encode()).data)["aborted_step"])

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
        page ends first. A log_id past 8 bits (or another field out of its width): ValueError."""
        check_field("log page identifier", log_id, 8)
        if length is None:
            numd = 0xFFFF_FFFF  # as many dwords as NUMD can ask for: the whole page
        elif length <= 0 or length % 4 or length > 1 << 34:
            raise ValueError(f"a log page length is a positive multiple of 4 up to 16 GiB, got {length}")
        else:
            numd = length // 4 - 1
        if not 0 <= offset < 1 << 64:
            raise ValueError(f"a log page offset is 0 to 2**64-1, got {offset}")
        return self.call(Opcode.GET_LOG_PAGE, nsid=nsid, cdw10=log_id | (numd & 0xFFFF) << 16,
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
        return self.transport.map_cmb(info["path"], int(info["size"])) if info else None

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

