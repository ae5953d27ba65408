"""The daemon's memory is bounded per client and in total: a client that writes commands to
.admin and never reads their completions gets EAGAIN, many handles holding half-written 16 MiB
payloads get ENOMEM, and the daemon's peak RSS (VmHWM) stays within its buffers; each handle
works again once it reads its completions or the others close."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.protocol.status import Status
from cossd.protocol.entries import COMPLETION, Opcode, decode_completion, encode_submission
from cossd.fs import daemon
from cossd.fs.admin_queue import COMPLETION_OVERHEAD, QUEUE_DEPTH, TOTAL_PENDING_BYTES, TOTAL_QUEUED_BYTES
from cossd.client import AdminClient

pytestmark = pytest.mark.mount

# What the attacks may add to the daemon's peak RSS: the buffers (64 MiB each) and slack.
RSS_SLACK_MB = 100
# The unbounded daemon grew 48 -> 1218 MB in 8 s; the attack stops well before that.
ATTACK_COMMANDS = 60_000
IDENTIFY = encode_submission(Opcode.IDENTIFY, cdw10=1)  # a 4 KiB page each


def memory_mb(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of `pid`, in MiB."""
    figures = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures[key] = int(value.split()[0]) // 1024
    return figures


def read_completion(fd: int) -> tuple[Status, int]:
    header = os.read(fd, COMPLETION.itemsize)
    assert len(header) == COMPLETION.itemsize, header
    completion, data_len = decode_completion(header)
    data = os.read(fd, data_len) if data_len else b""
    assert len(data) == data_len
    return completion.status, completion.cid


def stop(mount: Mount) -> None:
    if is_mounted(mount.mountpoint):
        force_unmount(mount.mountpoint)
    wait_for_exit(mount.pid, 30)


@pytest.fixture(params=["data path", "pyfuse3"])
def any_mount(request: pytest.FixtureRequest, backing: Path, tmp_path: Path) -> Iterator[Mount]:
    """A mount whose .admin is served by the data path's threads, or by pyfuse3 (no threads)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    io_threads = None if request.param == "data path" else 0
    mounted = Mount(backing, mountpoint, daemon.start_background(backing, mountpoint, io_threads=io_threads))
    try:
        yield mounted
    finally:
        stop(mounted)


def test_unread_completions_are_bounded(any_mount: Mount, figures: list[str]) -> None:
    """One client writes IDENTIFY commands in 1024-command writes and never reads: the queue
    fills at QUEUE_DEPTH, the write that would pass it is short and the next one EAGAIN; the
    daemon's peak RSS stays bounded; after reading every completion the handle runs commands
    again."""
    mount = any_mount
    with AdminClient(mount.mountpoint) as warm:
        warm.describe()
    before = memory_mb(mount.pid)
    fd = os.open(mount.mountpoint / ".admin", os.O_RDWR)
    try:
        batch = IDENTIFY * 1024
        accepted, refused = 0, None
        while accepted < ATTACK_COMMANDS:
            try:
                written = os.write(fd, batch)
            except OSError as exc:
                refused = exc.errno
                break
            assert written % len(IDENTIFY) == 0
            accepted += written // len(IDENTIFY)
        after = memory_mb(mount.pid)
        figures.append(f"unread-completion attack ({mount.mountpoint.name}): {accepted} commands queued, then "
                       f"{errno.errorcode.get(refused or 0)}; daemon RSS {before['VmRSS']} MB before, "
                       f"peak {after['VmHWM']} MB")
        assert refused == errno.EAGAIN, f"{accepted} completions queued without a refusal"
        assert accepted == QUEUE_DEPTH
        assert after["VmHWM"] - before["VmRSS"] < RSS_SLACK_MB, (before, after)
        # Refused: nothing of the refused write was taken, so a retry after reading is exact.
        statuses = [read_completion(fd)[0] for _ in range(accepted)]
        assert statuses == [Status.SUCCESS] * accepted
        assert os.read(fd, COMPLETION.itemsize) == b""
        assert os.write(fd, IDENTIFY) == len(IDENTIFY)
        assert read_completion(fd)[0] == Status.SUCCESS
    finally:
        os.close(fd)


def test_unread_completions_are_bounded_in_total(mount: Mount, figures: list[str]) -> None:
    """32 handles each fill their queue: past TOTAL_QUEUED_BYTES of them together, a handle
    that holds an unread completion is full, one with none still runs a command."""
    with AdminClient(mount.mountpoint) as warm:
        warm.describe()
    before = memory_mb(mount.pid)
    fds = [os.open(mount.mountpoint / ".admin", os.O_RDWR) for _ in range(32)]
    try:
        queued = []
        for fd in fds:
            count = 0
            while True:
                try:
                    count += os.write(fd, IDENTIFY * 256) // len(IDENTIFY)
                except OSError as exc:
                    assert exc.errno == errno.EAGAIN
                    break
            queued.append(count)
        after = memory_mb(mount.pid)
        figures.append(f"unread completions on 32 handles: {sum(queued)} queued in all; daemon RSS "
                       f"{before['VmRSS']} MB before, peak {after['VmHWM']} MB")
        page = 4096 + COMPLETION.itemsize + COMPLETION_OVERHEAD
        assert sum(queued) * page < TOTAL_QUEUED_BYTES + QUEUE_DEPTH * page
        assert queued[0] == QUEUE_DEPTH and queued[-1] == 1  # one command with none unread
        assert after["VmHWM"] - before["VmRSS"] < RSS_SLACK_MB, (before, after)
        with AdminClient(mount.mountpoint) as client:  # a client that reads what it writes
            assert client.describe()["identity"]["model"]
        for fd, count in zip(fds, queued):
            assert [read_completion(fd)[0] for _ in range(count)] == [Status.SUCCESS] * count
        assert os.write(fds[-1], IDENTIFY) == len(IDENTIFY)  # room again
        assert read_completion(fds[-1])[0] == Status.SUCCESS
    finally:
        for fd in fds:
            os.close(fd)


def test_a_pipelining_client_under_the_limit_is_unaffected(mount: Mount) -> None:
    """Several commands in one write, then every completion read: all run, in order."""
    fd = os.open(mount.mountpoint / ".admin", os.O_RDWR)
    try:
        for _ in range(3):
            batch = b"".join(encode_submission(Opcode.IDENTIFY, cid=cid, cdw10=1) for cid in range(256))
            assert os.write(fd, batch) == len(batch)
            assert [read_completion(fd) for _ in range(256)] == [(Status.SUCCESS, cid) for cid in range(256)]
    finally:
        os.close(fd)
    with AdminClient(mount.mountpoint) as client:  # and the real client, one command at a time
        for _ in range(QUEUE_DEPTH + 8):
            client.describe()


def test_half_written_payloads_are_bounded(mount: Mount, figures: list[str]) -> None:
    """48 handles each write a VENDOR_IDENTIFY announcing a 16 MiB payload and all of it but
    one byte: once the daemon holds TOTAL_PENDING_BYTES of them, a write is refused with
    ENOMEM (nothing of it taken); the peak RSS stays bounded; once the others close, the
    refused handle finishes its command."""
    header = bytearray(encode_submission(Opcode.VENDOR_IDENTIFY, cid=9))
    header[24:28] = (16 << 20).to_bytes(4, "little")
    chunk = bytes(1 << 20)
    with AdminClient(mount.mountpoint) as warm:
        warm.describe()
    before = memory_mb(mount.pid)
    fds: list[int] = []
    refused: dict[int, int] = {}  # handle index -> payload bytes it had written
    try:
        for index in range(48):
            fd = os.open(mount.mountpoint / ".admin", os.O_RDWR)
            fds.append(fd)
            assert os.write(fd, bytes(header)) == len(header)
            sent = 0
            while sent < (16 << 20) - 1:
                piece = chunk[: min(len(chunk), (16 << 20) - 1 - sent)]
                try:
                    written = os.write(fd, piece)
                except OSError as exc:
                    assert exc.errno == errno.ENOMEM, exc
                    refused[index] = sent
                    break
                assert written == len(piece)
                sent += written
        after = memory_mb(mount.pid)
        figures.append(f"half-written payload attack: {48 - len(refused)} of 48 handles hold 16 MiB - 1, "
                       f"{len(refused)} refused ENOMEM; daemon RSS {before['VmRSS']} MB before, "
                       f"peak {after['VmHWM']} MB")
        assert refused, "every handle held its partial payload"
        assert 48 - len(refused) == TOTAL_PENDING_BYTES // (16 << 20)
        assert after["VmHWM"] - before["VmRSS"] < RSS_SLACK_MB, (before, after)
        # No command ran: nothing was complete.
        assert all(os.read(fd, COMPLETION.itemsize) == b"" for fd in fds)
        # The holders go away; the first refused handle sends the rest and its command runs.
        first = min(refused)
        for index, fd in enumerate(fds):
            if index not in refused:
                os.close(fd)
        fds = [fd for index, fd in enumerate(fds) if index in refused]
        fd = fds[0]
        rest = bytes((16 << 20) - refused[first])
        for offset in range(0, len(rest), len(chunk)):
            assert os.write(fd, rest[offset : offset + len(chunk)]) == min(len(chunk), len(rest) - offset)
        assert read_completion(fd) == (Status.SUCCESS, 9)
    finally:
        for fd in fds:
            os.close(fd)
    with AdminClient(mount.mountpoint) as client:  # the mount serves on
        assert client.describe()["identity"]["model"]


def test_released_handles_give_their_budget_back(mount: Mount) -> None:
    """Handles closed with completions unread and payloads half written free what they held:
    the budget does not leak across many such clients."""
    header = bytearray(encode_submission(Opcode.VENDOR_IDENTIFY))
    header[24:28] = (16 << 20).to_bytes(4, "little")
    for _ in range(3 * TOTAL_PENDING_BYTES // (16 << 20)):
        fd = os.open(mount.mountpoint / ".admin", os.O_RDWR)
        try:
            os.write(fd, IDENTIFY * 8)
            os.write(fd, bytes(header) + bytes((16 << 20) - 1))
        finally:
            os.close(fd)
    fd = os.open(mount.mountpoint / ".admin", os.O_RDWR)
    try:  # a whole 16 MiB payload is still taken: nothing leaked
        command = bytes(header) + bytes(16 << 20)
        assert os.write(fd, command) == len(command)
        assert read_completion(fd)[0] == Status.SUCCESS
    finally:
        os.close(fd)
