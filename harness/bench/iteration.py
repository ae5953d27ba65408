"""`cossd bench`'s trainer section, whole iterations: forward, backward and the optimizer step of
a model, resident AdamW (with and without a per-step checkpoint) against cossd offload (with
the gradients sent at step(), or streamed while backward runs).

The trainer rows of trainer.py time the optimizer step alone, on one flat tensor. What a
user pays per iteration also depends on what overlaps backward: with `streaming=True` each
gradient leaves (and the drive's kernel runs on it) while backward is still producing the
others. On a GPU backward leaves the CPU's cores to the drive; on a 2-core CPU they share
them, so there streaming buys little. These rows measure it on whatever `--device` is.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...client import AdminClient
from ...trainer import AdamW

from ..nvm_volume import NvmVolume

BLOCKS = 4  # Linear(w, 2w), GELU, Linear(2w, w), four times: about 16 w^2 parameters
ROWS = 256  # the batch: rows of w features
LR = 1e-4


def mlp_width(n: int) -> int:
    """The width that gives the MLP about n parameters: a multiple of 16, at least 16."""
    return max(16, round(math.sqrt(n / (4 * BLOCKS)) / 16) * 16)


def mlp_parameters(n: int) -> int:
    width = mlp_width(n)
    return BLOCKS * (4 * width * width + 3 * width)


def mlp(n: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """A stack of MLP blocks with about n parameters (mlp_parameters(n) exactly)."""
    width = mlp_width(n)
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(BLOCKS):
        layers += [torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)]
    return torch.nn.Sequential(*layers).to(device, dtype)


def _inputs(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """The batch, in the model's dtype."""
    first = next(model.parameters())
    return torch.randn(ROWS, first.shape[1], generator=torch.Generator().manual_seed(6)).to(device, first.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_iterations(device: torch.device, repeat: int, forward_backward: Callable[[], None],
                      step: Callable[[], None], after: Callable[[], None] | None = None) -> list[dict[str, float]]:
    """`repeat` timed iterations after one untimed: seconds of forward + backward, of the step
    (what is left of it once backward is done), and of `after` (a checkpoint) where given."""
    turns = []
    for turn in range(repeat + 1):
        _sync(device)
        started = time.perf_counter()
        forward_backward()
        _sync(device)
        backward_done = time.perf_counter()
        step()
        _sync(device)
        stepped = time.perf_counter()
        if after is not None:
            after()
        if turn:
            turns.append({"forward_backward_s": backward_done - started, "step_s": stepped - backward_done,
                          "checkpoint_s": time.perf_counter() - stepped})
    return turns


def _row(turns: list[dict[str, float]], keys: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    return {"seconds": statistics.median(sum(turn[key] for key in keys) for turn in turns),
            "phases_seconds": {key: statistics.median(turn[key] for turn in turns) for key in keys}, **extra}


def resident(device: torch.device, volume: NvmVolume | Any, n: int, repeat: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """FP32 params, BF16 autocast, torch's fused AdamW on the device: iterations without a
    checkpoint, then (a run of their own) with torch.save + fsync of the model and
    optimizer state after each."""
    model = mlp(n, torch.float32, device, seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    inputs = _inputs(model, device)
    path = volume.path / "iteration-ckpt.pt"

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(inputs).float().square().mean()
        loss.backward()

    def checkpoint() -> None:
        with open(path, "wb") as stream:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, stream)
            stream.flush()
            os.fsync(stream.fileno())

    try:
        plain = _timed_iterations(device, repeat, forward_backward, optimizer.step)
        checkpointed = _timed_iterations(device, repeat, forward_backward, optimizer.step, checkpoint)
    finally:
        path.unlink(missing_ok=True)
    params = sum(p.numel() for p in model.parameters())
    return (_row(plain, ("forward_backward_s", "step_s"), state_on_trainer_bytes=12 * params),
            _row(checkpointed, ("forward_backward_s", "step_s", "checkpoint_s"), state_on_trainer_bytes=12 * params))


def offload(device: torch.device, mountpoint: Path, n: int, repeat: int, streaming: bool) -> dict[str, Any]:
    """BF16 params on the device, cossd.trainer.AdamW; every step committed on the drive."""
    namespace = "bench-iteration" + ("-streamed" if streaming else "")
    model = mlp(n, torch.bfloat16, device, seed=5)
    optimizer = AdamW(model.parameters(), mount=mountpoint, namespace=namespace, lr=LR, streaming=streaming)
    inputs = _inputs(model, device)

    def forward_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(inputs).float().square().mean().backward()

    try:
        turns = _timed_iterations(device, repeat, forward_backward, optimizer.step)
    finally:
        optimizer.close()  # swallows a lost device's errors, so a failure above shows as it is
    # (After a failure the namespace stays: the bench's device is torn down anyway.)
    with AdminClient(mountpoint) as admin:
        admin.delete_namespace(admin.nsid(namespace))
    return _row(turns, ("forward_backward_s", "step_s"), state_on_trainer_bytes=0)


def iteration_costs(device: torch.device, mountpoint: Path, volume: NvmVolume | Any, n: int,
                    repeat: int, media: str) -> dict[str, Any]:
    """The four ways side by side; `media` says what backs the offload's drive."""
    without, with_checkpoint = resident(device, volume, n, repeat)
    return {
        "model": f"{BLOCKS} MLP blocks of width {mlp_width(n)}, {mlp_parameters(n):,} parameters, batch {ROWS}",
        "offload_media": media,
        "resident fused AdamW (BF16 autocast), no checkpoint": without,
        "resident fused AdamW (BF16 autocast) + torch.save checkpoint": with_checkpoint,
        "cossd offload, gradients sent at step()": offload(device, mountpoint, n, repeat, streaming=False),
        "cossd offload, gradients streamed during backward": offload(device, mountpoint, n, repeat, streaming=True),
    }


def markdown_rows(section: dict[str, Any]) -> list[str]:
    lines = ["", f"Whole iterations on the trainer's device ({section['model']}; the offload's drive on "
             f"{section['offload_media']}):", "",
             "| method | seconds per iteration | of which | optimizer state on the trainer |", "|---|---|---|---|"]
    for name, row in section.items():
        if isinstance(row, dict):
            detail = ", ".join(f"{key.removesuffix('_s').replace('_', ' + ')} {value:.3f}"
                               for key, value in row["phases_seconds"].items())
            lines.append(f"| {name} | {row['seconds']:.3f} | {detail} | {row['state_on_trainer_bytes'] / 1e6:.0f} MB |")
    return lines
