"""The tests' S3 server: harness/s3_server.py (SeaweedFS on loopback or in a network namespace), re-exported under its old name, and a store the environment points at."""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cossd.harness.s3_server import KEY, MISSING, SECRET, WEED, WeedServer, client, free_ports, start_weed

__all__ = ["KEY", "MISSING", "SECRET", "WEED", "WeedServer", "client", "free_ports", "start_weed", "store_in_environment",
           "weed_in_environment"]

_NAMES = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@contextlib.contextmanager
def weed_in_environment(root: Path, bucket: str) -> Iterator[WeedServer]:
    """SeaweedFS on loopback with `bucket` made; for the block, AWS_* in this process's
    environment name it (so boto3, and the daemons the tests start, find it as a user's
    would): the server. Skips where `weed` is missing; the server is stopped after (a
    paused one resumed first)."""
    if WEED is None:
        pytest.skip(MISSING)
    server = start_weed(root, bucket)
    saved = {name: os.environ.get(name) for name in _NAMES}
    try:
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=KEY, AWS_SECRET_ACCESS_KEY=SECRET)
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            os.killpg(server.process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


@contextlib.contextmanager
def store_in_environment(root: Path, bucket: str) -> Iterator[str]:
    """weed_in_environment's server, as its endpoint."""
    with weed_in_environment(root, bucket) as server:
        yield server.endpoint
