"""Command status codes of the device and their errno at the file edge, declared once."""
from __future__ import annotations

import enum
import errno


class StatusCodeType(enum.IntEnum):
    """NVMe status code type (SCT), bits 9-11 of the completion status field."""

    GENERIC = 0x0
    COMMAND_SPECIFIC = 0x1
    MEDIA = 0x2
    VENDOR = 0x7


class Status(enum.IntEnum):
    """A completion status: (SCT << 8) | SC, with the errno a file operation reports for it.

    Values below 0x100 are NVMe generic statuses; 0x2xx media errors; 0x7xx cossd's own
    (vendor specific) statuses.
    """

    SUCCESS = 0x000
    INVALID_OPCODE = 0x001
    INVALID_FIELD = 0x002
    DATA_TRANSFER_ERROR = 0x004  # the network wire: a data digest (CRC32C) that did not match
    INTERNAL_ERROR = 0x006
    # NVMe's "Command Interrupted" (retry): the storage server's receive memory stayed in use
    # by other connections for longer than it waits (cossd serve --recv-wait-s)
    COMMAND_INTERRUPTED = 0x021
    INVALID_NAMESPACE = 0x00B
    LBA_OUT_OF_RANGE = 0x080
    CAPACITY_EXCEEDED = 0x081
    NAMESPACE_NOT_READY = 0x082
    # command specific
    INVALID_LOG_PAGE = 0x109
    FEATURE_ID_NOT_SAVEABLE = 0x10D  # set features: SV on a feature that cannot be saved
    FEATURE_NOT_CHANGEABLE = 0x10E  # set features: a feature that is read only
    FEATURE_NOT_NAMESPACE_SPECIFIC = 0x10F  # a controller-wide feature given an nsid
    NAMESPACE_INSUFFICIENT_CAPACITY = 0x115
    NAMESPACE_ID_UNAVAILABLE = 0x116
    # NVMe-oF Connect's "Connect Controller Busy": the server has all the connections it
    # takes open (cossd serve --max-connections)
    CONNECT_CONTROLLER_BUSY = 0x182
    # NVMe-oF Connect's "Connect Invalid Host": the network wire refused the host's credentials
    # (a wrong or missing token), or a command came before the connect
    CONNECT_INVALID_HOST = 0x184
    # The SLM command set's (and the NVM Command Set Copy's) "Overlapping I/O Range": a Memory
    # Copy source that overlaps its destination (value: the SPDK prototype; a CSD emulator header agrees)
    OVERLAPPING_IO_RANGE = 0x187
    # The Computational Programs command set's own (docs/command-set.md, "The standard face":
    # values as a CSD emulator's header lists them, not checked against the specification's text)
    INVALID_MEMORY_NAMESPACE = 0x18B
    INVALID_MEMORY_RANGE_SET = 0x18C
    INVALID_MEMORY_RANGE_SET_ID = 0x18D
    INVALID_PROGRAM_INDEX = 0x18F
    MAX_MEMORY_RANGE_EXCEEDED = 0x191
    MAX_MEMORY_RANGE_SET_EXCEEDED = 0x192
    NO_PROGRAM = 0x196
    OVERLAPPING_MEMORY_RANGE = 0x197
    PROGRAM_NOT_ACTIVATED = 0x198
    PROGRAM_INDEX_NOT_DOWNLOADABLE = 0x19A
    # media and data integrity
    WRITE_FAULT = 0x280
    UNRECOVERED_READ_ERROR = 0x281
    # vendor: the optimizer's own results
    STEP_SKIPPED_NONFINITE = 0x7C0
    GRADIENT_INCOMPLETE = 0x7C1
    NO_STEP_OPEN = 0x7C2
    STEP_ALREADY_OPEN = 0x7C3
    NAMESPACE_EXISTS = 0x7C4
    STEP_NUMBER_MISMATCH = 0x7C5
    GRADIENT_DUPLICATE = 0x7C6
    MISALIGNED_ACCESS = 0x7C7
    ACCESS_DENIED = 0x7C8
    STATE_SEALED = 0x7C9
    INVALID_NAME = 0x7CA
    LIMIT_EXCEEDED = 0x7CB
    SNAPSHOT_EXISTS = 0x7CC
    SNAPSHOT_NOT_FOUND = 0x7CD
    NAMESPACE_KIND_MISMATCH = 0x7CE  # an optimizer command on an NVM namespace or vice versa

    @property
    def sct(self) -> int:
        return (self.value >> 8) & 0x7

    @property
    def sc(self) -> int:
        return self.value & 0xFF

    @property
    def errno(self) -> int:
        return STATUS_ERRNO.get(self, errno.EIO)

    @classmethod
    def from_field(cls, sct: int, sc: int) -> "Status | int":
        """The Status for a completion's (sct, sc), or the raw value when unknown."""
        raw = (sct << 8) | sc
        try:
            return cls(raw)
        except ValueError:
            return raw


# errno for each status where a file operation (not a command) must fail; the table in
# docs/errno.md lists the same rows and tests/mount/test_errno_table.py covers each.
STATUS_ERRNO: dict[Status, int] = {
    Status.SUCCESS: 0,
    Status.INVALID_OPCODE: errno.EINVAL,
    Status.INVALID_FIELD: errno.EINVAL,
    Status.DATA_TRANSFER_ERROR: errno.EIO,
    Status.INTERNAL_ERROR: errno.EIO,
    Status.COMMAND_INTERRUPTED: errno.EAGAIN,
    Status.INVALID_NAMESPACE: errno.ENOENT,
    Status.LBA_OUT_OF_RANGE: errno.EFBIG,
    Status.CAPACITY_EXCEEDED: errno.ENOSPC,
    Status.NAMESPACE_NOT_READY: errno.EIO,
    Status.INVALID_LOG_PAGE: errno.EINVAL,
    Status.FEATURE_ID_NOT_SAVEABLE: errno.EINVAL,
    Status.FEATURE_NOT_CHANGEABLE: errno.EPERM,
    Status.FEATURE_NOT_NAMESPACE_SPECIFIC: errno.EINVAL,
    Status.NAMESPACE_INSUFFICIENT_CAPACITY: errno.ENOSPC,
    Status.NAMESPACE_ID_UNAVAILABLE: errno.ENOSPC,
    Status.CONNECT_INVALID_HOST: errno.EACCES,
    Status.CONNECT_CONTROLLER_BUSY: errno.EBUSY,
    Status.INVALID_MEMORY_NAMESPACE: errno.ENOENT,
    Status.INVALID_MEMORY_RANGE_SET: errno.EINVAL,
    Status.INVALID_MEMORY_RANGE_SET_ID: errno.ENOENT,
    Status.INVALID_PROGRAM_INDEX: errno.EINVAL,
    Status.MAX_MEMORY_RANGE_EXCEEDED: errno.E2BIG,
    Status.MAX_MEMORY_RANGE_SET_EXCEEDED: errno.ENOSPC,
    Status.NO_PROGRAM: errno.ENOENT,
    Status.OVERLAPPING_MEMORY_RANGE: errno.EINVAL,
    Status.OVERLAPPING_IO_RANGE: errno.EINVAL,
    Status.PROGRAM_NOT_ACTIVATED: errno.EINVAL,
    Status.PROGRAM_INDEX_NOT_DOWNLOADABLE: errno.EPERM,
    Status.WRITE_FAULT: errno.EIO,
    Status.UNRECOVERED_READ_ERROR: errno.EIO,
    Status.STEP_SKIPPED_NONFINITE: 0,
    Status.GRADIENT_INCOMPLETE: errno.EAGAIN,
    Status.NO_STEP_OPEN: errno.EINVAL,
    Status.STEP_ALREADY_OPEN: errno.EBUSY,
    Status.NAMESPACE_EXISTS: errno.EEXIST,
    Status.STEP_NUMBER_MISMATCH: errno.EINVAL,
    Status.GRADIENT_DUPLICATE: errno.EEXIST,
    Status.MISALIGNED_ACCESS: errno.EINVAL,
    Status.ACCESS_DENIED: errno.EACCES,
    Status.STATE_SEALED: errno.EROFS,
    Status.INVALID_NAME: errno.EINVAL,
    Status.LIMIT_EXCEEDED: errno.E2BIG,
    Status.SNAPSHOT_EXISTS: errno.EEXIST,
    Status.SNAPSHOT_NOT_FOUND: errno.ENOENT,
    Status.NAMESPACE_KIND_MISMATCH: errno.EINVAL,
}


class DeviceError(Exception):
    """A command or file operation the device refused; carries the completion status."""

    def __init__(self, status: Status, message: str, location: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        # The submission byte at fault, for the error log's parameter error location, where
        # the (opcode, status) pair alone does not say (see controller.ERROR_LOCATION).
        self.location = location

    @property
    def errno(self) -> int:
        return self.status.errno

    def __str__(self) -> str:
        return f"{self.message} [{self.status.name}]"
