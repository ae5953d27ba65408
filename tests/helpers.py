"""Test helpers: namespaces through the control file, file I/O patterns, a torch reference, free loopback ports."""
from __future__ import annotations

import mmap
import os
import random
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pytest
import torch

from cossd.client import AdminClient


def create_namespace(mountpoint: Path, name: str, tensors: Iterable[tuple[str, int]], *,
                     lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                     weight_decay: float = 0.01, mode: str = "adamw", grad_dtype: str = "fp16",
                     param_dtype: str = "fp16", state_dtype: str = "fp32") -> int:
    with AdminClient(mountpoint) as client:
        return client.create_namespace({
            "name": name,
            "tensors": [[t, n] for t, n in tensors],
            "hyperparameters": {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                                "weight_decay": weight_decay, "mode": mode},
            "grad_dtype": grad_dtype, "param_dtype": param_dtype, "state_dtype": state_dtype,
        })


def tensor_dir(mountpoint: Path, namespace: str, tensor: str) -> Path:
    return mountpoint / "ns" / namespace / "tensors" / tensor


def pwrite_all(path: Path, data: bytes, *, chunk: int | None = None, shuffle: int | None = None,
               o_direct: bool = False) -> None:
    """Write `data` at offset 0 as one write, in `chunk`-byte pieces, optionally shuffled."""
    pieces = [(0, len(data))] if chunk is None else [
        (off, min(chunk, len(data) - off)) for off in range(0, len(data), chunk)
    ]
    if shuffle is not None:
        random.Random(shuffle).shuffle(pieces)
    flags = os.O_WRONLY | (os.O_DIRECT if o_direct else 0)
    fd = os.open(path, flags)
    try:
        view = memoryview(data)
        for off, length in pieces:
            if o_direct:
                # O_DIRECT wants an aligned user buffer: stage through an anonymous mapping.
                buffer = mmap.mmap(-1, max(length, 1))
                buffer[:length] = view[off : off + length]
                written = os.pwrite(fd, memoryview(buffer)[:length], off)
                buffer.close()
            else:
                written = os.pwrite(fd, view[off : off + length], off)
            assert written == length, (written, length)
    finally:
        os.close(fd)


def pread_all(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunks = []
        offset = 0
        while offset < size:
            chunk = os.pread(fd, min(4 << 20, size - offset), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def random_half(rng: np.random.Generator, numel: int, dtype: str, scale: float = 1.0) -> tuple[bytes, torch.Tensor]:
    """Random gradient bytes in fp16 or bf16, and the same values upcast to float32."""
    values = (rng.standard_normal(numel, dtype=np.float32) * scale)
    if dtype == "fp16":
        half = values.astype(np.float16)
        return half.tobytes(), torch.from_numpy(half.astype(np.float32))
    as_bf16 = torch.from_numpy(values).to(torch.bfloat16)
    return as_bf16.view(torch.int16).numpy().tobytes(), as_bf16.to(torch.float32)


def round_to_half(master: np.ndarray, dtype: str) -> bytes:
    """Round-to-nearest-even of FP32 values to fp16 or bf16, by numpy and torch."""
    if dtype == "fp16":
        return master.astype(np.float16).tobytes()
    return torch.from_numpy(master.copy()).to(torch.bfloat16).view(torch.int16).numpy().tobytes()


class TorchReference:
    """torch.optim.AdamW / Adam on FP32 masters: what the device must track."""

    def __init__(self, initial: dict[str, np.ndarray], *, mode: str, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float) -> None:
        self.params = {name: torch.nn.Parameter(torch.from_numpy(values.copy())) for name, values in initial.items()}
        optimizer_class = torch.optim.AdamW if mode == "adamw" else torch.optim.Adam
        self.optimizer = optimizer_class(list(self.params.values()), lr=lr, betas=betas, eps=eps,
                                         weight_decay=weight_decay, foreach=False)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = grads[name].reshape(param.shape).clone()
        self.optimizer.step()

    def master(self, name: str) -> np.ndarray:
        return self.params[name].detach().numpy()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object,
            prog: str | None = None) -> tuple[int, str, str]:
    """Run `cossd ARGV...` (as `prog`: "nvme" answers as nvme-cli) in this process: its exit
    status, stdout and stderr. A SystemExit (argparse's usage errors, --help, a verb's one-line
    refusal) ends the run as it ends the process: its code, or 1 with its message on stderr."""
    from cossd.tools.cli import main  # here: tests that never run the CLI do not load it

    try:
        code = main([str(arg) for arg in argv], prog=prog)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on loopback now (for a server, a metrics endpoint or
    torch.distributed's MASTER_PORT); all probed at once, so they differ."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    """One port free on loopback now."""
    return free_ports(1)[0]


def remove_deepspeed_shm(port: int, addr: str = "127.0.0.1") -> None:
    """Remove the CPU allreduce buffers of a DeepSpeed job that has ended (its CPU accelerator
    makes one in /dev/shm per rank, deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, about
    70 MB each). A rank that does not exit cleanly (killed, or failed) leaves its buffer, RAM
    that stays taken until the machine restarts: some 140 MB per `make test` before this."""
    for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
        path.unlink(missing_ok=True)


# The repository's root: pyproject.toml and the folders it maps the package onto.
REPO_ROOT = Path(__file__).resolve().parents[1]


def package_tree(into: Path) -> Path:
    """A `cossd` directory whose subpackages are links to the folders pyproject maps them
    onto (package-dir). grimp (import-linter's graph) and mypy find a package's
    modules by walking its directory, and cossd's own (cossd_pkg/) holds only __init__.py."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    top = into / "cossd"
    top.mkdir()
    for name in setuptools["packages"]:
        folder = REPO_ROOT / package_dir[name]
        if name == "cossd":
            for module in folder.glob("*.py"):
                (top / module.name).symlink_to(module)
            continue
        sub = name.removeprefix("cossd.")
        if "." in sub:  # a subpackage in its parent's folder (emulator/computational): linked with it
            parent = name.rsplit(".", 1)[0]
            assert Path(package_dir[name]).parent == Path(package_dir[parent]), \
                f"{name}: only a subpackage inside its parent's folder is linked with it"
            continue
        (top / sub).symlink_to(folder, target_is_directory=True)
    return into


class InProcessTransport:
    """AdminClient's transport straight into a Controller (no mount, no server): the command path only."""

    location = "in-process"

    def __init__(self, controller: Any) -> None:
        self.controller = controller

    def exchange(self, raw: bytes) -> Any:
        return self.controller.submit(raw)

    def close(self) -> None:
        pass
