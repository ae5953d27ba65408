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

from ..emulator import Device
from ..fs import daemon
from ..trainer import AdamW, DeviceLostError
from ..trainer.options import DTYPE_NAMES, Settings, add_demo_arguments, settings_from

from .checkpointing import (
    AsyncDCPCheckpointer,
    PeakMemoryProbe,
    TorchSaveCheckpointer,
    drop_from_page_cache,
    files_under,
    pin_malloc_to_mmap,
)
from .gpt import GPT, GPTConfig, StdlibCorpus, build_model, parameter_count
from .nvm_volume import NvmVolume
from .reference import MixedPrecisionOptimizer
from .served import ServedDevice, write_token

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINT_NAMESPACE = "demo-checkpoints"  # the plain NVM namespace the baselines write to
assert tuple(DTYPES) == DTYPE_NAMES


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The usual GPT split: decay matrices, not biases, norms or embeddings' positions."""
    decay: list[tuple[str, torch.nn.Parameter]] = []
    no_decay: list[tuple[str, torch.nn.Parameter]] = []
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
    restore: dict[str, float | str] = dataclasses.field(default_factory=dict)  # seconds, bytes; "through"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Demo:
    def __init__(self, settings: Settings, backing: Path, mountpoint: Path) -> None:
        self.s = settings
        self.backing, self.mountpoint = backing, mountpoint
        self.config = GPTConfig.named(settings.model)
        self.dtype = DTYPES[settings.dtype]
        self.corpus = StdlibCorpus()
        self.probe = PeakMemoryProbe()
        # What serves the device now: the mount's daemon, or (--remote, for the cossd runs) a
        # storage server. Either is what the demo kills mid-step and restarts.
        self.daemon: Daemon | ServedDevice | None = None

    @property
    def target(self) -> Path | str:
        """Where the trainer reaches the device: the mount point or the server's URL."""
        return self.daemon.url if isinstance(self.daemon, ServedDevice) else self.mountpoint

    def credentials(self) -> dict[str, Any]:
        """The server's token for an optimizer or a client (nothing for a mount)."""
        return {"token_file": self.daemon.token_file} if isinstance(self.daemon, ServedDevice) else {}

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
                          mount=self.target, namespace=namespace, dtype=self.dtype, **self.credentials())
        model.to(self.dtype)
        stats_before = optimizer.files.statistics()
        smart_before = self._smart()
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
            # A kill -9 loses the SMART counting since the last save: only meaningful uncrashed.
            result.extra["drive"] = _smart_delta(smart_before, self._smart()) | {
                "bytes_written": stats["grad_bytes_in"] - stats_before["grad_bytes_in"],
                "bytes_read": stats["bytes_read"] - stats_before["bytes_read"]}
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
        what = "storage server" if isinstance(self.daemon, ServedDevice) else "device daemon"
        _say(f"step {step}: {what} killed (kill -9) after {halfway} of the step's gradients")
        _say(f"          trainer saw: {lost.split(';')[0]}")
        drop_from_page_cache(files_under(self.backing / "ns"))
        started = time.perf_counter()
        self.daemon.restart()
        mounted = time.perf_counter()
        # A restarted job: a new model (its own random init), the same optimizer call.
        model = build_model(self.config, self.s.seed + 1, self.dtype, self.s.device)
        optimizer = AdamW(param_groups(model, self.s.weight_decay), lr=self.s.lr, betas=(0.9, 0.95),
                          mount=self.target, namespace=namespace, dtype=self.dtype, **self.credentials())
        restored = time.perf_counter()
        result.restore = {
            "mount_s": mounted - started,
            "params_s": restored - mounted,
            "total_s": restored - started,
            "bytes_read": 2 * parameter_count(model),
            "recovered_step": optimizer.committed_step,
            "through": "server" if isinstance(self.daemon, ServedDevice) else "mount",
        }
        again = "served again" if isinstance(self.daemon, ServedDevice) else "remounted"
        _say(f"          {again} in {mounted - started:.2f} s (recovery verified every block "
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

    def run_conventional(self, checkpointer: Any, steps: int, volume: NvmVolume) -> RunResult:
        """Stock AdamW, checkpointing into `volume` (ext4 on a plain NVM namespace of the same
        drive): the drive's own counters give the bytes."""
        result = RunResult(checkpointer.label, {})
        drive_before = volume.settle()
        smart_before = self._smart()
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
        drive = _drive_delta(drive_before, volume.settle())
        smart = _smart_delta(smart_before, self._smart())
        writes = checkpointer.bytes_written
        # What the drive counted (checkpoint files, and the filesystem's metadata and journal),
        # per training step: the same counters as cossd's own row.
        result.bytes_per_step = (drive["bytes_written"] + drive["bytes_read"]) / steps
        result.extra["drive"] = drive | smart | {
            "checkpoint_file_bytes_mean": sum(writes) / max(1, len(writes)), "checkpoints": len(writes)}
        result.optimizer_host_bytes = sum(12 * m.numel() for m in optimizer.masters)
        # Host memory of one checkpoint on its own (no training alongside), then a restore.
        baseline = self.probe.start()
        checkpointer.save(model, optimizer, steps)
        checkpointer.finish()
        result.checkpoint_memory = self.probe.extra_since(baseline)
        result.restore = self._restore_conventional(checkpointer, volume)
        result.extra["final_param_bits"] = [p.detach().view(torch.int16).clone() for p in model.parameters()]
        return result

    def _restore_conventional(self, checkpointer: Any, volume: NvmVolume) -> dict[str, float | str]:
        files = checkpointer.files()
        drop_from_page_cache(files)
        before = volume.statistics()
        started = time.perf_counter()
        model = build_model(self.config, self.s.seed + 1, torch.float32, self.s.device)
        optimizer = MixedPrecisionOptimizer(param_groups(model, self.s.weight_decay), torch.optim.AdamW,
                                            lr=self.s.lr, betas=(0.9, 0.95), fused=True)
        model.to(self.dtype)
        step = checkpointer.restore(model, optimizer)
        elapsed = time.perf_counter() - started
        return {"total_s": elapsed, "bytes_read": volume.statistics()["bytes_read"] - before["bytes_read"],
                "checkpoint_file_bytes": sum(f.stat().st_size for f in files), "recovered_step": step}

    def _smart(self) -> dict[str, int]:
        from ..client import AdminClient

        with AdminClient(self.target, **self.credentials()) as admin:
            return admin.smart_log()


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
    results: dict[str, RunResult] = {}
    if settings.remote:
        # The talk's system: the trainer reaches the drive through a storage server.
        demo.daemon = ServedDevice(backing, write_token(workdir / "token"))
        _say(f"serving the device at {demo.daemon.url} (storage server pid {demo.daemon.pid}, token "
             f"{demo.daemon.token_file}); the trainer speaks the network wire, no FUSE")
        try:
            _remove_demo_namespaces(demo)
            results["cossd_crash"] = demo.run_cossd("demo-gpt", settings.crash_at)
            results["cossd_straight"] = demo.run_cossd("demo-gpt-straight", None)
        finally:
            demo.daemon.stop()  # a device is served or mounted, one at a time
    demo.daemon = Daemon(backing, mountpoint)
    _say(f"mounted at {mountpoint} (daemon pid {demo.daemon.pid})")
    try:
        if not settings.remote:
            _remove_demo_namespaces(demo)
            results["cossd_crash"] = demo.run_cossd("demo-gpt", settings.crash_at)
            results["cossd_straight"] = demo.run_cossd("demo-gpt-straight", None)
        # The baselines write to the same drive: ext4 on a plain NVM namespace, loop-mounted.
        # Leaving the block unmounts and detaches it, also when a run failed.
        size = volume_bytes(parameters)
        with NvmVolume(mountpoint, CHECKPOINT_NAMESPACE, size, workdir / "checkpoints") as volume:
            _say(f"conventional checkpoints go to ext4 on nvm namespace {CHECKPOINT_NAMESPACE} "
                 f"({size / 2**20:.0f} MiB, {volume.loop_device}) of the same drive")
            results["torch_save"] = demo.run_conventional(
                TorchSaveCheckpointer(volume.path / "torch-save"), settings.steps, volume)
            results["dcp_async"] = demo.run_conventional(
                AsyncDCPCheckpointer(volume.path / "dcp"), settings.dcp_steps, volume)
    finally:
        demo.daemon.stop()
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
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if report["checks"]["passed"] else 1


def volume_bytes(parameters: int) -> int:
    """Room for the baselines' checkpoints, about 14 bytes per parameter each: torch.save's
    file and its replacement, then DCP's two directories, beside ext4's own metadata."""
    size = 64 * parameters + (192 << 20)
    return -(-size // (1 << 20)) * (1 << 20)


def _drive_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {key: after[key] - before[key]
            for key in ("bytes_written", "bytes_read", "write_commands", "read_commands", "flushes")}


def _smart_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """SMART's own view of the same traffic (in units of 512,000 bytes, rounded up)."""
    return {f"smart_{key}": after[key] - before[key]
            for key in ("data_units_written", "data_units_read", "host_write_commands", "host_read_commands")}


def _remove_demo_namespaces(demo: Demo) -> None:
    """Start from scratch on a reused backing directory: drop the demo's own namespaces."""
    from ..client import AdminClient

    with AdminClient(demo.target, **demo.credentials()) as admin:
        for entry in admin.describe()["namespaces"]:
            if entry["name"] in ("demo-gpt", "demo-gpt-straight", CHECKPOINT_NAMESPACE):
                admin.delete_namespace(int(entry["nsid"]))
                _say(f"deleted namespace {entry['name']} left by an earlier demo")


def main(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available to torch")
    return run(settings, args.backing)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m cossd.harness.demo", description=__doc__)
    add_demo_arguments(parser)
    sys.exit(main(parser.parse_args()))
