"""F1: every row of docs/errno.md and of its limits table, one parametrized case per row, via raw syscalls.

Each case names its table row. A case returns the errno it observed (0 for success); rows
about the backing store failing are driven at the emulator tier (test_media_faults.py) and the
mapping of their status to an errno is checked here.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from conftest import Mount, force_unmount, is_mounted, start_mount, wait_for_exit
from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.protocol.status import STATUS_ERRNO
from cossd.emulator.names import MAX_GROUPS, MAX_NAMESPACES, MAX_TENSOR_ELEMENTS, MAX_TENSORS_PER_NAMESPACE
from cossd.protocol.entries import Opcode, encode_submission
from cossd.client import AdminClient
from helpers import create_namespace, pwrite_all

pytestmark = pytest.mark.mount


class Env:
    """One mount with a loading namespace "n" (t: 1000 elements, u: 10) and helpers."""

    def __init__(self, mount: Mount) -> None:
        self.mount = mount
        self.mp = mount.mountpoint
        self.admin = AdminClient(self.mp)
        self._count = 0

    def fresh(self, sealed: bool = False) -> Path:
        """A new namespace (t: 1000, u: 10); sealed: one step committed."""
        self._count += 1
        name = f"ns{self._count}"
        create_namespace(self.mp, name, [("t", 1000), ("u", 10)])
        root = self.mp / "ns" / name
        if sealed:
            pwrite_all(root / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
            pwrite_all(root / "tensors/u/grad", np.ones(10, np.float16).tobytes())
            assert (root / "step").read_text() == "1\n"
        return root


def errno_of(action: Callable[[], object]) -> int:
    try:
        action()
        return 0
    except OSError as exc:
        return exc.errno or -1


def write_at(path: Path, data: bytes, offset: int = 0, flags: int = os.O_WRONLY) -> int:
    fd = os.open(path, flags)
    try:
        return os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def read_at(path: Path, size: int, offset: int = 0) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the rows

def row_lookup_missing(env: Env) -> int:
    return errno_of(lambda: os.stat(env.mp / "ns" / "nope"))


def row_lookup_not_utf8(env: Env) -> int:
    return errno_of(lambda: os.stat(os.fsencode(env.mp / "ns") + b"/\xff\xfe"))


def row_path_through_file(env: Env) -> int:
    return errno_of(lambda: os.stat(env.mp / ".admin" / "x"))


def row_opendir_on_file(env: Env) -> int:
    root = env.fresh()
    return errno_of(lambda: os.listdir(root / "step"))


def row_deleted_namespace_handle(env: Env) -> int:
    root = env.fresh()
    fd = os.open(root / "tensors/t/param", os.O_RDONLY)
    try:
        env.admin.delete_namespace(env.admin.nsid(root.name))
        return errno_of(lambda: os.pread(fd, 2, 0))
    finally:
        os.close(fd)


def row_open_admin_any_mode(env: Env) -> int:
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
        os.close(os.open(env.mp / ".admin", flags))
    return 0


def row_open_text_for_writing(env: Env) -> int:
    root = env.fresh()
    codes = {errno_of(lambda name=name: os.open(root / name, os.O_WRONLY)) for name in ("config.json", "step", "stats.json")}
    assert len(codes) == 1
    return codes.pop()


def row_open_grad_for_reading(env: Env) -> int:
    return errno_of(lambda: os.open(env.fresh() / "tensors/t/grad", os.O_RDONLY))


def row_open_grad_read_write(env: Env) -> int:
    # As fio and many tools open a file they write; each read is refused as it comes.
    fd = os.open(env.fresh() / "tensors/t/grad", os.O_RDWR)
    try:
        assert errno_of(lambda: os.pread(fd, 2, 0)) == errno.EACCES
        return errno_of(lambda: os.pwrite(fd, bytes(2), 0))
    finally:
        os.close(fd)


def row_open_param_for_writing(env: Env) -> int:
    return errno_of(lambda: os.open(env.fresh() / "tensors/t/param", os.O_WRONLY))


def row_open_state_after_seal_root(env: Env) -> int:
    root = env.fresh(sealed=True)
    codes = {errno_of(lambda r=r: os.open(root / "tensors/t" / r, os.O_WRONLY)) for r in ("master", "exp_avg", "exp_avg_sq")}
    assert len(codes) == 1
    return codes.pop()


def row_open_directory_for_writing(env: Env) -> int:
    return errno_of(lambda: os.open(env.fresh() / "tensors", os.O_WRONLY))


def row_chmod_chown(env: Env) -> int:
    path = env.fresh() / "tensors/t/param"
    codes = {errno_of(lambda: os.chmod(path, 0o777)), errno_of(lambda: os.chown(path, 1, 1))}
    assert len(codes) == 1
    return codes.pop()


def row_truncate_same_size(env: Env) -> int:
    root = env.fresh()
    os.truncate(root / "tensors/t/master", 4000)
    os.truncate(root / "tensors/t/grad", 0)
    os.close(os.open(root / "tensors/t/grad", os.O_WRONLY | os.O_TRUNC))
    return 0


def row_truncate_other_size(env: Env) -> int:
    return errno_of(lambda: os.truncate(env.fresh() / "tensors/t/master", 12))


def row_utimes(env: Env) -> int:
    return errno_of(lambda: os.utime(env.fresh() / "tensors/t/param", (1, 1)))


def row_read_grad(env: Env) -> int:
    return errno_of(lambda: read_at(env.fresh() / "tensors/t/grad", 2))


def row_read_past_end(env: Env) -> int:
    root = env.fresh()
    assert read_at(root / "tensors/t/param", 100, offset=2000) == b""
    assert read_at(root / "tensors/t/param", 100, offset=1 << 30) == b""
    return 0


def row_read_text_captured_at_open(env: Env) -> int:
    root = env.fresh()
    fd = os.open(root / "step", os.O_RDONLY)
    try:
        pwrite_all(root / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
        pwrite_all(root / "tensors/u/grad", np.ones(10, np.float16).tobytes())
        assert os.pread(fd, 16, 0) == b"0\n"  # what it said at open
        assert (root / "step").read_text() == "1\n"
    finally:
        os.close(fd)
    return 0


def row_read_while_step_open(env: Env) -> int:
    root = env.fresh(sealed=True)
    before = read_at(root / "tensors/t/param", 2000)
    pwrite_all(root / "tensors/t/grad", np.ones(1000, np.float16).tobytes())  # u still missing
    assert read_at(root / "tensors/t/param", 2000) == before
    return 0


def row_read_admin_nothing_pending(env: Env) -> int:
    with AdminClient(env.mp) as fresh:
        assert os.read(fresh.transport.admin_fd, 16) == b""
    return 0


def row_grad_misaligned(env: Env) -> int:
    path = env.fresh() / "tensors/t/grad"
    codes = {errno_of(lambda: write_at(path, b"\0\0", 1)), errno_of(lambda: write_at(path, b"\0\0\0", 0))}
    assert len(codes) == 1
    return codes.pop()


def row_grad_past_end(env: Env) -> int:
    return errno_of(lambda: write_at(env.fresh() / "tensors/t/grad", b"\0" * 4, 1998))


def row_grad_duplicate(env: Env) -> int:
    path = env.fresh() / "tensors/t/grad"
    write_at(path, b"\0" * 20, 0)
    return errno_of(lambda: write_at(path, b"\0" * 20, 10))


def row_grad_outside_a_shared_step(env: Env) -> int:
    root = env.fresh()
    nsid = env.admin.nsid(root.name)
    job = {"job": 1, "seq": 1, "ranks": 1, "rank": 0}
    env.admin.begin_shared_step(nsid, 1, 1.0, **job)
    env.admin.abort_shared_step(nsid, 1, reason="a test", **job)
    code = errno_of(lambda: write_at(root / "tensors/t/grad", b"\0" * 20, 0))
    assert json.loads((root / "stats.json").read_text())["step_open"] is None  # no implicit step
    return code


def row_grad_empty(env: Env) -> int:
    assert write_at(env.fresh() / "tensors/t/grad", b"", 0) == 0
    return 0


def row_grad_nonfinite(env: Env) -> int:
    root = env.fresh()
    bad = np.ones(10, np.float16)
    bad[2] = np.nan
    pwrite_all(root / "tensors/u/grad", bad.tobytes())
    pwrite_all(root / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
    stats = json.loads((root / "stats.json").read_text())
    assert stats["steps_skipped"] == 1 and stats["committed_step"] == 0
    return 0


def row_media_failure_status(env: Env) -> int:
    # Driven at the emulator tier (test_media_faults.py); what a client then sees is this mapping.
    assert STATUS_ERRNO[Status.WRITE_FAULT] == errno.EIO
    assert STATUS_ERRNO[Status.CAPACITY_EXCEEDED] == errno.ENOSPC
    assert STATUS_ERRNO[Status.INTERNAL_ERROR] == errno.EIO
    return 0


def row_master_misaligned(env: Env) -> int:
    return errno_of(lambda: write_at(env.fresh() / "tensors/t/master", b"\0" * 6, 0))


def row_moment_misaligned(env: Env) -> int:
    return errno_of(lambda: write_at(env.fresh() / "tensors/t/exp_avg", b"\0" * 4, 2))


def row_state_past_end(env: Env) -> int:
    return errno_of(lambda: write_at(env.fresh() / "tensors/t/exp_avg_sq", b"\0" * 8, 3996))


def row_state_handle_after_seal(env: Env) -> int:
    root = env.fresh()
    fd = os.open(root / "tensors/t/master", os.O_WRONLY)
    try:
        pwrite_all(root / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
        pwrite_all(root / "tensors/u/grad", np.ones(10, np.float16).tobytes())
        return errno_of(lambda: os.pwrite(fd, b"\0" * 4, 0))
    finally:
        os.close(fd)


def row_write_read_only_handle(env: Env) -> int:
    fd = os.open(env.fresh() / "tensors/t/master", os.O_RDONLY)
    try:
        return errno_of(lambda: os.pwrite(fd, b"\0" * 4, 0))
    finally:
        os.close(fd)


def row_admin_oversized(env: Env) -> int:
    header = bytearray(encode_submission(Opcode.VENDOR_IDENTIFY))
    header[24:28] = (64 << 20).to_bytes(4, "little")
    with AdminClient(env.mp) as fresh:
        return errno_of(lambda: os.write(fresh.transport.admin_fd, bytes(header)))


def row_admin_partial(env: Env) -> int:
    raw = encode_submission(Opcode.VENDOR_IDENTIFY, cid=7)
    with AdminClient(env.mp) as fresh:
        assert os.write(fresh.transport.admin_fd, raw[:10]) == 10
        assert os.read(fresh.transport.admin_fd, 16) == b""  # nothing ran yet
        assert os.write(fresh.transport.admin_fd, raw[10:]) == len(raw) - 10
        assert len(os.read(fresh.transport.admin_fd, 16)) == 16
    return 0


def row_admin_command_failure(env: Env) -> int:
    assert env.admin.submit(0x7F).status == Status.INVALID_OPCODE  # the write itself succeeded
    return 0


def row_create_no_capacity(env: Env) -> int:
    huge = {"name": "huge", "tensors": [["w", 1 << 36]]}
    completion = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(huge).encode())
    assert completion.status == Status.NAMESPACE_INSUFFICIENT_CAPACITY
    return STATUS_ERRNO[completion.status]


def row_fsync_tensor_file(env: Env) -> int:
    root = env.fresh(sealed=True)
    fd = os.open(root / "tensors/t/param", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert json.loads((root / "stats.json").read_text())["durable_step"] == 1
    return 0


def row_fsync_admin(env: Env) -> int:
    with AdminClient(env.mp) as fresh:
        os.fsync(fresh.transport.admin_fd)
    return 0


def row_unsupported_namespace_ops(env: Env) -> int:
    root = env.fresh()
    attempts = [
        lambda: os.mkdir(root / "d"),
        lambda: os.rmdir(root / "tensors"),
        lambda: os.close(os.open(root / "new", os.O_CREAT | os.O_WRONLY)),
        lambda: os.mknod(root / "fifo", 0o600 | 0o010000),
        lambda: os.unlink(root / "step"),
        lambda: os.rename(root / "step", root / "step2"),
        lambda: os.symlink("step", root / "link"),
    ]
    codes = {errno_of(attempt) for attempt in attempts}
    assert len(codes) == 1, codes
    # link: the kernel's protected_hardlinks check (fs.protected_hardlinks = 1) refuses a
    # link to a file the caller may not write with EPERM before the daemon is asked.
    assert errno_of(lambda: os.link(root / "step", root / "hard")) in (errno.EPERM, errno.ENOSYS)
    return codes.pop()


def row_setxattr(env: Env) -> int:
    return errno_of(lambda: os.setxattr(env.fresh() / "step", "user.x", b"1"))


# limits table

def row_limit_names(env: Env) -> int:
    for bad in ("", "../x", "a/b", ".x", "a\x00b", "x" * 129):
        status = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(
            {"name": bad, "tensors": [["t", 1]]}).encode()).status
        assert status == Status.INVALID_NAME, (bad, status)
    assert os.statvfs(env.mp).f_namemax == 128
    return STATUS_ERRNO[Status.INVALID_NAME]


def row_limit_tensors(env: Env) -> int:
    too_many = [[f"t{i}", 1] for i in range(MAX_TENSORS_PER_NAMESPACE + 1)]
    status = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(
        {"name": "many", "tensors": too_many}).encode()).status
    assert status == Status.LIMIT_EXCEEDED
    none = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=b'{"name": "none", "tensors": []}').status
    assert none == Status.INVALID_FIELD
    return STATUS_ERRNO[status]


def row_limit_elements(env: Env) -> int:
    for numel in (0, MAX_TENSOR_ELEMENTS + 1):
        status = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(
            {"name": "big", "tensors": [["t", numel]]}).encode()).status
        assert status == Status.LIMIT_EXCEEDED
    assert not (env.mount.backing / "ns" / "big").exists()  # refused before any allocation
    return STATUS_ERRNO[Status.LIMIT_EXCEEDED]


def row_limit_groups(env: Env) -> int:
    status = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(
        {"name": "g", "tensors": [["t", 1]], "groups": [{}] * (MAX_GROUPS + 1)}).encode()).status
    assert status == Status.LIMIT_EXCEEDED
    return STATUS_ERRNO[status]


def row_limit_namespaces(env: Env) -> int:
    # 1024 real namespaces would take a while through the mount: the emulator enforces it.
    assert MAX_NAMESPACES == 1024
    return STATUS_ERRNO[Status.NAMESPACE_ID_UNAVAILABLE]


def row_limit_payload(env: Env) -> int:
    return row_admin_oversized(env)


# ---------------------------------------------------------------------- a plain NVM namespace's data

def _nvm(env: Env, size: int = 8192) -> Path:
    """A new plain NVM namespace of `size` bytes; returns its data file."""
    env._count += 1
    name = f"nvm{env._count}"
    env.admin.create_namespace({"name": name, "kind": "nvm", "capacity_bytes": size})
    return env.mp / "ns" / name / "data"


def row_nvm_open_any_mode(env: Env) -> int:
    data = _nvm(env)
    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
        os.close(os.open(data, flags))
    return 0


def row_nvm_read_past_end(env: Env) -> int:
    data = _nvm(env)
    assert read_at(data, 100, 8192) == b"" and read_at(data, 100, 8150) == bytes(42)
    return 0


def row_nvm_write_anywhere(env: Env) -> int:
    data = _nvm(env)
    assert write_at(data, b"abc", 4095) == 3 and read_at(data, 5, 4094) == b"\0abc\0"
    return 0


def row_nvm_write_past_end(env: Env) -> int:
    data = _nvm(env)
    observed = errno_of(lambda: write_at(data, b"z" * 10, 8190))
    assert read_at(data, 8192) == bytes(8192)  # nothing written
    return observed


def row_nvm_fsync(env: Env) -> int:
    data = _nvm(env)
    fd = os.open(data, os.O_RDWR)
    try:
        os.pwrite(fd, b"d", 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert json.loads((data.parent / "stats.json").read_text())["dirty"] is False
    return 0


def row_nvm_optimizer_command(env: Env) -> int:
    data = _nvm(env)
    nsid = env.admin.nsid(data.parent.name)
    completion = env.admin.submit(Opcode.BEGIN_STEP, nsid=nsid)
    assert completion.status == Status.NAMESPACE_KIND_MISMATCH
    return STATUS_ERRNO[completion.status]


def row_nvm_create_bad_size(env: Env) -> int:
    payload = {"name": "odd-size", "kind": "nvm", "capacity_bytes": 4097}
    completion = env.admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(payload).encode())
    assert completion.status == Status.INVALID_FIELD
    return STATUS_ERRNO[completion.status]


# ---------------------------------------------------------------------- snapshots (read-only)

def _snapshot(env: Env) -> Path:
    """A sealed namespace with a snapshot "s"; returns the snapshot's tensors/t directory."""
    from cossd.client import snapshots as snapshot_calls

    root = env.fresh(sealed=True)
    snapshot_calls.create_snapshot(env.admin, env.admin.nsid(root.name), "s")
    return root / "snapshots/s/tensors/t"


def row_snapshot_open_for_writing(env: Env) -> int:
    tensor = _snapshot(env)
    paths = [tensor / role for role in ("param", "master", "exp_avg", "exp_avg_sq")]
    codes = {errno_of(lambda p=p: os.open(p, os.O_WRONLY)) for p in [*paths, tensor.parents[1] / "step"]}
    assert len(codes) == 1
    return codes.pop()


def row_snapshot_truncate(env: Env) -> int:
    return errno_of(lambda: os.truncate(_snapshot(env) / "master", 0))


def row_snapshot_read_bad_checksum(env: Env) -> int:
    tensor = _snapshot(env)
    namespace = tensor.parents[3].name
    state = env.mount.backing / "ns" / namespace / "snapshots/s/state"
    with open(state, "r+b") as file:  # flip the first master byte of t: block 0 fails
        first = file.read(1)
        file.seek(0)
        file.write(bytes([first[0] ^ 1]))
    return errno_of(lambda: read_at(tensor / "param", 2))


def row_limit_snapshot_tags(env: Env) -> int:
    root = env.fresh(sealed=True)
    payload = json.dumps({"tag": "../escape"}).encode()
    completion = env.admin.submit(Opcode.SNAPSHOT_CREATE, nsid=env.admin.nsid(root.name), payload=payload)
    assert completion.status == Status.INVALID_NAME
    assert not (env.mount.backing / "ns" / root.name / "snapshots").exists()
    return STATUS_ERRNO[completion.status]


def row_snapshot_deleted_handle(env: Env) -> int:
    from cossd.client import snapshots as snapshot_calls

    tensor = _snapshot(env)
    fd = os.open(tensor / "param", os.O_RDONLY)
    try:
        snapshot_calls.delete_snapshot(env.admin, env.admin.nsid(tensor.parents[3].name), "s")
        return errno_of(lambda: os.pread(fd, 2, 0))
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- injected failures

def row_injected_io_failure(env: Env) -> int:
    from cossd.tools.verbs.inject import arm_injection

    root = env.fresh()
    arm_injection(env.admin, 1, "WRITE_FAULT", queue="io", nsid=env.admin.nsid(root.name))
    observed = errno_of(lambda: write_at(root / "tensors/t/grad", bytes(2000)))
    assert json.loads((root / "stats.json").read_text())["step_open"] is None  # nothing reached it
    assert write_at(root / "tensors/t/grad", bytes(2000)) == 2000  # fired once: the next is served
    return observed


ROWS = [
    ("lookup, stat, open: a name that does not exist", row_lookup_missing, errno.ENOENT),
    ("lookup: a name that is not valid UTF-8", row_lookup_not_utf8, errno.ENOENT),
    ("lookup, stat, open: a path through a file", row_path_through_file, errno.ENOTDIR),
    ("opendir, readdir: on a file", row_opendir_on_file, errno.ENOTDIR),
    ("any operation: its namespace was deleted", row_deleted_namespace_handle, errno.ENOENT),
    ("open: .admin, any access mode", row_open_admin_any_mode, 0),
    ("open for writing: config.json, step, stats.json", row_open_text_for_writing, errno.EACCES),
    ("open for reading: grad", row_open_grad_for_reading, errno.EACCES),
    ("open read-write: grad (its reads: EACCES)", row_open_grad_read_write, 0),
    ("open for writing: param", row_open_param_for_writing, errno.EACCES),
    ("open for writing (root): state after the first step", row_open_state_after_seal_root, errno.EROFS),
    ("open for writing: a directory", row_open_directory_for_writing, errno.EISDIR),
    ("setattr: chmod, chown", row_chmod_chown, errno.EPERM),
    ("truncate or O_TRUNC: to 0 or the current size", row_truncate_same_size, 0),
    ("truncate: to any other size", row_truncate_other_size, errno.EINVAL),
    ("utimes: any file (the device keeps the times)", row_utimes, errno.EPERM),
    ("read: grad", row_read_grad, errno.EACCES),
    ("read: at or past the end", row_read_past_end, 0),
    ("read: text files are captured at open", row_read_text_captured_at_open, 0),
    ("read: param while a step is open", row_read_while_step_open, 0),
    ("read: .admin with no completion pending", row_read_admin_nothing_pending, 0),
    ("write grad: misaligned offset or length", row_grad_misaligned, errno.EINVAL),
    ("write grad: past the end", row_grad_past_end, errno.EFBIG),
    ("write grad: already written in the open step", row_grad_duplicate, errno.EEXIST),
    ("write grad: no step open while the namespace runs shared steps", row_grad_outside_a_shared_step, errno.EINVAL),
    ("write grad: length 0", row_grad_empty, 0),
    ("write grad: inf/NaN skips the step", row_grad_nonfinite, 0),
    ("write grad: sealing, flushing, superblock or kernel fails", row_media_failure_status, 0),
    ("write master: misaligned", row_master_misaligned, errno.EINVAL),
    ("write exp_avg: misaligned", row_moment_misaligned, errno.EINVAL),
    ("write state: past the end", row_state_past_end, errno.EFBIG),
    ("write state: handle opened while loading, after sealing", row_state_handle_after_seal, errno.EROFS),
    ("write: through a read-only handle", row_write_read_only_handle, errno.EBADF),
    ("write .admin: data_len over 16 MiB", row_admin_oversized, errno.EINVAL),
    ("write .admin: part of a submission", row_admin_partial, 0),
    ("write .admin: a command that fails", row_admin_command_failure, 0),
    ("command: create without capacity", row_create_no_capacity, errno.ENOSPC),
    ("fsync: a tensor file flushes the committed step", row_fsync_tensor_file, 0),
    ("fsync: .admin", row_fsync_admin, 0),
    ("read, write: an injected failure on the data path", row_injected_io_failure, errno.EIO),
    ("mkdir, rmdir, create, mknod, unlink, rename, symlink (link: EPERM)", row_unsupported_namespace_ops, errno.ENOSYS),
    ("setxattr: any file", row_setxattr, errno.EOPNOTSUPP),
    ("limit: names", row_limit_names, errno.EINVAL),
    ("limit: tensors per namespace", row_limit_tensors, errno.E2BIG),
    ("limit: elements per tensor", row_limit_elements, errno.E2BIG),
    ("limit: groups per namespace", row_limit_groups, errno.E2BIG),
    ("limit: namespaces per device", row_limit_namespaces, errno.ENOSPC),
    ("limit: payload of one submission", row_limit_payload, errno.EINVAL),
    ("open for writing: a snapshot file", row_snapshot_open_for_writing, errno.EROFS),
    ("truncate: a snapshot file", row_snapshot_truncate, errno.EROFS),
    ("read: a snapshot block that fails its checksum", row_snapshot_read_bad_checksum, errno.EIO),
    ("read: a snapshot deleted since the open", row_snapshot_deleted_handle, errno.ENOENT),
    ("limit: snapshot tags", row_limit_snapshot_tags, errno.EINVAL),
    ("open: nvm data, any access mode", row_nvm_open_any_mode, 0),
    ("read nvm data: at or past the end", row_nvm_read_past_end, 0),
    ("write nvm data: any offset and length inside", row_nvm_write_anywhere, 0),
    ("write nvm data: past the end", row_nvm_write_past_end, errno.EFBIG),
    ("fsync: nvm data makes acknowledged writes durable", row_nvm_fsync, 0),
    ("command: an optimizer command on an nvm namespace", row_nvm_optimizer_command, errno.EINVAL),
    ("command: create nvm with a size not a multiple of 4096", row_nvm_create_bad_size, errno.EINVAL),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("errno")
    backing = root / "backing"
    Device.format(backing, capacity_bytes=8 << 30)
    mount = start_mount(backing, root / "mnt")
    environment = Env(mount)
    try:
        yield environment
    finally:
        environment.admin.close()
        if is_mounted(mount.mountpoint):
            force_unmount(mount.mountpoint)
        wait_for_exit(mount.pid, 30)


@pytest.mark.parametrize(("row", "case", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_errno_table_row(env: Env, row: str, case: Callable[[Env], int], expected: int) -> None:
    observed = case(env)
    assert observed == expected, f"{row}: {errno.errorcode.get(observed, observed)}, " \
                                 f"documented {errno.errorcode.get(expected, expected)}"
    # Whatever the row did, the mount is still serving.
    assert env.admin.describe()["identity"]["model"]


def test_namespace_limit_in_the_emulator(tmp_path: Path) -> None:
    """The 1025th namespace is refused (tiny namespaces, straight on the emulator)."""
    Device.format(tmp_path / "dev", capacity_bytes=1 << 40)
    with Device.open(tmp_path / "dev") as device:
        for index in range(MAX_NAMESPACES):
            device.create_namespace(NamespaceSpec(f"n{index}", (TensorSpec("t", 1),)))
        with pytest.raises(DeviceError) as info:
            device.create_namespace(NamespaceSpec("one-more", (TensorSpec("t", 1),)))
        assert info.value.status == Status.NAMESPACE_ID_UNAVAILABLE


def test_slow_writer_does_not_hold_up_other_namespaces(env: Env) -> None:
    """A writer trickling a step in 2-byte pieces; another namespace trains meanwhile."""
    import threading
    import time

    slow, fast, reference = env.fresh(), env.fresh(), env.fresh()
    grad_t = (np.arange(1000, dtype=np.float32) / 1000).astype(np.float16)
    grad_u = np.ones(10, np.float16)
    done = threading.Event()

    def trickle() -> None:
        pwrite_all(slow / "tensors/u/grad", grad_u.tobytes())
        data = grad_t.tobytes()
        for offset in range(0, 200, 2):  # the first 100 elements, one at a time
            write_at(slow / "tensors/t/grad", data[offset:offset + 2], offset)
            time.sleep(0.002)
        write_at(slow / "tensors/t/grad", data[200:], 200)
        done.set()

    thread = threading.Thread(target=trickle)
    thread.start()
    for _ in range(3):  # the fast namespace completes steps while the slow one is open
        pwrite_all(fast / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
        pwrite_all(fast / "tensors/u/grad", np.ones(10, np.float16).tobytes())
    assert (fast / "step").read_text() == "3\n"
    thread.join(60)
    assert done.is_set() and (slow / "step").read_text() == "1\n"
    pwrite_all(reference / "tensors/u/grad", grad_u.tobytes())
    pwrite_all(reference / "tensors/t/grad", grad_t.tobytes())
    for role in ("master", "exp_avg", "exp_avg_sq", "param"):
        assert (slow / "tensors/t" / role).read_bytes() == (reference / "tensors/t" / role).read_bytes()


def test_efbig_is_the_refusal_of_a_write_past_a_files_end_only() -> None:
    """The refused-write log (fs/refusals.py) tells a write past a file's end by its errno
    alone, as a remote mount knows it: EFBIG must be LBA_OUT_OF_RANGE's and no other status's."""
    assert [status for status, code in STATUS_ERRNO.items() if code == errno.EFBIG] == [Status.LBA_OUT_OF_RANGE]
