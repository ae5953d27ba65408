"""Mount tier: the step transport is chosen once per namespace (files, CMB, Execute Program) and each moves the same bytes."""
from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from conftest import Mount
from cossd.client.step_transport import CmbTransport, FileTransport, ProgramTransport
from cossd.trainer.namespace.files import DeviceLostError, NamespaceFiles
from helpers import create_namespace

TENSORS = [("odd", 300_007), ("big", 60_000)]


@pytest.mark.mount
@pytest.mark.parametrize("use_cmb, command_set, kind", [(False, "vendor", FileTransport), (True, "vendor", CmbTransport),
                                                        (True, "cp", ProgramTransport)])
def test_the_transport_is_chosen_once_and_moves_the_same_bytes(mount: Mount, use_cmb: bool, command_set: str,
                                                               kind: type) -> None:
    """Ranges written and read back (a piece at an offset, whole masters) come back bit for bit
    whichever transport the choice made; the object chosen first is the one every call uses."""
    create_namespace(mount.mountpoint, "m", TENSORS)
    files = NamespaceFiles(mount.mountpoint, "m", use_cmb=use_cmb, command_set=command_set)
    try:
        assert files.exists()
        chosen = files.step_transport()
        assert type(chosen) is kind and files.step_transport() is chosen
        assert (files.cmb() is not None) == chosen.reaches_device_memory == use_cmb
        rng = np.random.default_rng(5)
        masters = {name: torch.from_numpy(rng.standard_normal(numel, dtype=np.float32)) for name, numel in TENSORS}
        files.write_many([(name, "master", values) for name, values in masters.items()])
        piece = torch.full((1000,), 7.5)
        files.write_pieces([("odd", 5_000, piece)], role="master")
        masters["odd"][5_000:6_000] = piece
        outs = {name: torch.empty(numel, dtype=torch.float32) for name, numel in TENSORS}
        files.read_many_into([(name, "master", out) for name, out in outs.items()])
        assert all(torch.equal(outs[name], masters[name]) for name, _ in TENSORS)
        tail = torch.empty(7, dtype=torch.float32)
        files.read_pieces_into([("odd", "master", 300_000, tail)])
        assert torch.equal(tail, masters["odd"][300_000:])
        assert files.step_transport() is chosen
    finally:
        files.close()


@pytest.mark.mount
def test_reading_past_a_files_end_is_eio_naming_the_file(mount: Mount) -> None:
    create_namespace(mount.mountpoint, "m", TENSORS)
    files = NamespaceFiles(mount.mountpoint, "m", use_cmb=False)
    try:
        assert files.exists()
        with pytest.raises(OSError, match=r"big/master: file ended at byte 240000") as caught:
            files.read_into("big", "master", torch.empty(60_001, dtype=torch.float32))
        assert caught.value.errno == errno.EIO
    finally:
        files.close()


@pytest.mark.mount
@pytest.mark.parametrize("use_cmb", [False, True])
def test_a_killed_daemon_is_device_lost_on_every_transport(mount: Mount, use_cmb: bool) -> None:
    """kill -9 of the daemon: a write through either transport, and a command, are DeviceLostError."""
    create_namespace(mount.mountpoint, "m", TENSORS)
    files = NamespaceFiles(mount.mountpoint, "m", use_cmb=use_cmb)
    try:
        assert files.exists() and files.step_transport().reaches_device_memory == use_cmb
        values = torch.zeros(60_000, dtype=torch.float32)
        files.write_many([("big", "master", values)])
        os.kill(mount.pid, 9)
        with pytest.raises(DeviceLostError, match="stopped answering"):
            files.write_many([("big", "master", values)])
        with pytest.raises(DeviceLostError, match="remount"):
            files.statistics()
    finally:
        files.close()
