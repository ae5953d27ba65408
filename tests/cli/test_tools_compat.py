"""Tier 24: ordinary tools against a mount: rsync sees each step (mtimes), umount only ever
detaches cossd, fio writes gradients through O_RDWR opens, and the CLI's small courtesies."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, is_mounted
from helpers import create_namespace, pread_all, pwrite_all, tensor_dir

pytestmark = pytest.mark.mount

NUMEL = 4096
CLI = [sys.executable, "-m", "cossd.tools.cli"]


def _cli(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, check=check, timeout=120)


def _step(mount: Mount, name: str, seed: int) -> None:
    grad = np.random.default_rng(seed).standard_normal(NUMEL).astype(np.float16).tobytes()
    pwrite_all(tensor_dir(mount.mountpoint, name, "w") / "grad", grad)


def _rsync(source: Path, dest: Path) -> list[str]:
    """rsync -a SOURCE/ DEST/, returning the files it transferred."""
    result = subprocess.run(["rsync", "-a", "--exclude=grad", "--out-format=%n", f"{source}/", f"{dest}/"],
                            capture_output=True, text=True, check=True, timeout=120)
    return [line for line in result.stdout.splitlines() if line and not line.endswith("/")]


@pytest.mark.skipif(shutil.which("rsync") is None, reason="rsync is not installed (make system-deps)")
def test_rsync_twice_across_a_commit_copies_the_changed_files(mount: Mount, tmp_path: Path) -> None:
    create_namespace(mount.mountpoint, "run", [("w", NUMEL)])
    _step(mount, "run", 1)
    tensors = tensor_dir(mount.mountpoint, "run", "w")
    backup = tmp_path / "backup"
    first = _rsync(tensors, backup)
    assert {"param", "master", "exp_avg", "exp_avg_sq"} <= set(first)
    # Nothing changed: nothing to copy (the times are stable between commits).
    assert _rsync(tensors, backup) == []
    # rsync's quick check compares whole seconds (--modify-window 0): step in a later second.
    time.sleep(1.1)
    before = os.stat(tensors / "master").st_mtime_ns
    _step(mount, "run", 2)
    after = os.stat(tensors / "master").st_mtime_ns
    assert after > before
    assert os.stat(mount.mountpoint / "ns" / "run" / "step").st_mtime_ns == after
    second = _rsync(tensors, backup)
    assert {"param", "master", "exp_avg", "exp_avg_sq"} <= set(second)
    assert (backup / "master").read_bytes() == pread_all(tensors / "master")


def test_times_follow_the_state_and_survive_a_remount(mount: Mount, tmp_path: Path) -> None:
    create_namespace(mount.mountpoint, "run", [("w", NUMEL)])
    master = tensor_dir(mount.mountpoint, "run", "w") / "master"
    loaded_before = os.stat(master).st_mtime_ns
    time.sleep(0.02)
    pwrite_all(master, np.ones(NUMEL, dtype=np.float32).tobytes())  # an initial-state write
    loaded = os.stat(master).st_mtime_ns
    assert loaded > loaded_before
    reference = tmp_path / "reference"
    reference.touch()
    time.sleep(0.02)
    _step(mount, "run", 1)
    committed = os.stat(master).st_mtime_ns
    assert committed > loaded
    # find -newer sees the commit.
    found = subprocess.run(["find", str(tensor_dir(mount.mountpoint, "run", "w")), "-newer", str(reference)],
                           capture_output=True, text=True, check=True).stdout.split()
    assert str(master) in found
    # Reading changes nothing, and the times are those of the commit, not of the reads.
    pread_all(master)
    assert os.stat(master).st_mtime_ns == committed
    # Setting a time by hand would make a stale file look current: refused.
    with pytest.raises(PermissionError):
        os.utime(master, ns=(0, 0))
    mount.unmount()
    mount.restart()
    remounted = os.stat(master).st_mtime_ns
    # After a restart the media's own times stand in: those of the writes of the last change
    # (the kernel stamps files from its coarse clock, a tick or so before the daemon's own; a
    # loaded machine can also preempt the daemon between the two stamps).
    assert committed - 1_000_000_000 <= remounted <= time.time_ns()


def test_umount_refuses_a_tmpfs_and_says_when_nothing_is_mounted(tmp_path: Path) -> None:
    target = tmp_path / "tmpfs"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)], check=True)
    try:
        result = _cli("umount", str(target))
        assert result.returncode != 0
        assert "not a cossd device" in result.stderr and "tmpfs" in result.stderr
        assert is_mounted(target)
    finally:
        subprocess.run(["umount", str(target)], check=True)
    result = _cli("umount", str(target))
    assert result.returncode != 0
    assert "nothing is mounted at" in result.stderr
    assert "Invalid argument" not in result.stderr


def test_umount_of_a_cossd_mount_still_works(mount: Mount) -> None:
    result = _cli("umount", str(mount.mountpoint))
    assert result.returncode == 0, result.stderr
    assert not is_mounted(mount.mountpoint)


def test_grad_opens_read_write_but_reads_are_refused(mount: Mount) -> None:
    create_namespace(mount.mountpoint, "run", [("w", NUMEL)])
    grad = tensor_dir(mount.mountpoint, "run", "w") / "grad"
    with pytest.raises(PermissionError):
        os.open(grad, os.O_RDONLY)
    fd = os.open(grad, os.O_RDWR)
    try:
        with pytest.raises(OSError) as refused:
            os.pread(fd, 16, 0)
        assert refused.value.errno == errno.EACCES
        data = np.zeros(NUMEL, dtype=np.float16).tobytes()
        assert os.pwrite(fd, data, 0) == len(data)
    finally:
        os.close(fd)
    assert (mount.mountpoint / "ns" / "run" / "step").read_text().strip() == "1"


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not installed (make system-deps)")
def test_fio_writes_a_gradient_file(mount: Mount) -> None:
    create_namespace(mount.mountpoint, "run", [("w", 1 << 20)])
    grad = tensor_dir(mount.mountpoint, "run", "w") / "grad"
    result = subprocess.run(
        ["fio", "--name=grads", f"--filename={grad}", "--rw=write", "--bs=256k", "--size=2M",
         "--ioengine=psync", "--direct=1", "--zero_buffers", "--output-format=json"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["jobs"][0]["write"]["io_bytes"] == 2 << 20
    # Zero gradients (--zero_buffers; fio's default random bytes hold NaNs): one step, committed.
    assert (mount.mountpoint / "ns" / "run" / "step").read_text().strip() == "1"
    stats = json.loads((mount.mountpoint / "ns" / "run" / "stats.json").read_text())
    assert (stats["steps_committed"], stats["steps_skipped"]) == (1, 0)


def test_a_closed_pipe_ends_the_cli_quietly(mount: Mount) -> None:
    for index in range(40):
        subprocess.run([*CLI, "create-ns", str(mount.mountpoint), f"raw{index}", "--nvm", "--size", "4096"],
                       check=True, capture_output=True)
    # `cossd list | head -1`: the reader leaves after one line.
    listing = subprocess.Popen([*CLI, "list", "-o", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert listing.stdout is not None
    listing.stdout.readline()
    listing.stdout.close()
    _, stderr = listing.communicate(timeout=60)
    assert stderr == b"", stderr.decode()
    assert listing.returncode in (0, 141)


def test_every_flag_and_positional_says_what_it_is_and_its_default() -> None:
    import argparse

    from cossd.tools.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for verb, sub in verbs.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(f"{verb} {action.dest}: no help")
            elif (action.option_strings and action.default not in (None, False)
                  and "default" not in action.help):
                missing.append(f"{verb} {action.dest}: its default ({action.default!r}) is not said")
    assert not missing, "\n".join(missing)
    shown = " ".join(_cli("create-ns", "--help", check=True).stdout.split())  # unwrapped
    for flag, default in (("--lr", "0.001"), ("--beta1", "0.9"), ("--beta2", "0.999"),
                          ("--eps", "1e-08"), ("--weight-decay", "0.01")):
        assert flag in shown and f"default: {default}" in shown, flag


def test_each_verb_comes_from_one_family_and_help_lists_them_in_order() -> None:
    """Every verb module registers its verbs one way, register(verb); each verb is one module's,
    the one cli.VERB_FAMILIES names (`cossd VERB` imports it alone), and `cossd --help` and the
    parser's choices list them in cli.HELP_ORDER."""
    import argparse

    from cossd.tools import cli

    owners: dict[str, list[str]] = {}
    for name in cli.FAMILIES:
        class Recorder:
            def __init__(self, owner: str) -> None:
                self.owner = owner

            def wants(self, _verb: str) -> bool:
                return True

            def __call__(self, verb: str, *_handler_and_help: object, **_formats: object) -> argparse.ArgumentParser:
                owners.setdefault(verb, []).append(self.owner)
                return argparse.ArgumentParser()

        cli.family(name).register(Recorder(name))
    assert {name: found for name, found in owners.items() if len(found) != 1} == {}
    assert sorted(owners) == sorted(cli.HELP_ORDER)
    assert {verb: found[0] for verb, found in owners.items()} == cli.VERB_FAMILIES
    verbs = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(verbs.choices) == list(cli.HELP_ORDER)
    listed = _cli("--help", check=True).stdout
    assert [line.split()[0] for line in listed.split("VERB ...", 1)[1].splitlines()
            if line.startswith("    ") and not line.startswith("     ")] == list(cli.HELP_ORDER)


def test_a_verb_parses_with_its_own_parser_as_with_the_whole_command_line() -> None:
    """`cossd VERB ...` builds a parser of that verb alone: the same options and defaults
    as the whole command line's, for every verb."""
    import argparse

    from cossd.tools import cli

    whole = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for verb in cli.HELP_ORDER:
        alone = next(a for a in cli.build_parser(only=verb)._actions if isinstance(a, argparse._SubParsersAction))
        assert list(alone.choices) == [verb]
        assert [(a.option_strings, a.dest, a.default, a.help) for a in alone.choices[verb]._actions] == \
            [(a.option_strings, a.dest, a.default, a.help) for a in whole.choices[verb]._actions], verb


def test_cossd_mount_starts_the_daemon_without_the_daemons_imports() -> None:
    """What `cossd mount BACKING MNT` imports before it starts the daemon process (which
    imports them itself): no numpy, trio, pyfuse3 or torch, which a restart would otherwise
    wait for twice."""
    code = ("import sys\n"
            "from cossd.tools import cli\n"
            "args = cli.build_parser(only='mount').parse_args(['mount', '/nowhere', '/nowhere'])\n"
            "from cossd.fs import launch\n"
            "print(sorted(m for m in ('numpy', 'trio', 'pyfuse3', 'torch', 'cossd.fs.daemon') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_a_second_mount_says_where_the_device_is_mounted(mount: Mount, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    result = _cli("mount", str(mount.backing), str(other))
    assert result.returncode == 1
    assert f"already mounted at {mount.mountpoint.resolve()}" in result.stderr, result.stderr
    assert not is_mounted(other)


def test_export_onto_an_existing_file_names_the_flag(mount: Mount, tmp_path: Path) -> None:
    create_namespace(mount.mountpoint, "run", [("w", NUMEL)])
    _step(mount, "run", 1)
    target = tmp_path / "out.safetensors"
    _cli("export", str(mount.mountpoint), "run", "--path", str(target), "-q", check=True)
    result = _cli("export", str(mount.mountpoint), "run", "--path", str(target), "-q")
    assert result.returncode == 1 and "--force" in result.stderr, result.stderr
    assert _cli("export", str(mount.mountpoint), "run", "--path", str(target), "-q", "--force").returncode == 0
