"""The tests' SeaweedFS server (harness/s3_server.py) leaves nothing behind once stopped: no
process and none of the Unix sockets weed makes in /tmp beside its ports."""
from __future__ import annotations

from pathlib import Path

import pytest

from s3_server import MISSING, WEED, client, start_weed


def sockets_of(ports: tuple[int, ...]) -> list[Path]:
    return [path for port in ports for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]


def test_a_stopped_server_leaves_no_process_and_no_socket(tmp_path: Path) -> None:
    if WEED is None:
        pytest.skip(MISSING)
    server = start_weed(tmp_path, "cleanup")
    try:
        client(server.endpoint).put_object(Bucket="cleanup", Key="k", Body=b"v")
        assert sockets_of(server.ports), "weed made no socket in /tmp: this test no longer checks anything"
    finally:
        server.stop()
    assert server.process.poll() is not None
    assert sockets_of(server.ports) == []
