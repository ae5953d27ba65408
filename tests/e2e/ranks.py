"""What the multi-rank tests share: a device mounted for a module, ranks started as torchrun would start them, their saved results, and a bit-for-bit comparison."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from conftest import Mount, start_mount, stop_mount
from helpers import free_port, remove_deepspeed_shm


@contextlib.contextmanager
def mounted_device(root: Path, serial: str, capacity_bytes: int = 8 << 30) -> Iterator[Mount]:
    """A device formatted under `root` and mounted at root/mnt, always unmounted at the end."""
    from cossd.emulator import Device

    root.mkdir(parents=True, exist_ok=True)
    Device.format(root / "backing", capacity_bytes=capacity_bytes, serial=serial)
    mounted = start_mount(root / "backing", root / "mnt")
    try:
        yield mounted
    finally:
        stop_mount(mounted)



def spawn_ranks(script: Path, config: dict[str, Any], world: int, out: Path, timeout_s: float) -> list[int]:
    """`world` processes of `script` with `config` (JSON, its one argument) and the variables
    torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); waits for them and returns
    their exit codes, every rank's output in out/logs.txt."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = os.environ | {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                         "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), json.dumps(config)], env=base | {"RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    codes, logs = [], []
    try:
        for process in ranks:
            text, _ = process.communicate(timeout=timeout_s)
            codes.append(process.returncode)
            logs.append(text)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
        remove_deepspeed_shm(port)  # what a DeepSpeed rank that did not exit cleanly left in RAM
    (out / "logs.txt").write_text("\n".join(f"--- rank {r} (exit {c})\n{t}" for r, (c, t) in enumerate(zip(codes, logs))))
    return codes


def finished(out: Path, world: int, codes: list[int]) -> list[dict[str, Any]]:
    """Every rank's saved results (out/rankN.pt), once each rank exited 0; else the failure
    carries the ranks' log and any error files they wrote."""
    assert codes == [0] * world, (codes, (out / "logs.txt").read_text()[-6000:],
                                  [p.read_text() for p in sorted(out.glob("error*.txt"))])
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]


def bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """The same tensors bit for bit: as many, each of the same dtype and the same bits."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.int16 if x.element_size() == 2 else torch.int32),
                                           y.view(torch.int16 if y.element_size() == 2 else torch.int32))
        for x, y in zip(a, b))
