"""EXPORT: a namespace's or a snapshot's state as a safetensors file, written in the background.

The file follows the safetensors format: an 8-byte little-endian header length, a JSON header
(padded with spaces to a multiple of 8 bytes) naming each tensor's dtype, shape and byte range,
then the bytes. Each tensor has the shape recorded at the namespace's creation (so a model's
load_state_dict takes the file as it is), or is flat (1-D) where none was recorded. It is streamed one kernel block at a time, so exporting needs no memory in
proportion to the namespace, and every block is checked against its checksum on the way.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import stat
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import kernels

from .. import media
from ...protocol.status import DeviceError, Status
from ..jobs import Job, JobTable
from ..layout import TensorLayout, region_offset
from ..namespace import snapshot_pin
from ..namespace.snapshots import CHECKSUM_ROLES, STATE_FILE, Snapshot
from ..superblock import Superblock

if TYPE_CHECKING:
    from ..device import Device
    from ..namespace import Namespace

log = logging.getLogger(__name__)

EXPORTS_DIR = "exports"
# Default file names, under BACKING/exports/<namespace>/: a name is one path component (no '/',
# not '.' or '..'), so each namespace has its own directory, and in it the two prefixes keep
# a committed step and a snapshot apart (tag "step-1" gives snapshot-step-1). So distinct
# (namespace, step) and (namespace, tag) never share a file, and the longest names (128
# characters each) still fit a file name's 255 bytes.
STEP_EXPORT = "step-{step}.safetensors"
SNAPSHOT_EXPORT = "snapshot-{tag}.safetensors"
SAFETENSORS_DTYPES = {"fp16": "F16", "bf16": "BF16", "fp32": "F32"}
PAYLOAD_KEYS = {"tag", "path", "optimizer_state", "overwrite"}
# The metadata key saying which tensors carry their model's shape: SHAPES_RECORDED (every
# one), SHAPES_FLAT (none: a namespace created without shapes) or SHAPES_PARTIAL.
SHAPES_KEY = "cossd.shapes"
SHAPES_RECORDED, SHAPES_FLAT, SHAPES_PARTIAL = "recorded", "flat", "partial"


def flat_tensors(namespace: Namespace) -> list[str]:
    """The tensors of `namespace` created without a shape, which an export writes 1-D."""
    return [t.name for t in namespace.spec.tensors if t.shape is None]


def shapes_note(namespace: str, flat: list[str], total: int) -> str:
    """The daemon log's line for an export of a namespace with tensors that have no recorded
    shape (`cossd export` tells its user the same)."""
    which = "its tensors have" if len(flat) == total else f"{len(flat)} of its {total} tensors have"
    return (f"namespace {namespace!r}: {which} no recorded shape (created by an older cossd, or "
            "by create-ns --tensor NAME:NUMEL); they are exported flat (1-D)")


def tensor_name(tensor: str, role: str) -> str:
    """Name of one array in the file: the tensor's own name for its params, else
    '<tensor>.<role>' (master, exp_avg, exp_avg_sq)."""
    return tensor if role == "param" else f"{tensor}.{role}"


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What goes into the file: header bytes, then per tensor the chosen roles in checksum
    order (master, exp_avg, exp_avg_sq, param), each numel x itemsize bytes."""

    layouts: tuple[TensorLayout, ...]
    roles: tuple[str, ...]
    itemsizes: dict[str, int]
    header: bytes
    # Block-scaled moments (state_dtype fp16, int8): their state format, and the bytes of
    # one code on the media; the file has them decoded to FP32 (itemsizes 4). None otherwise.
    scaled_format: kernels.StateFormat | None = None
    code_itemsize: int = 0

    @property
    def total_bytes(self) -> int:
        data = sum(t.numel * self.itemsizes[r] for t in self.layouts for r in self.roles)
        return len(self.header) + data


def plan(namespace: Namespace, superblock: Superblock, tag: str | None,
         optimizer_state: bool) -> ExportPlan:
    """The file's layout and header for `namespace`'s state at `superblock`'s step."""
    spec = namespace.spec
    roles = tuple(r for r in CHECKSUM_ROLES if optimizer_state or r == "param")
    # Block-scaled moments are exported decoded, as FP32 (the codes mean nothing without
    # their scales); cossd.state_dtype still says how the device keeps them.
    moment_dtype = "fp32" if spec.scaled_state else spec.state_dtype
    dtypes = {"master": "fp32", "exp_avg": moment_dtype, "exp_avg_sq": moment_dtype,
              "param": spec.param_dtype}
    itemsizes = {role: namespace.itemsize(role) for role in CHECKSUM_ROLES}
    shapes = {t.name: [t.numel] if t.shape is None else list(t.shape) for t in spec.tensors}
    flat = flat_tensors(namespace)
    metadata = {
        "format": "pt",  # what transformers' loaders look for
        "cossd.namespace": namespace.name,
        "cossd.step": str(superblock.committed_step),
        "cossd.snapshot": tag or "",
        "cossd.param_dtype": spec.param_dtype,
        "cossd.state_dtype": spec.state_dtype,
        "cossd.grad_dtype": spec.grad_dtype,
        "cossd.optimizer_state": "true" if optimizer_state else "false",
        SHAPES_KEY: (SHAPES_RECORDED if not flat else
                     SHAPES_FLAT if len(flat) == len(spec.tensors) else SHAPES_PARTIAL),
        "cossd.hyperparameters": json.dumps(
            {"lr": superblock.lr, "beta1": superblock.beta1, "beta2": superblock.beta2,
             "eps": superblock.eps, "weight_decay": superblock.weight_decay,
             "mode": superblock.mode}, sort_keys=True),
    }
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for tensor in namespace.layouts:
        for role in roles:
            name = tensor_name(tensor.name, role)
            if name in header:
                raise DeviceError(Status.INVALID_FIELD,
                                  f"two arrays would both be named {name!r} in the file "
                                  "(a tensor is named like another tensor's optimizer state); "
                                  "export without optimizer_state")
            size = tensor.numel * itemsizes[role]
            # Optimizer state has its param's shape too: the same elements, one to one.
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtypes[role]], "shape": shapes[tensor.name],
                            "data_offsets": [offset, offset + size]}
            offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data then starts 8-byte aligned
    scaled_format = namespace._state_format if spec.scaled_state else None
    return ExportPlan(tuple(namespace.layouts), roles, itemsizes,
                      struct.pack("<Q", len(text)) + text, scaled_format, spec.state_itemsize)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def stream(plan_: ExportPlan, source_fd: int, superblock: Superblock, out_fd: int, job: Job) -> None:
    """Write the header and data, verifying every block's checksum (all four arrays are read
    for it, whichever are exported); a block that fails stops the export."""
    _write_all(out_fd, plan_.header)
    job.bytes_done = len(plan_.header)
    for tensor in plan_.layouts:
        crcs = [0] * tensor.block_count
        for role in CHECKSUM_ROLES:
            scaled = plan_.scaled_format is not None and role in ("exp_avg", "exp_avg_sq")
            size = plan_.code_itemsize if scaled else plan_.itemsizes[role]
            base = region_offset(tensor, role)
            for block in range(tensor.block_count):
                start, stop = tensor.block_range(block)
                data = media.read_exact(source_fd, (stop - start) * size, base + start * size, "the exported state")
                crcs[block] = kernels.crc32c(data, crcs[block])
                if scaled:
                    # The block's scales follow its codes in the checksum; the file gets both
                    # decoded (kernels.decode_state, exact).
                    data = _decoded_block(plan_, source_fd, tensor, role, start, stop, data, crcs, block)
                if role in plan_.roles:
                    _write_all(out_fd, data)
                    job.bytes_done += len(data)
        for block, crc in enumerate(crcs):
            if crc != int(superblock.block_crcs[tensor.first_block + block]):
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"step {superblock.committed_step}: {tensor.name} block {block} fails its "
                    "checksum; nothing was exported",
                )


def _decoded_block(plan_: ExportPlan, source_fd: int, tensor: TensorLayout, role: str, start: int, stop: int,
                   codes: bytes, crcs: list[int], block: int) -> bytes:
    """One block of a block-scaled moment as FP32, from its codes and its scales (read here
    and chained onto the block's checksum, which covers them right after the codes)."""
    scale_role = role + "_scale"
    assert plan_.scaled_format is not None  # only a block-scaled moment is decoded here
    first, last = start // kernels.STATE_BLOCK, -(-stop // kernels.STATE_BLOCK)
    scales = media.read_exact(source_fd, (last - first) * 4, region_offset(tensor, scale_role) + first * 4,
                              "the exported state")
    crcs[block] = kernels.crc32c(scales, crcs[block])
    out = np.empty(stop - start, dtype=np.float32)
    code_dtype = np.uint8 if plan_.code_itemsize == 1 else np.uint16
    kernels.decode_state(np.frombuffer(codes, dtype=code_dtype), np.frombuffer(scales, dtype=np.float32), out,
                         state_format=plan_.scaled_format,
                         moment=kernels.Moment.EXP_AVG if role == "exp_avg" else kernels.Moment.EXP_AVG_SQ)
    return out.tobytes()


# ---------------------------------------------------------------------- the command


def default_path(backing: Path, namespace: str, step: int, tag: str | None) -> Path:
    """Where an export without a path goes (see STEP_EXPORT)."""
    name = SNAPSHOT_EXPORT.format(tag=tag) if tag else STEP_EXPORT.format(step=step)
    return backing / EXPORTS_DIR / namespace / name


def clean_staging(backing: Path) -> None:
    """Remove what exports cut short by a crash or unmount left in BACKING/exports: staging
    directories there, temporary files there and in each namespace's directory (no name
    starts with '.')."""
    directory = backing / EXPORTS_DIR
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        elif entry.is_dir():
            for inner in entry.iterdir():
                if inner.name.startswith(".") and inner.is_file():
                    inner.unlink(missing_ok=True)


# How to ask for a replace, in the payload and on the command line.
_REPLACE_HINT = "replaced only when asked: the payload's overwrite, `cossd export --force`"


def _refuse_existing(target: Path) -> None:
    if os.path.lexists(target):  # a dangling symlink too: a name taken is never replaced unasked
        raise DeviceError(Status.INVALID_FIELD, f"{target} exists ({_REPLACE_HINT})")


def _publish(temporary: Path, final: Path, overwrite: bool) -> None:
    """Give the finished file its name. Without overwrite a file that appeared meanwhile (another
    export to the same name) is never replaced: a hard link fails where the name is taken."""
    if overwrite:
        os.replace(temporary, final)
        return
    try:
        os.link(temporary, final)
    except FileExistsError:
        raise DeviceError(Status.INVALID_FIELD,
                          f"{final} was created meanwhile; nothing replaced ({_REPLACE_HINT})") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        _refuse_existing(final)  # a file system without hard links: checked, then renamed
        os.replace(temporary, final)
        return
    temporary.unlink()


def _path_error(exc: OSError, path: Path) -> DeviceError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return media.media_error(exc, f"creating {path}")
    return DeviceError(Status.INVALID_FIELD, f"cannot write the export to {path}: {exc.strerror}")


def _parse(payload: Any) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise DeviceError(Status.INVALID_FIELD, "payload must be a JSON object")
    unknown = set(payload) - PAYLOAD_KEYS
    if unknown:
        raise DeviceError(Status.INVALID_FIELD, f"unknown key(s) {', '.join(sorted(unknown))}; "
                                                f"use {', '.join(sorted(PAYLOAD_KEYS))}")
    for key in ("optimizer_state", "overwrite"):
        if not isinstance(payload.get(key, False), bool):
            raise DeviceError(Status.INVALID_FIELD, f"{key} must be true or false")
    path = payload.get("path")
    if path is not None:
        if not isinstance(path, str) or not os.path.isabs(path):
            raise DeviceError(Status.INVALID_FIELD, f"path must be an absolute path, got {path!r}")
        # What no file name can hold is a bad field, not a failure of the device's (the
        # system calls would raise ValueError or UnicodeEncodeError: INTERNAL_ERROR).
        if "\0" in path:
            raise DeviceError(Status.INVALID_FIELD, f"path {path!r} holds a NUL byte")
        try:
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise DeviceError(Status.INVALID_FIELD, f"path {path!r} is not valid UTF-8 (a lone surrogate)") from None
    return payload


def _within(place: str, folder: str) -> bool:
    return os.path.commonpath([place, folder]) == folder


def _check_target(backing: Path, target: Path, overwrite: bool) -> None:
    """Refuse a path the export must not write: one in the device's own backing folder (its
    superblocks, state copies and metadata: an export there, or a replace of one of its files,
    destroys a namespace), however reached (symlinks resolved; a folder that is the backing
    folder mounted again elsewhere found by its inode), a directory, and with overwrite anything
    but a regular file. Exports without a path go to BACKING/exports, which the device names.
    Any other OSError of the checks is the path's fault: INVALID_FIELD."""
    try:
        own = os.path.realpath(backing)
        real_target, real_parent = os.path.realpath(target), os.path.realpath(target.parent)
        inside = _within(real_target, own) or _within(real_parent, own)
        if not inside:
            backing_id = (os.stat(own).st_ino, os.stat(own).st_dev)
            folder = real_parent
            while True:  # a bind mount of the backing folder has another path but the same inode
                try:
                    info = os.stat(folder)
                except FileNotFoundError:
                    info = None  # not there (yet): opening the file below says so
                if info is not None and (info.st_ino, info.st_dev) == backing_id:
                    inside = True
                    break
                above = os.path.dirname(folder)
                if above == folder:
                    break
                folder = above
        if inside:
            raise DeviceError(Status.INVALID_FIELD,
                              f"{target} is inside the device's backing folder ({own}), whose files are "
                              "the device's own; export elsewhere, or without a path (to BACKING/exports)")
        try:
            mode: int | None = os.lstat(target).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise DeviceError(Status.INVALID_FIELD, f"{target} is a directory")
        if mode is not None and overwrite and not stat.S_ISREG(mode):
            raise DeviceError(Status.INVALID_FIELD, f"{target} is not a regular file (overwrite replaces only "
                                                    "a regular file, never a link, device, pipe or socket)")
    except OSError as exc:
        raise _path_error(exc, target) from None


def start(device: Device, jobs: JobTable, namespace: Namespace, payload: Any) -> Job:
    """Check the request, pin down its source and open the output, then run the rest as a
    job. Whatever fails before the job starts leaves nothing behind."""
    request = _parse(payload)
    tag = request.get("tag")
    if tag is None:
        namespace.snapshots.check_committed()
    snapshot: Snapshot | None = None
    optimizer_state = request.get("optimizer_state", False)
    job_id = jobs.next_id()
    staging = device.path / EXPORTS_DIR / f".job-{job_id}"
    target = Path(request["path"]) if request.get("path") else None
    overwrite = request.get("overwrite", False)
    tmp: Path | None = None
    made_directory: Path | None = None  # a namespace's default directory, removed if left empty
    out_fd = source_fd = -1
    try:
        if tag is not None:
            # Pinned first: a delete, or a delete and a new snapshot of the same tag, from here
            # on changes nothing of what is read (its descriptor) nor of how the file labels it.
            snapshot, source_fd, _, _ = snapshot_pin.pin(namespace, tag, "export", "nothing was written")
        if target is not None:
            _check_target(device.path, target, overwrite)
            if not overwrite:
                _refuse_existing(target)
            tmp, out_fd = _open_temp(target, job_id)
        if snapshot is not None:
            superblock = snapshot.superblock
        else:
            staging.mkdir(parents=True)
            superblock = namespace.snapshots.capture(staging)
            source_fd = os.open(staging / STATE_FILE, os.O_RDONLY)
        file_plan = plan(namespace, superblock, tag, optimizer_state)
        if target is None:
            target = default_path(device.path, namespace.name, superblock.committed_step, tag)
            if not overwrite:
                _refuse_existing(target)
            with _DIRECTORIES:  # not removed by another job's cleanup before the file is in it
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp, out_fd = _open_temp(target, job_id)
            made_directory = target.parent
    except BaseException:
        _close(out_fd, source_fd)
        _remove_temporary(tmp, made_directory)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    assert tmp is not None
    job = Job(job_id, "export", namespace.nsid, namespace.name, tag, superblock.committed_step,
              str(target), file_plan.total_bytes)
    flat = flat_tensors(namespace)
    if flat:
        log.info("export job %d: %s", job_id, shapes_note(namespace.name, flat, len(namespace.spec.tensors)))
    final, temporary = target, tmp

    def work(job: Job) -> None:
        try:
            stream(file_plan, source_fd, superblock, out_fd, job)
            media.sync_fd(out_fd, temporary)
            _publish(temporary, final, overwrite)
            media.fsync_dir(final.parent)
        except OSError as exc:
            raise media.media_error(exc, f"writing {final}") from exc

    def cleanup() -> None:
        _close(out_fd, source_fd)
        _remove_temporary(temporary, made_directory)
        shutil.rmtree(staging, ignore_errors=True)

    return jobs.start(job, work, cleanup)


# Held while a default directory is made and the temporary file put in it, and while a job's
# cleanup removes that directory if nothing is left in it.
_DIRECTORIES = threading.Lock()


def _remove_temporary(tmp: Path | None, directory: Path | None) -> None:
    """Remove an export's temporary file, and the namespace's default directory if the failed
    export leaves it empty (a successful one has its file in it)."""
    with _DIRECTORIES:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if directory is not None:
            try:
                directory.rmdir()
            except OSError:
                pass  # not empty: other exports are in it


def _open_temp(target: Path, job_id: int) -> tuple[Path, int]:
    tmp = target.with_name(f".{target.name}.{job_id}.tmp")
    try:
        return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise _path_error(exc, target) from None


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
