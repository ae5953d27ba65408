"""`cossd bench`'s checkpoint and restore rows: cossd's commit and params-only restore beside torch.save and DCP."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ...client import AdminClient
from ...fs import daemon

from . import trainer as bench_trainer
from .device import BenchDevice, filesystem_of
from ..checkpointing import drop_from_page_cache, files_under
from ..measure import say
from ..nvm_volume import NvmVolume


CHECKPOINT_NAMESPACE = "bench-checkpoints"  # the plain NVM namespace torch.save and DCP write to


def checkpoint_volume(device: BenchDevice, workdir: Path, *, create: bool,
                      name: str = CHECKPOINT_NAMESPACE) -> NvmVolume:
    """ext4 on a plain NVM namespace of the bench's own device: the peers' checkpoints go
    through the same drive and its counters, as cossd's do. The checkpoint section's is kept
    between checkpoint and restore; any other is deleted when it closes."""
    size = -(-(32 * device.n + (128 << 20)) // (1 << 20)) * (1 << 20)  # two 14 B/element checkpoints
    return NvmVolume(device.mountpoint, name, size, workdir / f"ext4-{name}",
                     keep_namespace=name == CHECKPOINT_NAMESPACE, create=create)


@contextlib.contextmanager
def trainer_checkpoint_target(device: BenchDevice, workdir: Path) -> Iterator[NvmVolume | bench_trainer.LocalCheckpointDir]:
    """The trainer section's checkpoint volume; where this machine cannot make one (no loop
    devices, no mkfs.ext4: a container), a plain directory beside the backing, said so."""
    try:
        volume = checkpoint_volume(device, workdir, create=True,
                                   name=bench_trainer.TRAINER_NAMESPACE + "-checkpoints").open()
    except (RuntimeError, OSError) as exc:
        reason: str | None = f"no ext4 on the device here: {exc}"
    else:
        reason = None
    if reason is not None:
        say(f"  trainer checkpoints go to a plain directory on {filesystem_of(workdir)} ({reason})")
        yield bench_trainer.LocalCheckpointDir(workdir / "trainer-checkpoints", reason)
        return
    try:
        yield volume
    finally:
        volume.close()


def checkpoint_costs(device: BenchDevice, volume: NvmVolume, n: int) -> dict[str, dict[str, float]]:
    """Seconds to make one step's state durable, and the bytes the drive took for it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    results: dict[str, dict[str, float]] = {}
    with AdminClient(device.mountpoint) as admin:
        nsid = admin.nsid("bench")
        before = admin.statistics(nsid)
        # An explicit step: what the trainer waits for is begin (which waits until the last
        # step is durable) and commit (one superblock write); the device's fsync of the new
        # copy runs in the background and is timed by the device itself.
        began = time.perf_counter()
        admin.begin_step(nsid)
        stall = time.perf_counter() - began
        fd = os.open(device.tensor / "grad", os.O_WRONLY)
        try:
            os.pwrite(fd, np.zeros(n, np.float16).tobytes(), 0)
        finally:
            os.close(fd)
        committing = time.perf_counter()
        admin.commit_step(nsid)
        stall += time.perf_counter() - committing
        admin.flush(nsid)
        after = admin.statistics(nsid)
        flushes = max(1, after["flushes"] - before["flushes"])
        results["cossd commit (device flushes in background)"] = {
            "seconds": stall,
            "device_flush_seconds": (after["flush_ns"] - before["flush_ns"]) / 1e9 / flushes,
            "bytes_over_link": 0,
            "device_media_bytes": after["state_bytes_per_copy"],
        }
    state = {"master": torch.randn(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
             "param": torch.zeros(n, dtype=torch.float16)}
    path = volume.path / "ckpt.pt"
    before = volume.settle()
    started = time.perf_counter()
    with open(path, "wb") as stream:
        torch.save(state, stream)
        stream.flush()
        os.fsync(stream.fileno())
    seconds = time.perf_counter() - started
    results["torch.save + fsync"] = {"seconds": seconds, "file_bytes": path.stat().st_size,
                                     "bytes_over_link": volume.settle()["bytes_written"] - before["bytes_written"]}
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    before = volume.settle()
    started = time.perf_counter()
    saving = dcp.async_save(state, checkpoint_id=str(volume.path / "dcp"))
    blocking = time.perf_counter() - started
    # Without an async stager async_save answers the upload's Future; its AsyncSaveResponse
    # (zero-overhead staging) carries that Future as upload_completion.
    (saving.upload_completion if isinstance(saving, AsyncSaveResponse) else saving).result()
    seconds = time.perf_counter() - started
    results["DCP async_save"] = {"seconds": seconds, "blocking_seconds": blocking,
                                 "file_bytes": sum(p.stat().st_size for p in files_under(volume.path / "dcp")),
                                 "bytes_over_link": volume.settle()["bytes_written"] - before["bytes_written"]}
    return results


def restore_costs(device: BenchDevice, workdir: Path, n: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    device.stop()
    drop_from_page_cache(files_under(device.backing / "ns"))
    started = time.perf_counter()
    device.pid = daemon.start_background(device.backing, device.mountpoint)
    mounted = time.perf_counter()
    params = bytearray(2 * n)
    with open(device.tensor / "param", "rb", buffering=0) as stream:
        view, offset = memoryview(params), 0
        while offset < len(params):
            offset += stream.readinto(view[offset:])
    done = time.perf_counter()
    results["cossd params only"] = {"seconds": done - started, "mount_seconds": mounted - started,
                                    "read_seconds": done - mounted, "bytes": 2 * n}
    # The filesystem is mounted afresh on the restarted device: nothing of the file is cached.
    with checkpoint_volume(device, workdir, create=False) as volume:
        before = volume.statistics()
        started = time.perf_counter()
        torch.load(volume.path / "ckpt.pt", weights_only=True)
        seconds = time.perf_counter() - started
        results["torch.load full state"] = {
            "seconds": seconds, "bytes": volume.statistics()["bytes_read"] - before["bytes_read"]}
    return results
