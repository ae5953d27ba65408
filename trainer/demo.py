"""`make demo`: train a small GPT through a cossd mount, crash the device mid-step, restore, and compare."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cossd.emulator import Device
from cossd.fs import daemon

from .options import DTYPE_NAMES, Settings, add_demo_arguments, settings_from
from .checkpointing import (
    AsyncDCPCheckpointer,
    PeakMemoryProbe,
    TorchSaveCheckpointer,
    drop_from_page_cache,
    files_under,
    pin_malloc_to_mmap,
)
from .gpt import GPT, GPTConfig, StdlibCorpus, build_model, parameter_count
from .namespace_files import DeviceLostError
from .optim import AdamW
from .reference import MixedPrecisionOptimizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The usual GPT split: decay matrices, not biases, norms or embeddings' positions."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.dim() >= 2 and "position" not in name else no_decay).append((name, param))
    return [
        {"params": [p for _, p in decay], "param_names": [n for n, _ in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "param_names": [n for n, _ in no_decay], "weight_decay": 0.0},
    ]


def _say(text: str) -> None:
    tqdm.write(text)
    sys.stdout.flush()


class Daemon:
    """The device daemon of the demo: started, killed (a crash) and started again."""

    def __init__(self, backing: Path, mountpoint: Path) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.pid = daemon.start_background(backing, mountpoint)

    def crash(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        daemon.stop_background(self.mountpoint, self.pid, lazy=True)

    def restart(self) -> None:
        self.pid = daemon.start_background(self.backing, self.mountpoint)

    def stop(self) -> None:
        daemon.stop_background(self.mountpoint, self.pid)


@dataclasses.dataclass
class RunResult:
    label: str
    losses: dict[int, float]
    step_s: list[float] = dataclasses.field(default_factory=list)
    stall_s: list[float] = dataclasses.field(default_factory=list)
    bytes_per_step: float = 0.0
    checkpoint_memory: int | None = None
    optimizer_host_bytes: int = 0
    restore: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Demo:
    def __init__(self, settings: Settings, backing: Path, mountpoint: Path) -> None:
        self.s = settings
        self.backing, self.mountpoint = backing, mountpoint
        self.config = GPTConfig.named(settings.model)
        self.dtype = DTYPES[settings.dtype]
        self.corpus = StdlibCorpus()
        self.probe = PeakMemoryProbe()
        self.daemon: Daemon | None = None

    # ------------------------------------------------------------------ shared pieces

    def fresh_model(self, seed: int | None = None) -> GPT:
        """FP32 initial weights (to hand to an optimizer), not yet cast to half."""
        return build_model(self.config, self.s.seed if seed is None else seed, torch.float32, self.s.device)

    def loss_of(self, model: GPT, step: int) -> torch.Tensor:
        tokens, targets = self.corpus.batch(step, self.s.batch, self.config.context, self.s.seed,
                                            self.s.device)
        return model.loss(tokens, targets)

    def progress(self, label: str, start: int) -> tqdm:
        return tqdm(total=self.s.steps, initial=start - 1, desc=f"{label:<22}", unit="step",
                    dynamic_ncols=True, leave=True, file=sys.stdout)

    # ------------------------------------------------------------------ cossd

    def run_cossd(self, namespace: str, crash_at: int | None) -> RunResult:
        result = RunResult("cossd", {})
        model = self.fresh_model()
        optimizer = AdamW(param_groups(model, self.s.weight_decay), lr=self.s.lr, betas=(0.9, 0.95),
                          mount=self.mountpoint, namespace=namespace, dtype=self.dtype)
        model.to(self.dtype)
        stats_before = optimizer.files.statistics()
        crashed = False
        step = optimizer.committed_step + 1
        bar = self.progress(f"cossd ({namespace})", step)
        try:
            while step <= self.s.steps:
                for group in optimizer.param_groups:
                    group["lr"] = self.s.lr_at(step)
                started = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = self.loss_of(model, step)
                loss.backward()
                if step == crash_at and not crashed:
                    crashed = True
                    model, optimizer = self._crash_and_restore(model, optimizer, result)
                    step = optimizer.committed_step + 1
                    bar.n = step - 1
                    continue
                optimizer.step()
                result.step_s.append(time.perf_counter() - started)
                timing = optimizer.last_timing
                result.stall_s.append(timing["begin_s"] + timing["commit_s"])
                result.losses[step] = loss.item()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update(1)
                step += 1
            stats = optimizer.files.statistics()
            moved = (stats["grad_bytes_in"] - stats_before["grad_bytes_in"]
                     + stats["bytes_read"] - stats_before["bytes_read"])
            committed = stats["steps_committed"] - stats_before["steps_committed"]
            result.bytes_per_step = moved / max(1, committed + (1 if crashed else 0))
            result.extra["device_statistics"] = stats
            result.extra["final_param_bits"] = [
                p.detach().view(torch.int16).clone() for p in model.parameters()]
            result.checkpoint_memory = self._cossd_step_memory(model, optimizer)
        finally:
            bar.close()
            optimizer.close()
        return result

    def _crash_and_restore(self, model: GPT, optimizer: AdamW,
                           result: RunResult) -> tuple[GPT, AdamW]:
        """Kill the daemon halfway through this step's gradients; restart job and device."""
        assert self.daemon is not None
        halfway = len(optimizer.entries) // 2
        optimizer.before_grad_write = lambda index: self.daemon.crash() if index == halfway else None
        try:
            optimizer.step()
            raise RuntimeError("the device survived a kill -9")
        except DeviceLostError as exc:
            lost = str(exc)
        namespace = optimizer.files.name
        step = optimizer.committed_step + 1
        optimizer.close()
        del model, optimizer
        _say(f"step {step}: device daemon killed (kill -9) after {halfway} of the step's gradients")
        _say(f"          trainer saw: {lost.split(';')[0]}")
        drop_from_page_cache(files_under(self.backing / "ns"))
        started = time.perf_counter()
        self.daemon.restart()
        mounted = time.perf_counter()
        # A restarted job: a new model (its own random init), the same optimizer call.
        model = build_model(self.config, self.s.seed + 1, self.dtype, self.s.device)
        optimizer = AdamW(param_groups(model, self.s.weight_decay), lr=self.s.lr, betas=(0.9, 0.95),
                          mount=self.mountpoint, namespace=namespace, dtype=self.dtype)
        restored = time.perf_counter()
        result.restore = {
            "mount_s": mounted - started,
            "params_s": restored - mounted,
            "total_s": restored - started,
            "bytes_read": 2 * parameter_count(model),
            "recovered_step": optimizer.committed_step,
        }
        _say(f"          remounted in {mounted - started:.2f} s (recovery verified every block "
             f"checksum); quick restore read {2 * parameter_count(model) / 1e6:.1f} MB of params "
             f"in {restored - mounted:.2f} s; resuming after committed step {optimizer.committed_step}")
        return model, optimizer

    def _cossd_step_memory(self, model: GPT, optimizer: AdamW) -> int | None:
        """Peak extra host memory of one whole optimizer step (transfer and commit) on its own."""
        optimizer.zero_grad()
        self.loss_of(model, self.s.steps + 1).backward()
        baseline = self.probe.start()
        optimizer.step()
        return self.probe.extra_since(baseline)

    # ------------------------------------------------------------------ conventional

    def run_conventional(self, checkpointer: Any, steps: int) -> RunResult:
        result = RunResult(checkpointer.label, {})
        model = self.fresh_model()
        optimizer = MixedPrecisionOptimizer(param_groups(model, self.s.weight_decay), torch.optim.AdamW,
                                            lr=self.s.lr, betas=(0.9, 0.95), fused=True)
        model.to(self.dtype)
        bar = tqdm(total=steps, desc=f"{checkpointer.label:<22}", unit="step", dynamic_ncols=True,
                   file=sys.stdout)
        try:
            for step in range(1, steps + 1):
                for group in optimizer.param_groups:
                    group["lr"] = self.s.lr_at(step)
                started = time.perf_counter()
                optimizer.zero_grad()
                loss = self.loss_of(model, step)
                loss.backward()
                optimizer.step()
                stall = 0.0
                if step % self.s.interval == 0:
                    stall = checkpointer.save(model, optimizer, step)
                if step == steps:
                    stall += checkpointer.finish()
                result.step_s.append(time.perf_counter() - started)
                result.stall_s.append(stall)
                result.losses[step] = loss.item()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update(1)
        finally:
            bar.close()
        writes = checkpointer.bytes_written
        result.bytes_per_step = sum(writes) / max(1, len(writes)) / self.s.interval
        result.optimizer_host_bytes = sum(12 * m.numel() for m in optimizer.masters)
        # Host memory of one checkpoint on its own (no training alongside), then a restore.
        baseline = self.probe.start()
        checkpointer.save(model, optimizer, steps)
        checkpointer.finish()
        result.checkpoint_memory = self.probe.extra_since(baseline)
        result.restore = self._restore_conventional(checkpointer)
        result.extra["final_param_bits"] = [p.detach().view(torch.int16).clone() for p in model.parameters()]
        return result

    def _restore_conventional(self, checkpointer: Any) -> dict[str, float]:
        files = checkpointer.files()
        drop_from_page_cache(files)
        started = time.perf_counter()
        model = build_model(self.config, self.s.seed + 1, torch.float32, self.s.device)
        optimizer = MixedPrecisionOptimizer(param_groups(model, self.s.weight_decay), torch.optim.AdamW,
                                            lr=self.s.lr, betas=(0.9, 0.95), fused=True)
        model.to(self.dtype)
        step = checkpointer.restore(model, optimizer)
        return {"total_s": time.perf_counter() - started, "bytes_read": sum(f.stat().st_size for f in files),
                "recovered_step": step}


def run(settings: Settings, backing_dir: Path | None) -> int:
    from . import demo_report

    pin_malloc_to_mmap()
    workdir = Path(tempfile.mkdtemp(prefix="cossd-demo-"))
    backing = backing_dir or workdir / "backing"
    mountpoint = workdir / "mnt"
    mountpoint.mkdir()
    started = time.perf_counter()
    if not (backing / "superblock.json").exists():
        identity = Device.format(backing)
        _say(f"formatted a cossd device (serial {identity['serial']}) in {backing}")
    demo = Demo(settings, backing, mountpoint)
    parameters = parameter_count(demo.fresh_model())
    _say(f"model: GPT, {parameters / 1e6:.2f}M parameters ({settings.model}); corpus: "
         f"{len(demo.corpus) / 1e6:.1f} MB of Python's standard library ({demo.corpus.files} files)")
    _say(f"{settings.steps} steps of batch {settings.batch}x{demo.config.context} in {settings.dtype} "
         f"on {settings.device}; the device is killed in the middle of step {settings.crash_at}")
    demo.daemon = Daemon(backing, mountpoint)
    _say(f"mounted at {mountpoint} (daemon pid {demo.daemon.pid})")
    results: dict[str, RunResult] = {}
    try:
        _remove_demo_namespaces(mountpoint)
        results["cossd_crash"] = demo.run_cossd("demo-gpt", settings.crash_at)
        results["cossd_straight"] = demo.run_cossd("demo-gpt-straight", None)
    finally:
        demo.daemon.stop()
    results["torch_save"] = demo.run_conventional(
        TorchSaveCheckpointer(workdir / "checkpoints" / "torch-save"), settings.steps)
    results["dcp_async"] = demo.run_conventional(
        AsyncDCPCheckpointer(workdir / "checkpoints" / "dcp"), settings.dcp_steps)
    report = demo_report.build(settings, parameters, results, time.perf_counter() - started,
                               backing=str(backing), probe_available=demo.probe.available)
    settings.output.mkdir(parents=True, exist_ok=True)
    (settings.output / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    figure = demo_report.figure(report, settings.output / "demo.png")
    _say("")
    _say(demo_report.table(report))
    _say("")
    for line in demo_report.verdicts(report):
        _say(line)
    _say(f"\nreport: {settings.output / 'report.json'}; figure: {figure}")
    if backing_dir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        shutil.rmtree(workdir / "checkpoints", ignore_errors=True)
    return 0 if report["checks"]["passed"] else 1


def _remove_demo_namespaces(mountpoint: Path) -> None:
    """Start from scratch on a reused backing directory: drop the demo's own namespaces."""
    from cossd.tools.client import AdminClient

    with AdminClient(mountpoint) as admin:
        for entry in admin.describe()["namespaces"]:
            if entry["name"] in ("demo-gpt", "demo-gpt-straight"):
                admin.delete_namespace(int(entry["nsid"]))
                _say(f"deleted namespace {entry['name']} left by an earlier demo")


def main(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    return run(settings, args.backing)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m cossd.trainer.demo", description=__doc__)
    add_demo_arguments(parser)
    sys.exit(main(parser.parse_args()))
