"""`cossd bench`'s trainer section: one optimizer step as the trainer sees it, on CPU or a CUDA GPU.

Two ways to keep Adam's state for a flat tensor of n parameters, each made durable every step:

- **resident + checkpoint**: FP32 params and moments live on the trainer's device and torch's
  fused AdamW steps them there; then a conventional checkpoint, `torch.save` of the master
  weights and both moments plus fsync, into ext4 on a plain NVM namespace of the bench's own
  device (what a trainer without cossd would do to get the same durability);
- **cossd offload**: BF16 params live on the trainer's device; `cossd.trainer.AdamW` sends the
  BF16 gradients to the drive (device to host, then the mount), the drive steps its FP32 state
  and commits, and the new BF16 params come back (host to device).

On a GPU this measures what issue 6 asks for: GPU-resident fused AdamW plus a per-step
checkpoint against offload with 4 bytes per parameter over the link. On CPU the same code runs
with host tensors (no copies between devices), so the section is tested on every machine.
"""
from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ...client import AdminClient
from ...trainer import AdamW

from . import iteration as bench_iteration
from ..nvm_volume import NvmVolume, syncfs

TRAINER_NAMESPACE = "bench-trainer"
LR = 1e-3


def resolve_device(name: str) -> torch.device:
    """The torch device the trainer section runs on; a clear error where there is none."""
    if name not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available to torch {torch.__version__} here")
    return torch.device(name)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a clock reads what the step really took."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class LocalCheckpointDir:
    """Where the resident row's checkpoints go on a machine that cannot loop-mount a
    filesystem on the bench's device (a container without loop devices): a plain directory.
    Its settle() counts the bytes this process handed to write() (/proc/self/io wchar), as
    NvmVolume's counts what the drive took."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        path.mkdir(parents=True, exist_ok=True)

    def settle(self) -> dict[str, int]:
        syncfs(self.path)
        with open("/proc/self/io") as counters:
            fields = dict(line.split(": ") for line in counters.read().splitlines())
        return {"bytes_written": int(fields["wchar"])}


def resident_with_checkpoint(device: torch.device, volume: NvmVolume | LocalCheckpointDir, n: int,
                             repeat: int) -> dict[str, Any]:
    """Fused AdamW on the trainer's device, then torch.save + fsync of its state every step."""
    generator = torch.Generator().manual_seed(3)
    param = torch.nn.Parameter(torch.randn(n, generator=generator).to(device))
    param.grad = (torch.randn(n, generator=generator) * 0.01).to(device)
    optimizer = torch.optim.AdamW([param], lr=LR, fused=True)
    optimizer.step()  # creates the moments
    state = optimizer.state[param]
    path = volume.path / "trainer-ckpt.pt"
    step_s, checkpoint_s, link_bytes = [], [], []
    for _ in range(repeat):
        _sync(device)
        started = time.perf_counter()
        optimizer.step()
        _sync(device)
        stepped = time.perf_counter()
        before = volume.settle()
        saving = time.perf_counter()
        with open(path, "wb") as stream:
            # torch.save copies GPU tensors to the host first: that transfer is part of the cost.
            torch.save({"master": param.detach(), "exp_avg": state["exp_avg"],
                        "exp_avg_sq": state["exp_avg_sq"]}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        checkpoint_s.append(time.perf_counter() - saving)
        step_s.append(stepped - started)
        link_bytes.append(volume.settle()["bytes_written"] - before["bytes_written"])
    path.unlink()
    return {
        "step_seconds": statistics.median(step_s),
        "checkpoint_seconds": statistics.median(checkpoint_s),
        "seconds": statistics.median(a + b for a, b in zip(step_s, checkpoint_s)),
        "bytes_over_link": int(statistics.median(link_bytes)),
        "state_on_trainer_bytes": 12 * n,
    }


def cossd_offload(device: torch.device, mountpoint: Path, n: int, repeat: int,
                  use_cmb: bool = True) -> dict[str, Any]:
    """cossd.trainer.AdamW: BF16 gradients out, the step and its commit on the drive, BF16
    params back, every step durable on the drive; through the drive's memory buffer, or
    (use_cmb=False) through the tensor files."""
    generator = torch.Generator().manual_seed(4)
    param = torch.nn.Parameter(torch.randn(n, generator=generator).to(device, torch.bfloat16))
    optimizer = AdamW([param], mount=mountpoint, namespace=TRAINER_NAMESPACE, lr=LR, use_cmb=use_cmb)
    transport = "cmb" if optimizer.files.cmb() is not None else "files"
    pinned = optimizer.cmb_pinned
    try:
        param.grad = (torch.randn(n, generator=generator) * 0.01).to(device, torch.bfloat16)
        optimizer.step()  # the first step seals the initial state
        seconds, phases = [], []
        for _ in range(repeat):
            _sync(device)
            started = time.perf_counter()
            optimizer.step()
            _sync(device)
            seconds.append(time.perf_counter() - started)
            phases.append(dict(optimizer.last_timing))
    finally:
        optimizer.close()
    with AdminClient(mountpoint) as admin:
        admin.delete_namespace(admin.nsid(TRAINER_NAMESPACE))
    return {
        "seconds": statistics.median(seconds),
        "phases_seconds": {key: statistics.median(p.get(key, 0.0) for p in phases) for key in phases[0]},
        "bytes_over_link": 4 * n,  # 2 B of gradient out, 2 B of param back, per parameter
        "state_on_trainer_bytes": 0,
        "transport": transport,
        "cmb_pinned_for_cuda": pinned,
    }


def trainer_costs(device_name: str, mountpoint: Path, volume: NvmVolume | LocalCheckpointDir, n: int, repeat: int,
                  ram_mountpoint: Path | None = None) -> dict[str, Any]:
    """Both methods on the bench's device; with `ram_mountpoint` (a device whose media is in
    RAM) the offload twice more there, through the memory buffer and through the files,
    where the emulator's own writes of the new state into the page cache of a disk
    filesystem do not set its pace: what a drive that writes its media by DMA would leave
    for the transfers and the step."""
    device = resolve_device(device_name)
    costs = {
        "device": device_label(device),
        "elements": n,
        "checkpoint_target": ("ext4 on a plain NVM namespace of the bench's device" if isinstance(volume, NvmVolume)
                              else f"a plain directory ({volume.reason})"),
        "resident fused AdamW + torch.save checkpoint": resident_with_checkpoint(device, volume, n, repeat),
        "cossd offload (AdamW on the drive)": cossd_offload(device, mountpoint, n, repeat),
    }
    if ram_mountpoint is not None:
        costs["cossd offload, the drive's media in RAM"] = cossd_offload(device, ram_mountpoint, n, repeat)
        costs["cossd offload, media in RAM, through the tensor files"] = cossd_offload(
            device, ram_mountpoint, n, repeat, use_cmb=False)
    # Whole iterations: the offload's drive in RAM where there is one (as a drive writing
    # its media by DMA), else the bench's device.
    costs["iterations"] = bench_iteration.iteration_costs(
        device, ram_mountpoint or mountpoint, volume, n, repeat,
        "tmpfs (media in RAM)" if ram_mountpoint is not None else "the bench's temporary directory")
    return costs


def markdown_rows(section: dict[str, Any]) -> list[str]:
    lines = ["", f"Trainer side, on {section['device']}: one step of {section['elements']:,} parameters, "
             "each step made durable; the resident row's checkpoints go into "
             f"{section.get('checkpoint_target', 'ext4 on a plain NVM namespace')}", "",
             "| method | seconds per step | of which | bytes over the link | optimizer state on the trainer |",
             "|---|---|---|---|---|"]
    for name, row in section.items():
        if not isinstance(row, dict) or name == "iterations":
            continue
        if "checkpoint_seconds" in row:
            detail = f"step {row['step_seconds']:.3f} + checkpoint {row['checkpoint_seconds']:.3f}"
        else:
            detail = ", ".join(f"{key.removesuffix('_s')} {value:.3f}"
                               for key, value in row["phases_seconds"].items())
        lines.append(f"| {name} | {row['seconds']:.3f} | {detail} | {row['bytes_over_link'] / 1e6:.0f} MB "
                     f"| {row['state_on_trainer_bytes'] / 1e6:.0f} MB |")
    if "iterations" in section:
        lines += bench_iteration.markdown_rows(section["iterations"])
    return lines
