"""The metrics endpoint can be restricted: with `--metrics-token-file` a real mount answers a
scrape only with `Authorization: Bearer <token>` (401 otherwise); without it the endpoint is
open, on loopback by default, and `--help` says so. Unusable token files fail the mount with
one line before anything starts."""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device
from cossd.fs import daemon
from cossd.tools.cli import main
from helpers import create_namespace, free_port

pytestmark = pytest.mark.mount

TOKEN = "s3cret-token-0123456789abcdef"



def get(port: int, authorization: str | None = None) -> tuple[int, dict[str, str], str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read().decode()


def token_file(tmp_path: Path, text: str = TOKEN + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "metrics.token"
    path.write_text(text)
    path.chmod(mode)
    return path


def listening_addresses(pid: int, port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) `pid` listens on at `port`."""
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if int(hex_port, 16) == port and fields[3] == "0A":  # LISTEN
                    found.add(address)
    return found


def stop(mount: Mount) -> None:
    if is_mounted(mount.mountpoint):
        force_unmount(mount.mountpoint)
    wait_for_exit(mount.pid, 30)


@pytest.fixture
def guarded_mount(backing: Path, tmp_path: Path) -> Iterator[tuple[Mount, int]]:
    port = free_port()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    pid = daemon.start_background(backing, mountpoint, metrics_port=port,
                                  metrics_token_file=token_file(tmp_path))
    mounted = Mount(backing, mountpoint, pid)
    try:
        yield mounted, port
    finally:
        stop(mounted)


def test_a_token_file_requires_the_bearer_token(guarded_mount: tuple[Mount, int]) -> None:
    mount, port = guarded_mount
    create_namespace(mount.mountpoint, "secret-project", [("w", 8)])
    for authorization in (None, "Bearer wrong", f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, f"bearer{TOKEN}"):
        status, headers, body = get(port, authorization)
        assert status == 401, authorization
        assert headers.get("WWW-Authenticate", "").startswith("Bearer")
        assert "secret-project" not in body and "cossd_" not in body
    status, _, body = get(port, f"Bearer {TOKEN}")
    assert status == 200
    assert 'cossd_committed_step{namespace="secret-project"}' in body
    assert listening_addresses(mount.pid, port) == {"0100007F"}  # 127.0.0.1, loopback only


def test_without_a_token_file_the_endpoint_is_open_on_loopback(
        backing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounted = Mount(backing, mountpoint, daemon.start_background(backing, mountpoint, metrics_port=port))
    try:
        status, _, body = get(port)
        assert status == 200 and "cossd_namespaces" in body
        assert listening_addresses(mounted.pid, port) == {"0100007F"}
    finally:
        stop(mounted)
    log = (backing / "daemon.log").read_text()
    assert "without authentication" in log
    # --help states the exposure and the way to restrict it.
    with pytest.raises(SystemExit):
        main(["mount", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Unauthenticated" in text and "--metrics-token-file" in text and "namespace names" in text


@pytest.mark.parametrize(("content", "mode", "message"), [
    ("", 0o600, "is empty"),
    ("two words\n", 0o600, "without white space"),
    (TOKEN, 0o644, "readable by every user"),
    (None, 0o600, "cannot read the metrics token file"),
])
def test_unusable_token_files_fail_the_mount_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, mode: int, message: str) -> None:
    backing = tmp_path / "backing"
    Device.format(backing, capacity_bytes=1 << 30)
    superblock = (backing / "superblock.json").read_bytes()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    path = token_file(tmp_path, content, mode) if content is not None else tmp_path / "missing.token"
    code = main(["mount", str(backing), str(mountpoint), "--metrics-port", str(free_port()),
                 "--metrics-token-file", str(path)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and message in err, err
    assert not is_mounted(mountpoint)
    assert (backing / "superblock.json").read_bytes() == superblock  # never opened
    code = main(["mount", str(backing), str(mountpoint), "--metrics-token-file", str(token_file(tmp_path))])
    assert code == 1 and "goes with --metrics-port" in capsys.readouterr().err
    assert not os.listdir(mountpoint)
