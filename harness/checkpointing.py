"""The conventional per-step checkpoints cossd is measured against: torch.save + fsync, and DCP async_save."""
from __future__ import annotations

import ctypes
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .reference import MixedPrecisionOptimizer


# ---------------------------------------------------------------------- host memory probe

def pin_malloc_to_mmap() -> bool:
    """Make glibc return large freed blocks to the OS, so resident memory tracks live data.

    Without this, glibc raises its mmap threshold after the first large free and keeps
    later buffers on the heap, where a checkpoint's staging copy would reuse pages already
    resident and not show in the peak-RSS measurement.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3
    # 128 KiB is glibc's starting threshold; setting it explicitly also stops it from growing.
    return bool(libc.mallopt(m_mmap_threshold, 128 << 10))


class PeakMemoryProbe:
    """Peak extra resident memory of this process during an operation (Linux VmHWM)."""

    def __init__(self) -> None:
        self.available = self._reset_peak()

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise KeyError(field)

    @staticmethod
    def _reset_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as clear_refs:
                clear_refs.write("5")  # 5: reset the peak resident set size to the current one
            return True
        except OSError:
            return False

    def start(self) -> int:
        self._reset_peak()
        return self._status("VmRSS")

    def extra_since(self, baseline: int) -> int | None:
        if not self.available:
            return None
        return max(0, self._status("VmHWM") - baseline)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Evict files from the page cache so a restore reads from the disk (best effort)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def files_under(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the trainer's state

def trainer_state(model: torch.nn.Module, optimizer: MixedPrecisionOptimizer, step: int) -> dict[str, Any]:
    """What a conventional checkpoint must hold to resume: model, FP32 masters, moments, step."""
    return {
        "model": model.state_dict(),
        "master": {str(i): m.detach() for i, m in enumerate(optimizer.masters)},
        "optimizer": optimizer.optimizer.state_dict(),
        "step": step,
    }


def apply_trainer_state(state: dict[str, Any], model: torch.nn.Module,
                        optimizer: MixedPrecisionOptimizer) -> int:
    model.load_state_dict(state["model"])
    optimizer.load_masters(state["master"][str(i)] for i in range(len(optimizer.masters)))
    optimizer.optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


# ---------------------------------------------------------------------- torch.save + fsync

class TorchSaveCheckpointer:
    """torch.save of the whole trainer state to a new file, fsync, rename over the last one."""

    label = "torch.save + fsync"

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "checkpoint.pt"
        self.bytes_written: list[int] = []

    def save(self, model: torch.nn.Module, optimizer: MixedPrecisionOptimizer, step: int) -> float:
        """Write a checkpoint; returns the seconds the training loop was stalled."""
        started = time.perf_counter()
        temporary = self.path.with_suffix(".tmp")
        with open(temporary, "wb") as stream:
            torch.save(trainer_state(model, optimizer, step), stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, self.path)
        _fsync_path(self.directory)
        self.bytes_written.append(self.path.stat().st_size)
        return time.perf_counter() - started

    def finish(self) -> float:
        return 0.0

    def files(self) -> list[Path]:
        return [self.path]

    def restore(self, model: torch.nn.Module, optimizer: MixedPrecisionOptimizer) -> int:
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        return apply_trainer_state(state, model, optimizer)


# ---------------------------------------------------------------------- DCP async_save

# DCP's note, on every call and from its writer thread, that it runs in a single process.
_SINGLE_PROCESS_NOTE = "torch.distributed is disabled, unavailable or uninitialized"


class AsyncDCPCheckpointer:
    """torch.distributed.checkpoint.async_save: stage a copy, write it in the background.

    The next save first waits for the previous one (DCP allows one in flight), so the
    stall is the staging copy plus any wait; FileSystemWriter fsyncs its files.
    """

    label = "DCP async_save"

    def __init__(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        # The writer thread warns outside any catch_warnings block: filter it for good.
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.pending: Any = None
        self.bytes_written: list[int] = []
        self.last_path: Path | None = None
        self._sequence = 0

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            assert self.last_path is not None
            self.bytes_written.append(sum(p.stat().st_size for p in files_under(self.last_path)))

    def save(self, model: torch.nn.Module, optimizer: MixedPrecisionOptimizer, step: int) -> float:
        started = time.perf_counter()
        self._wait()
        # A new directory per save (as DCP users do), the one before it removed once
        # superseded, so the disk holds one or two checkpoints.
        self._sequence += 1
        path = self.directory / f"step-{self._sequence % 2}"
        if path.exists():
            for file in files_under(path):
                file.unlink()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
            self.pending = self.dcp.async_save(trainer_state(model, optimizer, step), checkpoint_id=str(path))
        self.last_path = path
        return time.perf_counter() - started

    def finish(self) -> float:
        started = time.perf_counter()
        self._wait()
        return time.perf_counter() - started

    def files(self) -> list[Path]:
        return files_under(self.last_path) if self.last_path else []

    def restore(self, model: torch.nn.Module, optimizer: MixedPrecisionOptimizer) -> int:
        # DCP loads in place into a state dict of the right shape: the restarted trainer's own.
        assert self.last_path is not None
        template = trainer_state(model, optimizer, 0)
        template["optimizer"] = _zeros_like_optimizer_state(optimizer)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_NOTE)
            self.dcp.load(template, checkpoint_id=str(self.last_path))
        return apply_trainer_state(template, model, optimizer)


def _zeros_like_optimizer_state(optimizer: MixedPrecisionOptimizer) -> dict[str, Any]:
    """A fresh optimizer's state_dict with its per-param state allocated (DCP fills it)."""
    state = optimizer.optimizer.state_dict()
    for index, master in enumerate(optimizer.masters):
        state["state"][index] = {
            "step": torch.zeros((), dtype=torch.float32),
            "exp_avg": torch.zeros_like(master, dtype=torch.float32),
            "exp_avg_sq": torch.zeros_like(master, dtype=torch.float32),
        }
    return state
