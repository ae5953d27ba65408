"""The remote mount (`cossd mount cossd://HOST:PORT MNT`): a real `cossd serve` on loopback and a
real FUSE mount of it on this node, against a local mount of an identical device: the tree and
its attributes, errnos, the hidden-size check and AdamW bit for bit, an overflow skipped, the
CLI verbs through `.admin`, refused credentials, a killed server, `cossd umount`."""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.client import AdminClient
from helpers import run_cli
# The server's fixtures (a fresh device served on loopback with a token, stopped after).
from test_server import (HIDDEN, Served, _certificates, _train_adamw, serve, served, token_file,  # noqa: F401
                         train_hidden)

pytestmark = pytest.mark.mount

# A short client timeout: a test of a lost server must fail fast, never hang.
TIMEOUT_S = 5.0


@dataclasses.dataclass
class RemoteMount:
    mountpoint: Path
    pid: int
    log: Path

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def mount_remote(capsys: pytest.CaptureFixture[str], url: str, mountpoint: Path, token_file: Path,
                 *options: object) -> tuple[int, str, str]:
    mountpoint.mkdir(exist_ok=True)
    return run_cli(capsys, "mount", url, mountpoint, "--token-file", token_file, "--timeout", TIMEOUT_S,
                   "--log-file", mountpoint.with_suffix(".log"), *options)


@pytest.fixture
def remote_mount(served: Served, token_file: Path, tmp_path: Path,
                 capsys: pytest.CaptureFixture[str]) -> Iterator[RemoteMount]:
    """The served device mounted at tmp_path/rmnt, always detached and its daemon gone after."""
    mountpoint = tmp_path / "rmnt"
    # Header and data digests both (the URL's options reach every connection of the mount).
    code, out, err = mount_remote(capsys, f"{served.url}?digest=both", mountpoint, token_file, "-o", "json")
    assert code == 0, err
    answer = json.loads(out)
    mounted = RemoteMount(mountpoint, answer["pid"], Path(answer["log"]))
    try:
        yield mounted
    finally:
        if is_mounted(mountpoint):
            force_unmount(mountpoint)
        try:
            wait_for_exit(mounted.pid, 15)
        except TimeoutError:
            os.kill(mounted.pid, signal.SIGKILL)
            wait_for_exit(mounted.pid, 15)


def _same_content(client: AdminClient, mountpoint: Path) -> None:
    """An optimizer namespace one step on (the gradients written with dd), a snapshot of it,
    and a plain NVM namespace: the same commands and writes on either mount."""
    client.create_namespace({"name": "gpt", "tensors": [["w", 1000], ["b", 10]],
                             "hyperparameters": {"lr": 1e-3}})
    client.create_namespace({"name": "blk", "kind": "nvm", "capacity_bytes": 1 << 20})
    tensors = mountpoint / "ns" / "gpt" / "tensors"
    for name, numel in (("w", 1000), ("b", 10)):
        source = mountpoint.parent / f"grad-{name}.bin"
        source.write_bytes(np.full(numel, 0.5, np.float16).tobytes())
        subprocess.run(["dd", f"if={source}", f"of={tensors / name / 'grad'}", "bs=256", "status=none"],
                       check=True)
    from cossd.client.snapshots import create_snapshot

    create_snapshot(client, client.nsid("gpt"), "t1")


def _tree(mountpoint: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under the mount: (mode, size, links)."""
    found = {}
    for directory, subdirectories, files in os.walk(mountpoint):
        for name in subdirectories + files:
            path = Path(directory) / name
            info = os.lstat(path)
            found[str(path.relative_to(mountpoint))] = (info.st_mode, info.st_size, info.st_nlink)
    return found


def _errno(operation: Callable[[], object]) -> int | None:
    try:
        operation()
    except OSError as exc:
        return exc.errno
    return None


def _open_close(path: Path, flags: int) -> None:
    os.close(os.open(path, flags))


def _pwrite(path: Path, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _errnos(mountpoint: Path) -> dict[str, int | None]:
    """One file operation of each kind a mount refuses: the errno each gives."""
    ns = mountpoint / "ns" / "gpt"
    w = ns / "tensors" / "w"
    return {
        "stat a missing name": _errno(lambda: os.stat(ns / "nope")),
        "a missing namespace": _errno(lambda: os.stat(mountpoint / "ns" / "nope" / "step")),
        "read a grad": _errno(lambda: _open_close(w / "grad", os.O_RDONLY)),
        "write a param": _errno(lambda: _open_close(w / "param", os.O_WRONLY)),
        "write a text file": _errno(lambda: _open_close(ns / "step", os.O_WRONLY)),
        "write a sealed master": _errno(lambda: _open_close(w / "master", os.O_WRONLY)),
        "write a snapshot": _errno(lambda: _open_close(ns / "snapshots" / "t1" / "tensors" / "w" / "param",
                                                       os.O_WRONLY)),
        "touch": _errno(lambda: os.utime(w / "param")),
        "chmod": _errno(lambda: os.chmod(w / "param", 0o666)),
        "truncate to another size": _errno(lambda: os.truncate(w / "master", 5)),
        "mkdir": _errno(lambda: os.mkdir(ns / "x")),
        "open a directory for writing": _errno(lambda: _open_close(ns / "tensors", os.O_WRONLY)),
        "a misaligned gradient": _errno(lambda: _pwrite(w / "grad", b"\0", 1)),
        "a gradient past the end": _errno(lambda: _pwrite(w / "grad", b"\0\0", 2000)),
        "a gradient twice in a step": _errno(lambda: (_pwrite(w / "grad", b"\0\0", 0), _pwrite(w / "grad", b"\0\0", 0))),
    }


def test_tree_attributes_and_errnos_as_a_local_mount(mount: Mount, remote_mount: RemoteMount) -> None:
    local, far = mount.mountpoint, remote_mount.mountpoint
    with AdminClient(local) as client:
        _same_content(client, local)
    with AdminClient(far) as client:
        _same_content(client, far)
    tree = _tree(far)
    expected = _tree(local)
    for counters in ("ns/gpt/stats.json", "ns/blk/stats.json"):  # live timings: their length varies
        assert tree.pop(counters)[0] == expected.pop(counters)[0] == stat.S_IFREG | 0o444
    assert tree == expected
    assert {".admin", "ns/gpt/step", "ns/gpt/config.json", "ns/gpt/tensors/w/grad", "ns/gpt/snapshots/t1/tensors/b/exp_avg_sq",
            "ns/blk/data"} <= set(tree)
    assert tree[".admin"][0] == stat.S_IFREG | 0o600 and tree["ns/blk/data"][1] == 1 << 20
    for name in ("step", "config.json", "snapshots/t1/step"):
        assert (far / "ns" / "gpt" / name).read_bytes() == (local / "ns" / "gpt" / name).read_bytes()
    assert (far / "ns/gpt/step").read_text() == "1\n"
    for role in ("param", "master", "exp_avg"):
        live = (far / "ns/gpt/tensors/w" / role).read_bytes()
        assert live == (local / "ns/gpt/tensors/w" / role).read_bytes()
        assert (far / "ns/gpt/snapshots/t1/tensors/w" / role).read_bytes() == live
    # Times are the device's: a step moves the state files' mtime, not config.json's.
    param, config = far / "ns/gpt/tensors/b/param", far / "ns/gpt/config.json"
    before = (os.stat(param).st_mtime_ns, os.stat(config).st_mtime_ns)
    time.sleep(0.05)
    for name, numel in (("w", 1000), ("b", 10)):
        _pwrite(far / "ns/gpt/tensors" / name / "grad", np.full(numel, 0.25, np.float16).tobytes(), 0)
    assert (far / "ns/gpt/step").read_text() == "2\n"
    assert os.stat(param).st_mtime_ns > before[0] and os.stat(config).st_mtime_ns == before[1]
    # The same refusals, errno for errno (the last leaves a step open on each).
    expected = _errnos(local)
    assert _errnos(far) == expected
    assert expected["read a grad"] == errno.EACCES and expected["write a snapshot"] == errno.EROFS
    # The remote daemon's log says why a write was refused, as a local mount's does (the
    # first refused write of the window: the misaligned gradient).
    refusals = [line for line in remote_mount.log_text().splitlines() if "write refused with" in line]
    assert refusals and "write refused with EINVAL (Invalid argument): " in refusals[0], refusals
    assert "2-byte element boundaries" in refusals[0], refusals
    # An NVM namespace's blocks, written and read back with dd-like I/O.
    block = os.urandom(8192)
    _pwrite(far / "ns/blk/data", block, 4096)
    with open(far / "ns/blk/data", "rb") as data:
        data.seek(4096)
        assert data.read(8192) == block
    assert "Traceback" not in remote_mount.log_text()


def test_overflow_skips_the_step_as_locally(mount: Mount, remote_mount: RemoteMount) -> None:
    """An inf gradient written with dd: the step is skipped, visibly, as on a local mount."""
    stats = []
    for mountpoint in (mount.mountpoint, remote_mount.mountpoint):
        with AdminClient(mountpoint) as client:
            client.create_namespace({"name": "o", "tensors": [["x", 5000]]})
        grad = np.full(5000, 0.5, np.float16)
        grad[4321] = np.inf
        source = mountpoint.parent / f"{mountpoint.name}-inf.bin"
        source.write_bytes(grad.tobytes())
        subprocess.run(["dd", f"if={source}", f"of={mountpoint}/ns/o/tensors/x/grad", "bs=4096", "status=none"],
                       check=True)
        assert (mountpoint / "ns/o/step").read_text() == "0\n"
        shown = json.loads((mountpoint / "ns/o/stats.json").read_text())
        stats.append({key: shown[key] for key in ("steps_skipped", "last_skipped_step", "nonfinite_elements",
                                                  "committed_step", "steps_committed")})
    assert stats[1] == stats[0] and stats[0]["steps_skipped"] == 1 and stats[0]["nonfinite_elements"] == 1


def test_fsync_and_ext4_on_an_nvm_namespace_through_the_remote_mount(remote_mount: RemoteMount) -> None:
    """fsync of a tensor file and of an NVM namespace's data is the device's FLUSH, and ext4
    works on the remote data file through a loop device (the conventional checkpoint path of
    the I/O-path comparison): what it wrote reads back once mounted again."""
    mountpoint = remote_mount.mountpoint
    with AdminClient(mountpoint) as client:
        client.create_namespace({"name": "f", "tensors": [["x", 4096]]})
        client.create_namespace({"name": "v", "kind": "nvm", "capacity_bytes": 8 << 20})
    for path, flags in ((mountpoint / "ns/f/tensors/x/param", os.O_RDONLY), (mountpoint / "ns/v/data", os.O_RDWR)):
        fd = os.open(path, flags)
        try:
            os.fsync(fd)  # the daemon failed this with EIO before (an internal error)
        finally:
            os.close(fd)
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None or shutil.which("losetup") is None:
        pytest.skip("ext4 on a loop device needs root, mkfs.ext4 and losetup")
    from cossd.harness.nvm_volume import NvmVolume

    payload = np.random.default_rng(7).bytes(3 << 20)
    directory = mountpoint.parent / "ext4"
    directory.mkdir()
    with NvmVolume(mountpoint, "e", 64 << 20, directory, keep_namespace=True) as volume:
        with open(volume.path / "checkpoint.bin", "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fsync(stream.fileno())
    with NvmVolume(mountpoint, "e", 64 << 20, directory, create=False) as volume:
        assert (volume.path / "checkpoint.bin").read_bytes() == payload


def test_hidden_sizes_and_adamw_bit_for_bit_as_a_local_mount(mount: Mount, remote_mount: RemoteMount,
                                                            token_file: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Odd tensor sizes, shuffled chunked pwrites of FP16 gradients (one step with an inf,
    skipped), explicit steps through `.admin`: every state file equal bit for bit to a local
    mount's; then cossd.trainer.AdamW(mount=MNT) under GradScaler, likewise."""
    with AdminClient(mount.mountpoint) as local, AdminClient(remote_mount.mountpoint) as far:
        expected = train_hidden(local)
        assert train_hidden(far) == expected
    assert all(len(expected[f"{t}/master"]) == 4 * n for t, n in HIDDEN)
    import torch

    local_params, local_masters, local_step = _train_adamw(mount.mountpoint, monkeypatch, token_file)
    params, masters, step = _train_adamw(remote_mount.mountpoint, monkeypatch, token_file)
    assert step == local_step == 4
    assert all(torch.equal(a, b) for a, b in zip(params, local_params))
    assert all(torch.equal(a, b) for a, b in zip(masters, local_masters))


def test_cli_verbs_through_the_remote_mount(served: Served, remote_mount: RemoteMount, token_file: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The verbs take the remote mount as a local one (each opens `.admin`: a queue pair of
    the mount's daemon, forwarded to the server) and answer as through the URL itself."""
    far = remote_mount.mountpoint
    code, out, err = run_cli(capsys, "id-ctrl", far, "-o", "json")
    assert code == 0, err
    through_mount = json.loads(out)
    code, out, err = run_cli(capsys, "id-ctrl", served.url, "--token-file", token_file, "-o", "json")
    assert code == 0, err
    assert through_mount == json.loads(out) and through_mount["sn"].strip() == "TESTSERIAL0001"
    code, out, err = run_cli(capsys, "smart-log", far, "-o", "json")
    assert code == 0, err
    assert json.loads(out)["critical_warning"] == 0
    code, out, err = run_cli(capsys, "create-ns", far, "v", "--tensor", "a:3001", "--tensor", "b:7")
    assert code == 0, err
    code, out, err = run_cli(capsys, "id-ns", far / "ns" / "v", "-o", "json")  # MNT/ns/NAME, as nvme-cli names one
    assert code == 0 and json.loads(out)["cossd"]["name"] == "v", err
    code, out, err = run_cli(capsys, "begin-step", far, "v")
    assert code == 0 and "step=1" in out, err
    code, out, err = run_cli(capsys, "commit-step", far, "v")
    assert code == 1 and "GRADIENT_INCOMPLETE" in err
    code, out, err = run_cli(capsys, "abort-step", far, "v")
    assert code == 0, err
    code, out, err = run_cli(capsys, "snapshot", far, "v", "s0")
    assert code == 0, err
    assert (far / "ns/v/snapshots/s0/step").read_text() == "0\n"
    code, out, err = run_cli(capsys, "delete-ns", far, "v")
    assert code == 0, err
    assert not (far / "ns/v").exists()
    # One open() of .admin is one queue pair: two clients' completions never mix.
    with AdminClient(far) as first, AdminClient(far) as second:
        assert first.describe() == second.describe()
    assert "Traceback" not in remote_mount.log_text()


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_refused_credentials_or_no_server_fail_the_mount_and_leave_nothing(
        served: Served, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad-token"
    bad.write_text("w" * 32 + "\n")
    bad.chmod(0o600)
    mountpoint = tmp_path / "refused"
    code, out, err = mount_remote(capsys, served.url, mountpoint, bad)
    assert code == 1 and "refused at connect" in err and "Traceback" not in err, err
    assert not is_mounted(mountpoint)
    code, out, err = mount_remote(capsys, f"cossd://127.0.0.1:{_closed_port()}", mountpoint, token_file)
    assert code == 1 and "cannot connect" in err, err
    assert not is_mounted(mountpoint)
    code, out, err = run_cli(capsys, "mount", "cossd://127.0.0.1:99999", mountpoint)
    assert code == 1 and "bad port" in err
    # The device's own options are the server's: refused, not ignored.
    code, out, err = mount_remote(capsys, served.url, mountpoint, token_file, "--cmb-size", "0")
    assert code == 1 and "--cmb-size" in err and not is_mounted(mountpoint)
    from cossd.fs.remote.daemon import daemon_pid

    assert daemon_pid(mountpoint) is None  # no daemon left behind either
    code, out, _ = run_cli(capsys, "mount", "--help")
    assert code == 0 and "cossd://HOST" in out
    # A verb that takes a mountpoint or a server's URL says both (it said MOUNTPOINT alone).
    for verb in ("top", "create-ns", "snapshot"):
        code, out, _ = run_cli(capsys, verb, "--help")
        assert code == 0 and "MOUNTPOINT|cossd://HOST:PORT" in out, (verb, out)


def test_mutual_tls_with_credentials_from_the_environment(serve: Callable[..., Served], token_file: Path,
                                                          tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--ca turns TLS on; the token and the client certificate come from COSSD_TOKEN_FILE and
    COSSD_CLIENT_CERT/KEY, which the mount's daemon takes as every client does."""
    (tmp_path / "pki").mkdir()
    pki = _certificates(tmp_path / "pki")
    served = serve("--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
                   "--client-ca", str(pki["ca.pem"]), name="tls")
    monkeypatch.setenv("COSSD_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("COSSD_CLIENT_CERT", str(pki["client.pem"]))
    monkeypatch.setenv("COSSD_CLIENT_KEY", str(pki["client.key"]))
    mountpoint = tmp_path / "tls-mnt"
    mountpoint.mkdir()
    options = ["--timeout", TIMEOUT_S, "--log-file", tmp_path / "tls.log", "-o", "json"]
    code, out, err = run_cli(capsys, "mount", served.url, mountpoint, *options)  # no --ca: plain TCP
    assert code == 1 and "refused the handshake" in err and not is_mounted(mountpoint), err
    code, out, err = run_cli(capsys, "mount", served.url, mountpoint, "--ca", pki["ca.pem"], *options)
    assert code == 0, err
    pid = json.loads(out)["pid"]
    try:
        code, out, err = run_cli(capsys, "create-ns", mountpoint, "t", "--tensor", "x:100")
        assert code == 0, err
        assert (mountpoint / "ns/t/step").read_text() == "0\n"
        assert os.listdir(mountpoint / "ns") == ["t"]
        code, out, err = run_cli(capsys, "umount", mountpoint)
        assert code == 0, err
    finally:
        if is_mounted(mountpoint):
            force_unmount(mountpoint)
        wait_for_exit(pid, 15)


def test_a_killed_server_gives_errors_not_a_hang_then_a_restarted_one_is_served(
        served: Served, remote_mount: RemoteMount, capsys: pytest.CaptureFixture[str]) -> None:
    from cossd.trainer import DeviceLostError
    from cossd.trainer.namespace.files import NamespaceFiles

    far = remote_mount.mountpoint
    files = NamespaceFiles(far, "k", timeout_s=TIMEOUT_S)
    files.create({"name": "k", "tensors": [["x", 100]]})
    grad = os.open(far / "ns/k/tensors/x/grad", os.O_WRONLY)
    try:
        served.kill()
        started = time.monotonic()
        with pytest.raises(DeviceLostError):  # the optimizer's view: ENOTCONN is a lost device
            files.statistics()
        assert _errno(lambda: (far / "ns/k/step").read_text()) == errno.ENOTCONN
        assert _errno(lambda: os.listdir(far / "ns")) == errno.ENOTCONN
        assert _errno(lambda: os.pwrite(grad, b"\0" * 200, 0)) == errno.ENOTCONN
        code, out, err = run_cli(capsys, "id-ctrl", far)
        assert code == 1 and "not connected" in err
        assert time.monotonic() - started < TIMEOUT_S
        assert "unreachable" in remote_mount.log_text()
        # The same server back on its port: the mount reconnects; a file opened before is lost.
        served.restart()
        assert (far / "ns/k/step").read_text() == "0\n"
        assert _errno(lambda: os.pwrite(grad, b"\0" * 200, 0)) == errno.ENOTCONN
        assert "reconnected" in remote_mount.log_text()
    finally:
        os.close(grad)
        files.close()


def test_a_stopped_server_is_a_timeout(served: Served, remote_mount: RemoteMount) -> None:
    os.kill(served.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert _errno(lambda: (remote_mount.mountpoint / "ns").stat()) == errno.ETIMEDOUT
        assert time.monotonic() - started < TIMEOUT_S + 10  # its bound, not a hang (slack for a loaded machine)
    finally:
        os.kill(served.pid, signal.SIGCONT)


def test_umount_detaches_and_the_daemon_exits(remote_mount: RemoteMount, capsys: pytest.CaptureFixture[str]) -> None:
    far = remote_mount.mountpoint
    assert (far / "ns").is_dir()
    mountinfo = Path("/proc/self/mountinfo").read_text()
    assert any(f" {far} " in line and "fuse.cossd-remote cossd://127.0.0.1:" in line for line in mountinfo.splitlines())
    code, out, err = run_cli(capsys, "umount", far)
    assert code == 0, err
    assert not is_mounted(far)
    wait_for_exit(remote_mount.pid, 10)
