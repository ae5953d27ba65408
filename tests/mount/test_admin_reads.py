"""A client reads each completion of .admin in one read where it fits (the entry and its data):
a read never returns bytes of two completions, so the whole entry and data come back intact
however the reads split them, through the data path's threads and through pyfuse3."""
from __future__ import annotations

import json
import os

import pytest

from conftest import Mount
from test_daemon_bounds import any_mount  # noqa: F401 (a fixture: the data path or pyfuse3)
from cossd.client import AdminClient
from cossd.client import transport
from cossd.protocol.entries import COMPLETION, Opcode, decode_completion, encode_submission

pytestmark = pytest.mark.mount


def test_a_large_read_returns_one_completion_whole_and_never_the_next(any_mount: Mount) -> None:
    with AdminClient(any_mount.mountpoint) as admin:
        admin.create_namespace({"name": "net", "tensors": [["w", 8]]})
    fd = os.open(any_mount.mountpoint / ".admin", os.O_RDWR)
    try:
        # Two commands with data, queued before either is read.
        os.write(fd, encode_submission(Opcode.VENDOR_IDENTIFY, cid=1) + encode_submission(Opcode.IDENTIFY, cid=2,
                                                                                          cdw10=1))
        first = os.read(fd, 1 << 20)
        entry, data_len = decode_completion(first[:COMPLETION.itemsize])
        assert entry.cid == 1 and len(first) == COMPLETION.itemsize + data_len  # all of it, none of the next
        assert json.loads(first[COMPLETION.itemsize:])["namespaces"][0]["name"] == "net"
        second = os.read(fd, 1 << 20)
        entry, data_len = decode_completion(second[:COMPLETION.itemsize])
        assert entry.cid == 2 and data_len == 4096 and len(second) == COMPLETION.itemsize + data_len
        assert os.read(fd, 1 << 20) == b""  # nothing left
    finally:
        os.close(fd)


@pytest.mark.parametrize("first_read", [1, COMPLETION.itemsize - 1, COMPLETION.itemsize, COMPLETION.itemsize + 7])
def test_the_client_gets_every_byte_however_its_first_read_splits_the_completion(
        any_mount: Mount, monkeypatch: pytest.MonkeyPatch, first_read: int) -> None:
    """A first read shorter than the entry, than the entry and its data, or a page: the rest
    is read until the completion is whole, and the next command's completion is its own."""
    with AdminClient(any_mount.mountpoint) as admin:
        admin.create_namespace({"name": "net", "tensors": [["w", 8]]})
        expected = admin.describe()
        monkeypatch.setattr(transport, "COMPLETION_READ_BYTES", first_read)
        for _ in range(2):
            assert admin.describe() == expected
            assert len(admin.submit(Opcode.IDENTIFY, cdw10=1).data) == 4096
