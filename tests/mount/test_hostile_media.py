"""Hostile backing directory (issue 20): links planted before mount, state copies cut short while mounted, a second daemon or a format of a device in use, and file descriptors for many namespaces."""
from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device, DeviceError, NamespaceSpec, TensorSpec
from cossd.client import AdminClient
from helpers import create_namespace, pread_all, tensor_dir

pytestmark = pytest.mark.mount

NUMEL = 1000
CLI = [sys.executable, "-m", "cossd.tools.cli"]


def grad(step: int) -> bytes:
    return (np.random.default_rng(step).standard_normal(NUMEL) * 0.01).astype(np.float16).tobytes()


def write_grad(mountpoint: Path, step: int, name: str = "net") -> None:
    """One implicit step: the whole gradient of the namespace's only tensor."""
    fd = os.open(tensor_dir(mountpoint, name, "w") / "grad", os.O_WRONLY)
    try:
        assert os.pwrite(fd, grad(step), 0) == 2 * NUMEL
    finally:
        os.close(fd)


def namespace_state(mountpoint: Path, name: str = "net") -> dict:
    with AdminClient(mountpoint) as client:
        return next(n for n in client.describe()["namespaces"] if n["name"] == name)


def mount_cli(backing: Path, mountpoint: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    mountpoint.mkdir(exist_ok=True)
    return subprocess.run([*CLI, "mount", str(backing), str(mountpoint)], capture_output=True, text=True,
                          timeout=120, **kwargs)


def unmount_cli(mountpoint: Path) -> None:
    subprocess.run([*CLI, "umount", str(mountpoint)], capture_output=True, text=True, timeout=120, check=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our child, dead, not reaped) is not alive.
    return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"


@pytest.fixture
def device_with_snapshot(backing: Path) -> Path:
    """A device with namespace "net" at step 2 (copy A committed, B holds step 1) and a
    snapshot "t1"; closed."""
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec("net", (TensorSpec("w", NUMEL),)))
        for step in (1, 2):
            ns.write_grad("w", 0, grad(step))
        ns.snapshots.create("t1", device.reserve)
    return backing


# ---------------------------------------------------------------------- links planted before mount


def _plant(backing: Path, victim: Path, case: str) -> Path:
    """Replace what the device writes or deletes with a link to `victim`; returns the link."""
    ns = backing / "ns" / "net"
    if case in ("exports", "exports/net", "snapshots"):
        victim.mkdir()
        (victim / ".precious").write_text("keep me")
        (victim / ".precious-dir").mkdir()
        (backing / "exports").mkdir(exist_ok=True)
        link = {"exports": backing / "exports", "exports/net": backing / "exports" / "net",
                "snapshots": ns / "snapshots"}[case]
        if link.exists():
            os.rename(link, backing / f"moved-{case}")
    else:
        link = {"sb.0": ns / "sb.0", "sb.1": ns / "sb.1", "state.A": ns / "state.A",
                "daemon.log": backing / "daemon.log"}[case]
        if link.exists():
            # Same bytes and size as the real file: only the link gives it away.
            os.rename(link, victim)
        else:
            victim.write_bytes(b"keep me\n")
    os.symlink(victim, link)
    return link


def _fingerprint(victim: Path) -> dict[str, tuple[int, int, bytes]]:
    paths = [victim, *sorted(victim.rglob("*"))] if victim.is_dir() else [victim]
    return {str(p): (p.stat().st_mtime_ns, p.stat().st_size, p.read_bytes() if p.is_file() else b"")
            for p in paths}


@pytest.mark.parametrize("case", ["exports", "exports/net", "snapshots", "sb.0", "sb.1", "state.A", "daemon.log"])
def test_link_in_backing_is_refused_at_mount(device_with_snapshot: Path, tmp_path: Path, case: str) -> None:
    backing = device_with_snapshot
    victim = tmp_path / "victim"
    link = _plant(backing, victim, case)
    before = _fingerprint(victim)
    mountpoint = tmp_path / "mnt"
    result = mount_cli(backing, mountpoint)
    try:
        assert result.returncode != 0, result.stdout
        assert not is_mounted(mountpoint)
        message = result.stderr  # `cossd mount` refuses before it starts a daemon
        assert str(link) in message and "symbolic link" in message, message
        assert _fingerprint(victim) == before  # nothing outside the backing directory touched
    finally:
        if is_mounted(mountpoint):
            unmount_cli(mountpoint)


@pytest.mark.parametrize("case", ["exports", "exports/net", "snapshots", "sb.0", "state.A"])
def test_device_open_refuses_a_link_under_its_lock(device_with_snapshot: Path, tmp_path: Path,
                                                   case: str) -> None:
    """The daemon's own check (the CLI's comes first): Device.open refuses, touching nothing."""
    victim = tmp_path / "victim"
    link = _plant(device_with_snapshot, victim, case)
    before = _fingerprint(victim)
    with pytest.raises(DeviceError, match="symbolic link") as raised:
        Device.open(device_with_snapshot)
    assert str(link) in raised.value.message
    assert _fingerprint(victim) == before


def test_fifo_in_backing_is_refused_at_mount(device_with_snapshot: Path, tmp_path: Path) -> None:
    sb1 = device_with_snapshot / "ns" / "net" / "sb.1"
    sb1.unlink()
    os.mkfifo(sb1)
    mountpoint = tmp_path / "mnt"
    result = mount_cli(device_with_snapshot, mountpoint)
    try:
        assert result.returncode != 0
        assert f"{sb1} is a fifo" in result.stderr, result.stderr
    finally:
        if is_mounted(mountpoint):
            unmount_cli(mountpoint)


# ---------------------------------------------------------------------- state copies cut short


@pytest.fixture
def trained(mount: Mount) -> Mount:
    """Namespace "net" at step 2 on a mounted device: copy A holds step 2, B step 1."""
    create_namespace(mount.mountpoint, "net", [("w", NUMEL)])
    for step in (1, 2):
        write_grad(mount.mountpoint, step)
    assert namespace_state(mount.mountpoint)["committed_step"] == 2
    return mount


def _step_refused(mount: Mount, step: int) -> None:
    with pytest.raises(OSError) as raised:
        write_grad(mount.mountpoint, step)
    assert raised.value.errno == errno.EIO
    assert alive(mount.pid)


def test_truncated_committed_copy_while_mounted(trained: Mount) -> None:
    mount = trained
    state_a = mount.backing / "ns" / "net" / "state.A"
    size = state_a.stat().st_size
    os.truncate(state_a, 0)
    _step_refused(mount, 3)
    _step_refused(mount, 3)  # still refused: the namespace is isolated
    with AdminClient(mount.mountpoint) as client:
        assert client.smart_log()["media_errors"] >= 1
        assert any(entry["nsid"] == client.nsid("net") for entry in client.error_log())
    assert "state.A has 0 bytes" in (mount.backing / "daemon.log").read_text()
    mount.unmount()
    mount.restart()
    # The newest step was in the damaged copy: recovery serves step 1 from the intact B,
    # and A is the new shadow, at full size again.
    assert namespace_state(mount.mountpoint)["committed_step"] == 1
    assert state_a.stat().st_size == size
    write_grad(mount.mountpoint, 2)
    assert namespace_state(mount.mountpoint)["committed_step"] == 2
    with AdminClient(mount.mountpoint) as client:
        assert client.smart_log()["media_errors"] >= 2  # the run's error, and recovery's


def test_truncated_shadow_is_caught_at_the_next_step(trained: Mount) -> None:
    mount = trained
    state_b = mount.backing / "ns" / "net" / "state.B"
    params = pread_all(tensor_dir(mount.mountpoint, "net", "w") / "param")
    os.truncate(state_b, 4096)
    _step_refused(mount, 3)
    assert "state.B has 4096 bytes" in (mount.backing / "daemon.log").read_text()
    mount.unmount()
    mount.restart()
    # The committed copy was whole: the same step 2, bit for bit, and steps go on.
    assert namespace_state(mount.mountpoint)["committed_step"] == 2
    assert pread_all(tensor_dir(mount.mountpoint, "net", "w") / "param") == params
    write_grad(mount.mountpoint, 3)
    assert namespace_state(mount.mountpoint)["committed_step"] == 3


GUARD_SCRIPT = textwrap.dedent('''
    import faulthandler, os, sys
    faulthandler.enable()  # as pytest has it: the guard must chain to it, not lose to it
    import numpy as np
    from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
    backing, mode = sys.argv[1], sys.argv[2]
    Device.format(backing, capacity_bytes=1 << 30)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec("net", (TensorSpec("w", 300_000),)))
        grad = np.full(300_000, 0.01, dtype=np.float16).tobytes()
        for _ in range(2):
            ns.write_grad("w", 0, grad)
        committed = f"{backing}/ns/net/state.{'A' if ns.committed_step % 2 == 0 else 'B'}"
        shadow = f"{backing}/ns/net/state.{'B' if ns.committed_step % 2 == 0 else 'A'}"
        if mode == "shadow":
            ns.begin_step()
            os.truncate(shadow, 4096)  # the kernels store the new state into the cut pages
            ns.write_grad("w", 0, grad)
        elif mode == "read":
            os.truncate(committed, 4096)
            ns.scrub()  # every block read through the mapping: faults past 4 KiB
        else:
            ns.begin_step()
            os.truncate(committed, 4096)  # under an open step: its kernels read the cut pages
            ns.write_grad("w", 0, grad)
        try:
            ns.begin_step() if mode == "read" else ns.commit_step()
        except DeviceError as exc:
            assert exc.status == Status.UNRECOVERED_READ_ERROR, exc
            print("refused:", exc.message)
        else:
            raise SystemExit("a step on a copy cut short was accepted")
        assert device.smart()["media_errors"] >= 1
''')


@pytest.mark.parametrize("mode", ["read", "step", "shadow"])
def test_bus_error_in_a_mapping_is_contained(tmp_path: Path, mode: str) -> None:
    """A copy cut short after the step's checks: the reads through its mapping (scrub, the
    kernels) or the kernels' stores into it (the shadow, written through the mapping) fault
    into the guard, the process lives, and no step commits on what the faults left."""
    environment = os.environ | ({"COSSD_STATE_WRITES": "mapped"} if mode == "shadow" else {})
    result = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, str(tmp_path / "dev"), mode],
                            capture_output=True, text=True, timeout=120, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "faulted" in result.stdout, result.stdout


# ---------------------------------------------------------------------- one daemon per device


def test_second_mount_refused_after_lock_file_deleted(mount: Mount, tmp_path: Path) -> None:
    (mount.backing / "lock").unlink(missing_ok=True)
    second = tmp_path / "second"
    result = mount_cli(mount.backing, second)
    try:
        assert result.returncode != 0
        assert "already mounted at" in result.stderr, result.stderr
        assert not is_mounted(second)
    finally:
        if is_mounted(second):
            force_unmount(second)


def test_format_force_of_mounted_device_refused(mount: Mount) -> None:
    create_namespace(mount.mountpoint, "net", [("w", NUMEL)])
    write_grad(mount.mountpoint, 1)
    result = subprocess.run([*CLI, "format", "--force", str(mount.backing)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "mounted" in result.stderr and "in use" in result.stderr, result.stderr
    write_grad(mount.mountpoint, 2)
    mount.unmount()
    mount.restart()
    assert namespace_state(mount.mountpoint)["committed_step"] == 2


# ---------------------------------------------------------------------- file descriptors

NAMESPACES = 300
FD_LIMIT = 1024


def _limit_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_many_namespaces_under_1024_descriptors(backing: Path, tmp_path: Path, figures: list[str]) -> None:
    """300 namespaces created and remounted by a daemon whose soft and hard limits are 1,024."""
    mountpoint = tmp_path / "mnt"
    description = {"tensors": [["w", 1]], "hyperparameters": {"lr": 1e-3}}
    pid = None
    try:
        result = mount_cli(backing, mountpoint, preexec_fn=_limit_descriptors)
        assert result.returncode == 0, result.stderr
        with AdminClient(mountpoint) as client:
            pid = client.describe()["pid"]
            empty = _open_fds(pid)
            for index in range(NAMESPACES):
                client.create_namespace(description | {"name": f"n{index}"})
            per_namespace = (_open_fds(pid) - empty) / NAMESPACES
        unmount_cli(mountpoint)
        wait_for_exit(pid)
        result = mount_cli(backing, mountpoint, preexec_fn=_limit_descriptors)
        assert result.returncode == 0, result.stderr
        with AdminClient(mountpoint) as client:
            described = client.describe()
            pid = described["pid"]
            assert len(described["namespaces"]) == NAMESPACES and not described["failed_namespaces"]
            assert int(Path(f"/proc/{pid}/limits").read_text().split("Max open files")[1].split()[0]) == FD_LIMIT
        assert per_namespace <= 2
        figures.append(f"descriptors per namespace: {per_namespace:.2f} ({NAMESPACES} namespaces, "
                       f"{_open_fds(pid)} open in the daemon)")
    finally:
        if is_mounted(mountpoint):
            subprocess.run([*CLI, "umount", str(mountpoint)], capture_output=True, timeout=120)
        if pid is not None:
            wait_for_exit(pid)


FD_EXHAUSTION_SCRIPT = textwrap.dedent('''
    import os, resource, sys
    from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
    Device.format(sys.argv[1], capacity_bytes=1 << 30)
    with Device.open(sys.argv[1]) as device:
        in_use = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        try:
            for index in range(100):
                device.create_namespace(NamespaceSpec(f"n{index}", (TensorSpec("w", 1),)))
        except DeviceError as exc:
            assert exc.status == Status.LIMIT_EXCEEDED, exc
            assert sorted(device.namespaces) == sorted(f"n{i}" for i in range(index)), index
            print("refused:", exc.message)
''')


def test_running_out_of_descriptors_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", FD_EXHAUSTION_SCRIPT, str(tmp_path / "dev")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: out of file descriptors" in result.stdout and "ulimit -n" in result.stdout, result.stdout


# ---------------------------------------------------------------------- the controller memory buffer


def test_a_client_cannot_resize_the_cmb(mount: Mount) -> None:
    """A client opens the CMB read-write, as the trainer does, and tries to cut it short (a
    SIGBUS in the daemon at its next CMB access) or grow it: refused, and the daemon still
    steps through the CMB."""
    mp = mount.mountpoint
    create_namespace(mp, "net", [("w", NUMEL)])
    with AdminClient(mp) as client:
        cmb = client.cmb()
        assert cmb is not None
        fd = os.open(cmb.path, os.O_RDWR)
        try:
            for length in (0, cmb.size // 2, cmb.size + 4096):
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, length)
            assert os.fstat(fd).st_size == cmb.size
        finally:
            os.close(fd)
        cmb.array[:2 * NUMEL] = np.frombuffer(grad(1), dtype=np.uint8)
        report = client.cmb_write(client.nsid("net"), [{"tensor": "w", "length": 2 * NUMEL, "cmb_offset": 0}])
        assert report["commit"]["committed_step"] == 1
        cmb.close()
    assert alive(mount.pid)
    assert namespace_state(mp)["committed_step"] == 1


# ---------------------------------------------------------------------- the guard and other SIGBUS handlers

CHAIN_SCRIPT = textwrap.dedent('''
    import faulthandler, mmap, os, signal, sys, time
    from cossd.kernels import guard
    mode, directory = sys.argv[1], sys.argv[2]

    def cut_mapping(name):
        """A file of 64 KiB mapped, then cut to nothing: touching the mapping is a SIGBUS."""
        path = os.path.join(directory, name)
        with open(path, "wb") as f:
            f.truncate(1 << 16)
        fd = os.open(path, os.O_RDWR)
        return path, fd

    if mode == "python-handler":
        received = []
        signal.signal(signal.SIGBUS, lambda signum, frame: received.append(signum))
        guard.install()
        path, fd = cut_mapping("guarded")
        mapping = guard.GuardedMapping(fd, 1 << 16)
        os.kill(os.getpid(), signal.SIGBUS)  # not a fault: goes to the handler before the guard
        for _ in range(200):
            if received:
                break
            time.sleep(0.01)
        assert received == [signal.SIGBUS], received
        assert guard.installed(), "the guard uninstalled itself after passing a signal on"
        os.truncate(path, 0)
        assert bytes(mapping.buffer[4096:4100]) == bytes(4) and mapping.faults() == 1
        signal.signal(signal.SIGBUS, signal.SIG_IGN)
        guard.install()
        os.kill(os.getpid(), signal.SIGBUS)  # ignored, as it was before the guard
        assert guard.installed()
        print("contained")
    else:  # a bus error outside every guarded mapping: fatal, as without the guard
        guard.install()
        if mode == "faulthandler":
            faulthandler.enable()  # after the guard: the next map installs the guard again
            guard.install()
        path, fd = cut_mapping("foreign")
        foreign = mmap.mmap(fd, 1 << 16)
        os.truncate(path, 0)
        foreign[8192]
        print("survived a bus error")
''')


@pytest.mark.parametrize("mode", ["python-handler", "default", "faulthandler"])
def test_guard_chains_to_the_previous_sigbus_handler(tmp_path: Path, mode: str) -> None:
    """Signals and faults the guard does not own reach the handler it replaced, and the guard
    stays installed: a signal sent to the process goes to a Python handler and a guarded fault
    after it is still contained; a foreign fault kills the process with SIGBUS (after
    faulthandler's traceback, when faulthandler was enabled), never loops or hangs."""
    try:
        result = subprocess.run([sys.executable, "-c", CHAIN_SCRIPT, mode, str(tmp_path)],
                                capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung: {str(exc.stderr)[-1000:]}")
    if mode == "python-handler":
        assert result.returncode == 0 and "contained" in result.stdout, result.stderr[-3000:]
    else:
        assert result.returncode == -signal.SIGBUS, (result.returncode, result.stderr[-3000:])
        assert "survived" not in result.stdout
        if mode == "faulthandler":
            assert result.stderr.count("Fatal Python error: Bus error") == 1, result.stderr[-3000:]


GUARD_SLOTS_SCRIPT = textwrap.dedent('''
    import os, sys
    from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
    from cossd.kernels import guard
    backing = sys.argv[1]
    Device.format(backing, capacity_bytes=1 << 30)
    with open(f"{backing}.page", "wb") as f:
        f.truncate(4096)
    fd = os.open(f"{backing}.page", os.O_RDWR)
    with Device.open(backing) as device:
        # Every slot but one taken: the new namespace's copy A is mapped, copy B is refused.
        held = [guard.GuardedMapping(fd, 4096) for _ in range(guard.SLOTS - 1)]
        try:
            device.create_namespace(NamespaceSpec("net", (TensorSpec("w", 1000),)))
        except DeviceError as exc:
            assert exc.status == Status.LIMIT_EXCEEDED, exc
            assert not device.namespaces, device.namespaces
            print("refused:", exc.message)
        else:
            raise SystemExit("a namespace was created with no guard slot for its state")
        del held
        device.create_namespace(NamespaceSpec("net", (TensorSpec("w", 1000),)))
        print("created after release")
''')


def test_guard_slots_full_is_a_limit_not_a_full_disk(tmp_path: Path) -> None:
    """Every guarded mapping of the process in use: a new namespace is refused with
    LIMIT_EXCEEDED and a message saying which limit (not CAPACITY_EXCEEDED, "backing store
    full"), nothing is left of it, and it is created once mappings are released."""
    result = subprocess.run([sys.executable, "-c", GUARD_SLOTS_SCRIPT, str(tmp_path / "dev")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "guarded" in result.stdout, result.stdout
    assert "backing store full" not in result.stdout, result.stdout
    assert "created after release" in result.stdout, result.stdout


# ---------------------------------------------------------------------- tools/gpu_bundle.sh's folder


@pytest.mark.parametrize("contents", ["foreign", "bundle", "failed build"])
def test_gpu_bundle_never_wipes_a_folder_not_its_own(tmp_path: Path, contents: str) -> None:
    """The bundle script empties its folder before building: a non-empty folder holding no
    bundle of its own (no manifest.json, or other files than a failed build leaves) is refused
    and left as it was. PY points nowhere, so an accepted folder stops at the next check,
    before anything is removed."""
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    names = {"foreign": ["precious.txt", "wheels"], "bundle": ["manifest.json", "wheels"],
             "failed build": ["build.log", "wheels"]}[contents]
    for name in names:
        (bundle / name).write_text("keep")
    script = Path(__file__).resolve().parents[2] / "tools" / "gpu_bundle.sh"
    result = subprocess.run(["bash", str(script), str(bundle)], capture_output=True, text=True, timeout=60,
                            env=os.environ | {"PY": str(tmp_path / "no-python")})
    assert result.returncode != 0
    if contents == "foreign":
        assert "is not empty and holds no bundle" in result.stderr and "precious.txt" in result.stderr, result.stderr
    else:
        assert "no Python at" in result.stderr, result.stderr
    assert sorted(p.name for p in bundle.iterdir()) == sorted(names)
