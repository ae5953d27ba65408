"""S1: a second, unprivileged user cannot touch a mount without allow_other; with it, mode bits rule."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device
from cossd.fs import daemon
from helpers import create_namespace, tensor_dir

pytestmark = pytest.mark.mount

OTHER_USER = "cossd-other"

# Run as the other user: try each operation, report "ok" or the errno's name.
PROBE = r"""
import errno, json, os, sys
mp = sys.argv[1]
t = os.path.join(mp, "ns", "model", "tensors", "w")
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))
def read(path):
    with open(path, "rb") as f:
        f.read(8)
def write(path, data):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
results = {
    "stat mountpoint": attempt(lambda: os.stat(os.path.join(mp, "ns"))),
    "list namespaces": attempt(lambda: os.listdir(os.path.join(mp, "ns"))),
    "read config.json": attempt(lambda: read(os.path.join(mp, "ns", "model", "config.json"))),
    "read param": attempt(lambda: read(os.path.join(t, "param"))),
    "read master": attempt(lambda: read(os.path.join(t, "master"))),
    "write grad": attempt(lambda: write(os.path.join(t, "grad"), b"\0\0")),
    "write master": attempt(lambda: write(os.path.join(t, "master"), b"\0\0\0\0")),
    "open .admin": attempt(lambda: os.close(os.open(os.path.join(mp, ".admin"), os.O_RDWR))),
    "create a file": attempt(lambda: os.close(os.open(os.path.join(mp, "ns", "x"), os.O_CREAT | os.O_WRONLY))),
}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def other_user() -> pwd.struct_passwd:
    """An unprivileged user made for this test (kept: creating users is idempotent here)."""
    if os.geteuid() != 0:
        pytest.skip("creating a user needs root")
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        pass
    result = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                             OTHER_USER], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"useradd failed: {result.stderr.strip()}")
    return pwd.getpwnam(OTHER_USER)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory every user can traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="cossd-iso-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def mounted(public_dir: Path, allow_other: bool) -> Mount:
    backing = public_dir / "backing"
    Device.format(backing, capacity_bytes=1 << 30)
    mountpoint = public_dir / "mnt"
    mountpoint.mkdir()
    mountpoint.chmod(0o755)
    pid = daemon.start_background(backing, mountpoint, allow_other=allow_other)
    mount = Mount(backing, mountpoint, pid)
    create_namespace(mountpoint, "model", [("w", 16)])
    (tensor_dir(mountpoint, "model", "w") / "master").write_bytes(np.ones(16, np.float32).tobytes())
    return mount


def _interpreter_for_others() -> str:
    """A Python the other user may run (the venv's may sit under root's private home)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
        if os.path.exists(candidate) and _runnable_by_all(Path(candidate).resolve()):
            return candidate
    pytest.skip("no Python interpreter that another user can run")


def _runnable_by_all(path: Path) -> bool:
    for part in [path, *path.parents]:
        mode = part.stat().st_mode
        if not mode & 0o001:
            return False
    return True


def probe_as(user: pwd.struct_passwd, mountpoint: Path) -> dict[str, str]:
    result = subprocess.run([_interpreter_for_others(), "-c", PROBE, str(mountpoint)], user=user.pw_uid,
                            group=user.pw_gid, extra_groups=[], capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def unmount(mount: Mount) -> None:
    if is_mounted(mount.mountpoint):
        force_unmount(mount.mountpoint)
    wait_for_exit(mount.pid, 30)


def test_other_user_is_shut_out_without_allow_other(other_user: pwd.struct_passwd, public_dir: Path,
                                                    figures: list[str]) -> None:
    mount = mounted(public_dir, allow_other=False)
    try:
        results = probe_as(other_user, mount.mountpoint)
    finally:
        unmount(mount)
    successes = [op for op, outcome in results.items() if outcome == "ok"]
    assert successes == [], results
    assert set(results.values()) == {"EACCES"}, results
    figures.append(f"S1 second user, no allow_other: {len(results)} attempts, 0 successes")


def test_with_allow_other_mode_bits_decide(other_user: pwd.struct_passwd, public_dir: Path) -> None:
    mount = mounted(public_dir, allow_other=True)
    try:
        results = probe_as(other_user, mount.mountpoint)
    finally:
        unmount(mount)
    # Readable by all (0444 / 0755 / 0644): allowed. Owner-only or read-only: refused by the
    # kernel (default_permissions) before the daemon sees the request.
    assert results == {
        "stat mountpoint": "ok",
        "list namespaces": "ok",
        "read config.json": "ok",
        "read param": "ok",
        "read master": "ok",
        "write grad": "EACCES",      # 0200, owned by the mounting user
        "write master": "EACCES",    # 0644 while loading: only the owner writes
        "open .admin": "EACCES",     # 0600
        "create a file": "EACCES",   # directories are 0755
    }, results
