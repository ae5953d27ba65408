"""Mount tier: the errno contract of docs/errno.md, row by row, through raw syscalls."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, start_mount
from cossd.protocol.status import Status
from cossd.protocol.entries import SUBMISSION, Opcode, encode_submission
from cossd.client import AdminClient
from helpers import create_namespace, pread_all, pwrite_all

pytestmark = pytest.mark.mount


@pytest.fixture
def ns(mount: Mount) -> Path:
    create_namespace(mount.mountpoint, "n", [("t", 1000), ("u", 10)])
    return mount.mountpoint / "ns" / "n"


def expect_errno(code: int, function, *args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(OSError) as info:
        function(*args)
    assert info.value.errno == code, (info.value, errno.errorcode.get(code))


def open_write(path: Path) -> int:
    return os.open(path, os.O_WRONLY)


def test_mount_is_listed_as_fuse_cossd(mount: Mount) -> None:
    with open("/proc/self/mounts") as mounts:
        line = next(entry for entry in mounts if entry.split()[1] == str(mount.mountpoint.resolve()))
    device, _, fstype, options = line.split()[:4]
    assert fstype == "fuse.cossd" and device.startswith("cossd:")
    assert "nosuid" in options and "nodev" in options and "allow_other" not in options


def test_tree_and_modes(ns: Path) -> None:
    assert sorted(os.listdir(ns)) == ["config.json", "snapshots", "stats.json", "step", "tensors"]
    assert os.listdir(ns / "snapshots") == [] and stat.S_IMODE(os.stat(ns / "snapshots").st_mode) == 0o555
    assert sorted(os.listdir(ns / "tensors")) == ["t", "u"]
    assert sorted(os.listdir(ns / "tensors" / "t")) == ["exp_avg", "exp_avg_sq", "grad", "master", "param"]
    t = ns / "tensors" / "t"
    assert stat.S_IMODE(os.stat(t / "grad").st_mode) == 0o200
    assert stat.S_IMODE(os.stat(t / "param").st_mode) == 0o444
    assert stat.S_IMODE(os.stat(t / "master").st_mode) == 0o644  # loadable before step 1
    assert os.stat(t / "grad").st_size == 2000 and os.stat(t / "master").st_size == 4000
    assert (ns / "step").read_text() == "0\n"


def test_unknown_names_enoent(ns: Path) -> None:
    expect_errno(errno.ENOENT, os.stat, ns.parent / "nope")
    expect_errno(errno.ENOENT, os.stat, ns / "tensors" / "nope")
    expect_errno(errno.ENOENT, os.stat, ns / "tensors" / "t" / "nope")
    expect_errno(errno.ENOENT, os.open, ns / "tensors" / "t" / "other", os.O_RDONLY)


def test_grad_write_errors(ns: Path) -> None:
    fd = open_write(ns / "tensors/t/grad")
    try:
        expect_errno(errno.EINVAL, os.pwrite, fd, b"\0\0", 1)      # offset not on an element
        expect_errno(errno.EINVAL, os.pwrite, fd, b"\0\0\0", 0)    # length not whole elements
        expect_errno(errno.EFBIG, os.pwrite, fd, b"\0\0" * 2, 1998)  # past the end
        assert os.pwrite(fd, b"\0\0" * 10, 0) == 20
        expect_errno(errno.EEXIST, os.pwrite, fd, b"\0\0" * 2, 18)  # element 9 again
    finally:
        os.close(fd)
    # Nothing was committed by the failed writes.
    assert (ns / "step").read_text() == "0\n"


def test_open_mode_errors(ns: Path) -> None:
    t = ns / "tensors/t"
    expect_errno(errno.EACCES, os.open, t / "grad", os.O_RDONLY)
    expect_errno(errno.EACCES, os.open, t / "param", os.O_WRONLY)
    for name in ("config.json", "step", "stats.json"):
        expect_errno(errno.EACCES, os.open, ns / name, os.O_WRONLY)
    # After the first step, master and moments are read-only views of the state.
    for tensor, numel in (("t", 1000), ("u", 10)):
        pwrite_all(ns / "tensors" / tensor / "grad", np.zeros(numel, np.float16).tobytes())
    assert (ns / "step").read_text() == "1\n"
    for role in ("master", "exp_avg", "exp_avg_sq"):
        expect_errno(errno.EROFS, os.open, t / role, os.O_WRONLY)
        assert stat.S_IMODE(os.stat(t / role).st_mode) == 0o444


def test_master_write_alignment(ns: Path) -> None:
    fd = open_write(ns / "tensors/t/master")
    try:
        expect_errno(errno.EINVAL, os.pwrite, fd, b"\0" * 4, 2)
        expect_errno(errno.EFBIG, os.pwrite, fd, b"\0" * 8, 3996)
        assert os.pwrite(fd, np.ones(1000, np.float32).tobytes(), 0) == 4000
    finally:
        os.close(fd)
    assert pread_all(ns / "tensors/t/param") == np.ones(1000, np.float16).tobytes()


def test_control_file_errors(mount: Mount, ns: Path) -> None:
    with AdminClient(mount.mountpoint) as client:
        # errno channel: not a well-formed submission
        expect_errno(errno.EINVAL, os.write, client.transport.admin_fd, _oversized_header())
        # status channel: unknown opcode, bad fields; never a state change
        assert client.submit(0x7F).status == Status.INVALID_OPCODE
        assert client.submit(0xFE).status == Status.INVALID_OPCODE
        assert client.submit(Opcode.CREATE_NAMESPACE, payload=b"{not json").status == Status.INVALID_FIELD
        assert client.submit(Opcode.BEGIN_STEP, nsid=99).status == Status.INVALID_NAMESPACE
        nsid = client.nsid("n")
        assert client.submit(Opcode.COMMIT_STEP, nsid=nsid).status == Status.NO_STEP_OPEN
        assert client.submit(Opcode.BEGIN_STEP, nsid=nsid, cdw10=7).status == Status.STEP_NUMBER_MISMATCH
        bad_name = b'{"name": "../x", "tensors": [["a", 1]]}'
        assert client.submit(Opcode.CREATE_NAMESPACE, payload=bad_name).status == Status.INVALID_NAME
        # still serving, nothing changed
        assert [n["name"] for n in client.describe()["namespaces"]] == ["n"]
    assert (ns / "step").read_text() == "0\n"


def _oversized_header() -> bytes:
    header = bytearray(encode_submission(Opcode.VENDOR_IDENTIFY))
    header[24:28] = (64 << 20).to_bytes(4, "little")  # announces a 64 MiB payload
    assert len(header) == SUBMISSION.itemsize
    return bytes(header)


def test_explicit_step_through_control_file(mount: Mount, ns: Path) -> None:
    with AdminClient(mount.mountpoint) as client:
        nsid = client.nsid("n")
        assert client.begin_step(nsid, 1, grad_scale=1 / 1024) == 1
        pwrite_all(ns / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
        incomplete = client.submit(Opcode.COMMIT_STEP, nsid=nsid)
        assert incomplete.status == Status.GRADIENT_INCOMPLETE and b"u" in incomplete.data
        pwrite_all(ns / "tensors/u/grad", np.ones(10, np.float16).tobytes())
        assert (ns / "step").read_text() == "0\n"  # explicit steps wait for the commit
        assert client.commit_step(nsid)["committed_step"] == 1
        assert (ns / "step").read_text() == "1\n"
        client.begin_step(nsid)
        poisoned = np.ones(10, np.float16)
        poisoned[3] = np.nan
        pwrite_all(ns / "tensors/u/grad", poisoned.tobytes())
        pwrite_all(ns / "tensors/t/grad", np.ones(1000, np.float16).tobytes())
        result = client.commit_step(nsid)
        assert result["skipped"] and result["committed_step"] == 1
        assert client.statistics(nsid)["steps_skipped"] == 1


def test_identify_controller_fields(mount: Mount) -> None:
    with AdminClient(mount.mountpoint) as client:
        page = client.call(Opcode.IDENTIFY, cdw10=1).data
    assert len(page) == 4096
    assert page[4:24].decode().strip() == "TESTSERIAL0001"
    assert page[24:64].decode().strip() == "cossd computational SSD emulator"
    assert int.from_bytes(page[280:296], "little") == 8 << 30


@pytest.mark.parametrize("handler", ["read", "lookup"])
def test_handler_exception_is_eio_and_mount_keeps_serving(backing: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, handler: str) -> None:
    from cossd.emulator import Device, NamespaceSpec, TensorSpec

    with Device.open(backing) as device:
        device.create_namespace(NamespaceSpec("n", (TensorSpec("t", 4),)))
    # The first such request the daemon serves fails with an unexpected exception (reading
    # a file makes a LOOKUP per path component, then a READ).
    monkeypatch.setenv("COSSD_FAULT_HOOKS", f"fail-handler={handler}:1")  # fs/fault_hooks.py
    mounted = start_mount(backing, tmp_path / "mnt")
    try:
        step_file = mounted.mountpoint / "ns/n/step"
        expect_errno(errno.EIO, step_file.read_text)
        assert step_file.read_text() == "0\n"
        assert "injected failure" in (backing / "daemon.log").read_text()
    finally:
        mounted.unmount()


def test_unmount_flushes_and_remount_serves_state(mount: Mount, ns: Path) -> None:
    for tensor, numel in (("t", 1000), ("u", 10)):
        pwrite_all(ns / "tensors" / tensor / "grad", np.full(numel, 0.5, np.float16).tobytes())
    master = pread_all(ns / "tensors/t/master")
    mount.unmount()
    mount.restart()
    assert (ns / "step").read_text() == "1\n"
    assert pread_all(ns / "tensors/t/master") == master
    stats = (ns / "stats.json").read_text()
    assert '"durable_step": 1' in stats


def test_large_command_payload_arrives_in_pieces(mount: Mount) -> None:
    """A create-namespace payload over FUSE's 1 MiB request size is reassembled."""
    tensors = [(f"layer{i:05d}." + "x" * 100, 1) for i in range(12_000)]
    create_namespace(mount.mountpoint, "wide", tensors)
    names = os.listdir(mount.mountpoint / "ns/wide/tensors")
    assert len(names) == 12_000
