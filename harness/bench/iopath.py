"""The talk's I/O-path comparison through a storage server: resident AdamW with a torch.save checkpoint each cycle, written into a plain NVM namespace, against the offloaded cossd AdamW, bytes as the device and the wire counted them."""
from __future__ import annotations

import io
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ...client import AdminClient
from ...client.remote import RemoteTransport
from ...client.transport import Transport
from ...protocol.logpages import LogId, decode_server_log

from .interrupt import held
from .net import BenchServer
from ..measure import say
from ..nvm_volume import NvmVolume

LR = 1e-3
TENSORS = 4  # the "model": a few flat tensors, as a network's layers are
CHECKPOINT_NAMESPACE = "ckpt"
OFFLOAD_NAMESPACE = "iopath"


def _wire_bytes(transport: Transport) -> int:
    """Bytes this client put on and took off the wire (PDU headers, digests and data)."""
    if not isinstance(transport, RemoteTransport):  # the I/O path bench serves its device: always remote
        raise TypeError(f"the wire bytes of a {type(transport).__name__}: only a server's transport counts them")
    return transport.writer.bytes_written + transport.reader.bytes_read


def _model(n: int, dtype: torch.dtype, seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [n // TENSORS + (i < n % TENSORS) for i in range(TENSORS)]
    params = [torch.nn.Parameter(torch.randn(size, generator=generator).to(dtype)) for size in sizes]
    for param in params:
        param.grad = (torch.randn(param.numel(), generator=generator) * 0.01).to(dtype)
    return params


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def conventional(server: BenchServer, n: int, cycles: int) -> dict[str, Any]:
    """Resident fused AdamW (FP32 params and moments on the trainer), then each cycle the
    full state torch.save'd and written through the remote client's file API into a plain
    NVM namespace's `data` file, then FLUSH: the block writes (and fsync) ext4 on that
    namespace would issue, without ext4's own metadata and journal (the client cannot mount
    ext4 across the wire without a remote block device)."""
    params = _model(n, torch.float32, 5)
    optimizer = torch.optim.AdamW(params, lr=LR, fused=True)
    optimizer.step()  # the moments exist: the checkpoint has its full size from the first cycle
    probe = io.BytesIO()
    torch.save({"model": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, probe)
    capacity = -(-(probe.getbuffer().nbytes + (1 << 20)) // 4096) * 4096
    with AdminClient(server.url, token_file=server.token_file) as admin:
        nsid = admin.create_namespace({"name": CHECKPOINT_NAMESPACE, "kind": "nvm", "capacity_bytes": capacity})
        transport = admin.transport
        fd = transport.open_file(f"ns/{CHECKPOINT_NAMESPACE}/data", True, False)
        smart, stats, wire = admin.smart_log(), admin.statistics(nsid), _wire_bytes(transport)
        seconds, step_s = [], []
        for _ in range(cycles):
            started = time.perf_counter()
            optimizer.step()
            stepped = time.perf_counter()
            buffer = io.BytesIO()
            torch.save({"model": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, buffer)
            transport.write_many([(fd, buffer.getbuffer(), 0)])
            admin.flush(nsid)  # the fsync
            seconds.append(time.perf_counter() - started)
            step_s.append(stepped - started)
        wire = _wire_bytes(transport) - wire
        smart_after, stats_after = admin.smart_log(), admin.statistics(nsid)
        transport.close_file(fd)
        admin.delete_namespace(nsid)
    return {
        "what": "resident torch AdamW (fused, FP32 params + 2 moments) + torch.save of the full state into "
                "a plain NVM namespace's data file through the remote client, then FLUSH",
        "seconds": statistics.median(seconds), "step_seconds": statistics.median(step_s),
        "checkpoint_bytes": probe.getbuffer().nbytes,
    } | _checkpoint_bytes((stats, stats_after), (smart, smart_after), wire, cycles, n)


def _checkpoint_bytes(stats: tuple[dict[str, int], dict[str, int]], smart: tuple[dict[str, int], dict[str, int]],
                      wire: int, cycles: int, n: int) -> dict[str, Any]:
    """A conventional path's bytes per cycle: the NVM namespace's counts (before, after), SMART's
    data units (before, after) and the wire's total over `cycles`."""
    before, after = stats
    return {
        "device_bytes_written": _delta(after, before, "bytes_written") // cycles,
        "device_bytes_read": _delta(after, before, "bytes_read") // cycles,
        "media_bytes_written": _delta(after, before, "media_bytes_written") // cycles,
        "smart_data_units_written": _delta(smart[1], smart[0], "data_units_written") / cycles,
        "wire_bytes": wire // cycles,
        "state_on_trainer_bytes": 12 * n,
    }


def _server_wire(server: BenchServer) -> int:
    """Bytes the server's link has taken in and sent out, every connection's (log page C5h)."""
    with AdminClient(server.url, token_file=server.token_file) as admin:
        page = decode_server_log(admin.get_log_page(LogId.SERVER))
    return page["link_bytes_in"] + page["link_bytes_out"]


def conventional_ext4(server: BenchServer, n: int, cycles: int, workdir: Path) -> dict[str, Any]:
    """The conventional path as the talk draws it: the trainer node mounts the server
    (`cossd mount cossd://...`, the remote FUSE mount), ext4 sits on a plain NVM namespace of
    it through a loop device, and each cycle the resident AdamW's full state is torch.save'd
    into a file there and fsynced. Needs root (losetup, mount); says so otherwise."""
    if os.geteuid() != 0:
        return {"measured": False, "why": "not measured: ext4 on a loop device needs root"}
    mountpoint, directory = workdir / "iopath-remote-mnt", workdir / "iopath-ext4"
    mountpoint.mkdir(parents=True, exist_ok=True)
    directory.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "cossd.tools.cli"]
    try:
        # Inside the try, held: a signal during the mount takes effect once it is up, and
        # the umount below takes it off (an umount of a mount that failed does nothing).
        with held():
            mounted = subprocess.run([*cli, "mount", server.url, str(mountpoint), "--token-file",
                                      str(server.token_file)], capture_output=True, text=True, timeout=120)
        if mounted.returncode != 0:
            raise RuntimeError(f"the remote mount failed: {(mounted.stderr or mounted.stdout).strip()}")
        params = _model(n, torch.float32, 5)
        optimizer = torch.optim.AdamW(params, lr=LR, fused=True)
        optimizer.step()
        probe = io.BytesIO()
        torch.save({"model": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, probe)
        checkpoint = probe.getbuffer().nbytes
        # Room for a checkpoint, its replacement and ext4's metadata and journal.
        size = -(-(3 * checkpoint + (96 << 20)) // (1 << 20)) * (1 << 20)
        with NvmVolume(mountpoint, CHECKPOINT_NAMESPACE, size, directory) as volume:
            smart, stats, wire = _smart(server), volume.settle(), _server_wire(server)
            seconds = []
            for _ in range(cycles):
                started = time.perf_counter()
                optimizer.step()
                with open(volume.path / "checkpoint.pt", "wb") as stream:
                    torch.save({"model": [p.detach() for p in params], "optimizer": optimizer.state_dict()}, stream)
                    stream.flush()
                    os.fsync(stream.fileno())
                seconds.append(time.perf_counter() - started)
            stats_after = volume.settle()
            wire, smart_after = _server_wire(server) - wire, _smart(server)
    finally:
        subprocess.run([*cli, "umount", str(mountpoint)], capture_output=True, text=True, timeout=120)
    return {
        "measured": True,
        "what": "resident torch AdamW + torch.save of the full state into ext4 on a plain NVM namespace, "
                "through the remote mount (cossd mount cossd://..., a loop device), then fsync",
        "seconds": statistics.median(seconds), "checkpoint_bytes": checkpoint,
        # The wire: every connection of the server's link, the remote mount's and a few of this
        # bench's own commands reading the counters (tens of kB).
    } | _checkpoint_bytes((stats, stats_after), (smart, smart_after), wire, cycles, n)


def _smart(server: BenchServer) -> dict[str, int]:
    with AdminClient(server.url, token_file=server.token_file) as admin:
        return admin.smart_log()


def offloaded(server: BenchServer, n: int, cycles: int) -> dict[str, Any]:
    """cossd.trainer.AdamW with mount=cossd://...: BF16 grads in, the step on the device,
    BF16 params back; every step durable (the commit is the checkpoint)."""
    from ...trainer import AdamW

    params = _model(n, torch.bfloat16, 6)
    optimizer = AdamW(params, mount=server.url, namespace=OFFLOAD_NAMESPACE, lr=LR, token_file=server.token_file)
    try:
        optimizer.step()  # the first step seals the initial state: setup, not a cycle
        with AdminClient(server.url, token_file=server.token_file) as admin:
            nsid = admin.nsid(OFFLOAD_NAMESPACE)
            transport = optimizer.files.transport
            smart, stats, wire = admin.smart_log(), admin.statistics(nsid)["model"], _wire_bytes(transport)
            seconds = []
            for _ in range(cycles):
                started = time.perf_counter()
                optimizer.step()
                seconds.append(time.perf_counter() - started)
            wire = _wire_bytes(transport) - wire
            smart_after, stats_after = admin.smart_log(), admin.statistics(nsid)["model"]
    finally:
        optimizer.close()
    with AdminClient(server.url, token_file=server.token_file) as admin:
        admin.delete_namespace(admin.nsid(OFFLOAD_NAMESPACE))
    return {
        "what": "cossd.trainer.AdamW(mount=cossd://...): BF16 grads in, BF16 params out, the step and its "
                "commit on the device",
        "seconds": statistics.median(seconds),
        "device_bytes_written": _delta(stats_after, stats, "host_in_bytes") // cycles,
        "device_bytes_read": _delta(stats_after, stats, "host_out_bytes") // cycles,
        "media_bytes_written": _delta(stats_after, stats, "media_write_bytes") // cycles,
        "smart_data_units_written": _delta(smart_after, smart, "data_units_written") / cycles,
        "wire_bytes": wire // cycles,
        "state_on_trainer_bytes": 0,
    }


def iopath_costs(workdir: Path, n: int, cycles: int) -> dict[str, Any]:
    """Both paths on one served device, one after the other, on the same n-parameter model."""
    servers: list[BenchServer] = []  # the teardown's, the server in it in the held block that starts it
    try:
        with held():
            servers.append(BenchServer(workdir / "iopath"))
        server = servers[0]
        rows: dict[str, Any] = {"parameters": n, "tensors": TENSORS, "cycles": cycles,
                "conventional": conventional(server, n, cycles), "cossd": offloaded(server, n, cycles),
                "conventional_ext4": conventional_ext4(server, n, cycles, workdir)}
    finally:
        for started in servers:
            started.stop()
    ours, theirs = rows["cossd"], rows["conventional"]
    rows["wire_ratio"] = theirs["wire_bytes"] / ours["wire_bytes"] if ours["wire_bytes"] else None
    rows["time_ratio"] = theirs["seconds"] / ours["seconds"] if ours["seconds"] else None
    for name in ("conventional", "conventional_ext4", "cossd"):
        row = rows[name]
        if not row.get("measured", True):
            say(f"  I/O path, {name}: {row['why']}")
            continue
        say(f"  I/O path, {name}: {row['seconds'] * 1e3:.1f} ms a cycle, {row['wire_bytes'] / 1e6:.1f} MB on the wire, "
            f"{row['device_bytes_written'] / 1e6:.1f} MB written to the device, "
            f"{row['media_bytes_written'] / 1e6:.1f} MB to its media")
    return rows
