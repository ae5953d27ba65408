"""fs/datapath.py: a request gets exactly one reply, even where the namespace of a gradient
write it has already answered is deleted (delete-ns from another process) before the data
path schedules the background flush; and fs/operations.py refuses, at open, writing to every
role the host cannot write (param, param_fp8), as for param."""
from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path
from typing import Iterator

import pyfuse3
import pytest

from cossd.emulator import Device, NamespaceSpec, TensorSpec
from cossd.fs import datapath
from cossd.fs.nodes import Kind, Node
from cossd.fs.operations import Operations

NUMEL = 1000


@pytest.fixture
def operations(tmp_path: Path) -> Iterator[Operations]:
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        yield Operations(device)


def _array_inode(operations: Operations, namespace: str, role: str) -> int:
    nsid = operations.device.namespaces[namespace].nsid
    return operations.tree.inode(Node(Kind.ARRAY, nsid, "t", role))


def _write_request(unique: int, fh: int, data: bytes) -> bytes:
    head = datapath.RW_IN.pack(fh, 0, len(data), 0).ljust(datapath.RW_IN_SIZE, b"\0")
    length = datapath.WRITE_DATA_AT + len(data)
    return datapath.IN_HEADER.pack(length, datapath.FUSE_WRITE, unique, 99, 0, 0, 0, 0, 0) + head + data


def _replies(sock: socket.socket) -> list[bytes]:
    sock.setblocking(False)
    replies = []
    while True:
        try:
            replies.append(sock.recv(1 << 16))
        except BlockingIOError:
            return replies


def _serve_one(path: datapath.DataPath, request: bytes, caplog: pytest.LogCaptureFixture) -> list[bytes]:
    """`request` served by the data path's loop as the kernel's only one; every reply it wrote."""
    ours, kernel = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    requests = iter([request])
    path._device = ours.fileno()
    path._receive = lambda poller: next(requests, None)  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, logger="cossd.fs"):
            path._serve_until_stopped(None)  # type: ignore[arg-type]
        return _replies(kernel)
    finally:
        ours.close()
        kernel.close()


def test_a_write_answered_before_its_namespace_is_deleted_gets_one_reply(
        operations: Operations, caplog: pytest.LogCaptureFixture) -> None:
    device = operations.device
    device.create_namespace(NamespaceSpec("n", (TensorSpec("t", NUMEL),)))
    fh, _, _ = operations.open_handle(_array_inode(operations, "n", "grad"), os.O_WRONLY)
    written_by = operations.write_data

    def write_then_delete(handle, off, buf):  # type: ignore[no-untyped-def]
        written = written_by(handle, off, buf)  # completes the implicit step (a whole gradient)
        device.delete_namespace("n")  # `cossd delete-ns` from another process, right after
        return written

    operations.write_data = write_then_delete  # type: ignore[method-assign]
    path = datapath.DataPath(operations, session_fd=-1, threads=1)
    replies = _serve_one(path, _write_request(7, fh, bytes(2 * NUMEL)), caplog)
    assert len(replies) == 1, [datapath.OUT_HEADER.unpack_from(r) for r in replies]
    length, error, unique, size, _ = datapath.WRITE_OUT.unpack(replies[0])
    assert (length, error, unique, size) == (datapath.WRITE_OUT.size, 0, 7, 2 * NUMEL)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "n" not in device.namespaces


def test_a_second_reply_never_follows_a_failure_after_the_first(
        operations: Operations, caplog: pytest.LogCaptureFixture) -> None:
    """A bug in what runs after a reply is logged, and the request is not answered again."""
    device = operations.device
    device.create_namespace(NamespaceSpec("n", (TensorSpec("t", NUMEL),)))
    fh, _, _ = operations.open_handle(_array_inode(operations, "n", "grad"), os.O_WRONLY)
    path = datapath.DataPath(operations, session_fd=-1, threads=1)

    def broken(handle):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug after the reply")

    path._schedule_flush = broken  # type: ignore[method-assign]
    replies = _serve_one(path, _write_request(8, fh, bytes(2 * NUMEL)), caplog)
    assert [datapath.OUT_HEADER.unpack_from(r)[1:] for r in replies] == [(0, 8)]
    assert "request failed" in caplog.text  # the bug is still logged


@pytest.mark.parametrize("role", ["param", "param_fp8"])
@pytest.mark.parametrize("access", [os.O_WRONLY, os.O_RDWR])
def test_roles_the_host_cannot_write_are_refused_at_open(operations: Operations, role: str, access: int) -> None:
    operations.device.create_namespace(NamespaceSpec("f8", (TensorSpec("t", NUMEL),), param_wire_dtype="fp8_e4m3"))
    inode = _array_inode(operations, "f8", role)
    with pytest.raises(pyfuse3.FUSEError) as info:
        operations.open_handle(inode, access)
    assert info.value.errno == errno.EACCES
    fh, _, _ = operations.open_handle(inode, os.O_RDONLY)  # reading them is what they are for
    operations.release_handle(fh)
