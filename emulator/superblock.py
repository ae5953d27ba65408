"""Encoding, decoding and choosing among the double-written superblock slots of a namespace."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from .. import kernels

from ..protocol.hyperparameters import ADAM, ADAMW, GROUP_FIELDS
from ..protocol.status import DeviceError
from .layout import (
    FORMAT_VERSION,
    SUPERBLOCK_CRC_START,
    SUPERBLOCK_HEADER,
    SUPERBLOCK_MAGIC,
    Copy,
    SuperblockFlags,
)
from .media import atomic_write_bytes, read_json

log = logging.getLogger(__name__)

# Beside the slots: the skip counters as of the last skip (see SkipCounts).
SKIP_RECORD = "skips.json"


@dataclasses.dataclass
class Superblock:
    """The commit record: which copy holds which step, with a checksum per kernel block."""

    seq: int
    committed_step: int
    committed_copy: Copy
    flags: SuperblockFlags
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    mode: str  # protocol/hyperparameters.py MODES; on the media the flag `adamw`
    block_crcs: np.ndarray
    steps_committed: int = 0
    steps_skipped: int = 0
    last_skipped_step: int = 0
    last_grad_scale: float = 1.0
    # (lr, beta1, beta2, eps, weight_decay) of groups 1.. (group 0 is in the header);
    # stored after the block checksums, so a one-group namespace has none.
    extra_groups: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros((0, len(GROUP_FIELDS)), dtype=np.float64)
    )
    # The CRC32C of each block's params alone (the last part of its block checksum), or None
    # where the slot predates them: what a restart checks before it serves a param.
    param_crcs: np.ndarray | None = None

    @property
    def slot(self) -> int:
        return self.seq % 2

    def encode(self) -> bytes:
        header = np.zeros((), dtype=SUPERBLOCK_HEADER)
        header["magic"] = SUPERBLOCK_MAGIC
        header["format_version"] = FORMAT_VERSION
        header["seq"] = self.seq
        header["committed_step"] = self.committed_step
        header["committed_copy"] = int(self.committed_copy)
        flags = self.flags & ~SuperblockFlags.PARAM_CRCS
        if self.param_crcs is not None:
            flags |= SuperblockFlags.PARAM_CRCS
        header["flags"] = int(flags)
        header["adamw"] = int(self.mode == ADAMW)
        header["block_count"] = len(self.block_crcs)
        header["steps_committed"] = self.steps_committed
        header["steps_skipped"] = self.steps_skipped
        header["last_skipped_step"] = self.last_skipped_step
        for field in (*GROUP_FIELDS, "last_grad_scale"):
            header[field] = getattr(self, field)
        body = bytearray(
            header.tobytes()
            + self.block_crcs.astype("<u4").tobytes()
            + np.ascontiguousarray(self.extra_groups, dtype="<f8").tobytes()
            + (b"" if self.param_crcs is None else self.param_crcs.astype("<u4").tobytes())
        )
        crc = kernels.crc32c(memoryview(body)[SUPERBLOCK_CRC_START:])
        body[12:16] = crc.to_bytes(4, "little")
        return bytes(body)

    @classmethod
    def decode(
        cls, data: bytes, expected_blocks: int, expected_groups: int = 1
    ) -> "Superblock | None":
        """The superblock in `data`, or None if it is absent, torn or of another layout."""
        if len(data) < SUPERBLOCK_HEADER.itemsize:
            return None
        header = np.frombuffer(data, dtype=SUPERBLOCK_HEADER, count=1)[0]
        if bytes(header["magic"]) != SUPERBLOCK_MAGIC:
            return None
        if int(header["format_version"]) != FORMAT_VERSION:
            return None
        blocks = int(header["block_count"])
        if blocks != expected_blocks:
            return None
        groups_at = SUPERBLOCK_HEADER.itemsize + 4 * blocks
        params_at = groups_at + 8 * len(GROUP_FIELDS) * (expected_groups - 1)
        flags = SuperblockFlags(int(header["flags"]))
        with_params = bool(flags & SuperblockFlags.PARAM_CRCS)
        end = params_at + (4 * blocks if with_params else 0)
        if len(data) < end:
            return None
        if kernels.crc32c(memoryview(data)[SUPERBLOCK_CRC_START:end]) != int(header["crc"]):
            return None
        crcs = np.frombuffer(data, dtype="<u4", count=blocks, offset=SUPERBLOCK_HEADER.itemsize)
        extra = np.frombuffer(
            data, dtype="<f8", count=len(GROUP_FIELDS) * (expected_groups - 1), offset=groups_at
        ).reshape(expected_groups - 1, len(GROUP_FIELDS))
        return cls(
            seq=int(header["seq"]),
            committed_step=int(header["committed_step"]),
            committed_copy=Copy(int(header["committed_copy"]) & 1),
            flags=flags & ~SuperblockFlags.PARAM_CRCS,
            lr=float(header["lr"]),
            beta1=float(header["beta1"]),
            beta2=float(header["beta2"]),
            eps=float(header["eps"]),
            weight_decay=float(header["weight_decay"]),
            mode=ADAMW if header["adamw"] else ADAM,
            block_crcs=crcs.astype(np.uint32),
            steps_committed=int(header["steps_committed"]),
            steps_skipped=int(header["steps_skipped"]),
            last_skipped_step=int(header["last_skipped_step"]),
            last_grad_scale=float(header["last_grad_scale"]),
            extra_groups=extra.astype(np.float64),
            param_crcs=(np.frombuffer(data, dtype="<u4", count=blocks, offset=params_at).astype(np.uint32)
                        if with_params else None),
        )

    def successor(self, **changes: object) -> "Superblock":
        """The next superblock (seq + 1), i.e. the one written into the other slot.

        New block checksums without new param checksums drop the old ones: a param checksum
        of another copy or step must never stand beside them (a restart would then fail
        good params, or worse, pass stale ones)."""
        if "block_crcs" in changes and "param_crcs" not in changes:
            changes["param_crcs"] = None
        # A shallow copy: a superblock's arrays are never changed in place once it is made,
        # so the two may share the ones this step leaves as they were (asdict's deep copy of
        # every array cost some 0.1 ms a commit).
        return dataclasses.replace(self, seq=self.seq + 1, **changes)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, order=True)
class SkipCounts:
    """Steps skipped for non-finite gradients over a namespace's life, and the last one's number.

    A skip writes no superblock (that would overwrite the slot naming the fallback copy), so
    its counters go to a side record, `skips.json`, replaced atomically; the next commit's
    superblock carries them too. Counts only grow, so of the two the one with more skips is
    the newer (the ordering compares steps_skipped first).
    """

    steps_skipped: int = 0
    last_skipped_step: int = 0

    @classmethod
    def of(cls, superblock: Superblock) -> "SkipCounts":
        return cls(superblock.steps_skipped, superblock.last_skipped_step)

    @classmethod
    def load(cls, directory: Path) -> "SkipCounts":
        """The record in `directory`; none (no skip since the namespace was created) is zero.
        One that cannot be read counts as none, with a warning: it holds statistics only."""
        try:
            record = read_json(directory / SKIP_RECORD)
            counts = cls(int(record["steps_skipped"]), int(record["last_skipped_step"]))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: unreadable skip record (%s); skip counters from the superblock", directory, exc)
            return cls()
        if counts.steps_skipped < 0 or counts.last_skipped_step < 0:
            log.warning("%s: skip record with negative counts ignored", directory)
            return cls()
        return counts

    def encode(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), sort_keys=True) + "\n").encode()

    def store(self, directory: Path) -> int:
        """Replace the record (atomically, durably); returns the bytes written. Raises DeviceError."""
        encoded = self.encode()
        atomic_write_bytes(directory / SKIP_RECORD, encoded)
        return len(encoded)

    def store_or_warn(self, directory: Path) -> int:
        """store(), logging a failure (and returning 0) instead of raising: the skipped step
        changed no state, and the next commit's superblock carries the counters anyway."""
        try:
            return self.store(directory)
        except DeviceError as exc:
            log.warning("%s: skip counters not recorded (%s); the next commit carries them", directory, exc.message)
            return 0
