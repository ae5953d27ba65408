"""What the optimizer namespace's modules share: the file roles, the hyperparameter records of
a superblock, the counters, a commit's result."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ... import kernels
from ..layout import SCALE_BLOCK
from ..spec import Hyperparameters
from ...protocol.hyperparameters import GROUP_FIELDS
from ..lifetime import LifetimeCounters
from ..superblock import Superblock

ROLES = ("grad", "param", "master", "exp_avg", "exp_avg_sq")
LOADABLE_ROLES = ("master", "exp_avg", "exp_avg_sq")
# The arrays a block checksum covers, in checksum order.
BLOCK_ROLES = ("master", "exp_avg", "exp_avg_sq", "param")
# The same for block-scaled moments (state_dtype fp16, int8): each moment's codes, then its
# float32 scales (one per SCALE_BLOCK elements), so a torn scale fails its block as a torn
# code does. The param stays last: its part alone is the block's param checksum.
SCALED_BLOCK_ROLES = ("master", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "param")
SCALE_ROLES = {"exp_avg_scale": "exp_avg", "exp_avg_sq_scale": "exp_avg_sq"}
MOMENT_ROLES = ("exp_avg", "exp_avg_sq")


def decoded_moment_bytes(codes: np.ndarray, scales: np.ndarray, state_format: Any, role: str,
                         offset: int, end: int) -> np.ndarray:
    """Bytes [offset, end) of a block-scaled moment as FP32, as the mount tree and exports give
    it, from that moment's whole codes and scales (views of a state copy or a snapshot's): only
    the 256-element blocks the range touches are decoded (kernels.decode_state, exact)."""
    numel = codes.size
    lo = offset // 4 // SCALE_BLOCK * SCALE_BLOCK
    last_element = -(-end // 4)  # one past the last element the range touches
    hi = min(numel, -(-last_element // SCALE_BLOCK) * SCALE_BLOCK)
    out = np.empty(hi - lo, dtype=np.float32)
    kernels.decode_state(codes[lo:hi], scales[lo // SCALE_BLOCK : -(-hi // SCALE_BLOCK)], out,
                         state_format=state_format,
                         moment=kernels.Moment.EXP_AVG if role == "exp_avg" else kernels.Moment.EXP_AVG_SQ)
    return out.view(np.uint8)[offset - 4 * lo : end - 4 * lo]


def block_slice(role: str, start: int, stop: int) -> slice:
    """The indices of a role's array that elements [start, stop) own: the elements
    themselves, or for a scale role the scales of their SCALE_BLOCK-element blocks (a block
    boundary is always a scale boundary)."""
    if role in SCALE_ROLES:
        return slice(start // SCALE_BLOCK, -(-stop // SCALE_BLOCK))
    return slice(start, stop)

def hypers_of(superblock: Superblock) -> list[Hyperparameters]:
    """The hyperparameters of every group, as a superblock recorded them with its step."""
    first = Hyperparameters(
        **{field: getattr(superblock, field) for field in GROUP_FIELDS}, mode=superblock.mode
    )
    rest = [
        Hyperparameters(**{f: float(v) for f, v in zip(GROUP_FIELDS, row)}, mode=superblock.mode)
        for row in superblock.extra_groups
    ]
    return [first, *rest]


def hyper_record(hypers: list[Hyperparameters]) -> dict[str, Any]:
    """Superblock fields recording `hypers` (group 0 in the header, the rest in a table)."""
    record: dict[str, Any] = {field: getattr(hypers[0], field) for field in GROUP_FIELDS}
    record["mode"] = hypers[0].mode
    record["extra_groups"] = np.array(
        [[getattr(h, field) for field in GROUP_FIELDS] for h in hypers[1:]], dtype=np.float64
    ).reshape(len(hypers) - 1, len(GROUP_FIELDS))
    return record


class WouldBlock(Exception):
    """A *_nowait call found that it would have to wait (for the lock or a flush)."""


@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What a commit did: the step now current, and whether this one was skipped."""

    step: int
    committed_step: int
    skipped: bool
    nonfinite_elements: int = 0


@dataclasses.dataclass
class NamespaceCounters:
    """Since the namespace was opened (the step counts: over its life, from its superblock).

    The device's SMART figures add these up (emulator/health.py), so each counts exactly what
    its name says: host bytes and requests on the tensor files, media bytes, busy time.
    """

    steps_committed: int = 0
    steps_skipped: int = 0
    steps_aborted: int = 0
    steps_reverted: int = 0  # REVERT_STEP (a group commit's recovery)
    grad_writes_waited: int = 0  # gradient writes held while MAX_QUEUED_BLOCKS blocks awaited the kernels
    nonfinite_elements: int = 0
    grad_bytes_in: int = 0
    state_bytes_loaded: int = 0
    bytes_read: int = 0
    param_bytes_out: int = 0
    read_commands: int = 0
    write_commands: int = 0
    media_bytes_written: int = 0
    kernel_blocks: int = 0
    kernel_ns: int = 0
    flushes: int = 0
    flush_ns: int = 0
    # Wall time spent checking a whole copy's checksums (CopyVerifier.verify_copy: at an open that verifies
    # it, a rollback, a scrub); not device busy time for SMART, which counts kernels and flushes.
    copy_verify_ns: int = 0
    checksum_failures: int = 0

    def lifetime_share(self) -> LifetimeCounters:
        """What these add to the device's SMART figures (emulator/health.py)."""
        return LifetimeCounters(
            host_bytes_read=self.bytes_read,
            host_bytes_written=self.grad_bytes_in + self.state_bytes_loaded,
            host_read_commands=self.read_commands,
            host_write_commands=self.write_commands,
            busy_ns=self.kernel_ns + self.flush_ns,
            media_bytes_written=self.media_bytes_written,
            media_errors=self.checksum_failures,
        )
