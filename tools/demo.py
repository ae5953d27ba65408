"""`make demo`: train a small numpy MLP through a real mount, crash it mid-step, restore, finish."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from cossd.emulator import Device
from cossd.fs import daemon
from cossd.tools.client import AdminClient

LAYERS = {"w1": (256, 512), "b1": (512,), "w2": (512, 10), "b2": (10,)}
BATCH = 256


def _say(text: str) -> None:
    print(text, flush=True)


class Teacher:
    """A fixed random network that labels random inputs: a task that needs no download."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.w = rng.standard_normal((256, 10)).astype(np.float32)
        self.rng = np.random.default_rng(seed + 1)

    def batch(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([step, 7])
        x = rng.standard_normal((BATCH, 256)).astype(np.float32)
        return x, np.argmax(np.tanh(x @ self.w), axis=1)


def forward_backward(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    h = x @ params["w1"] + params["b1"]
    a = np.maximum(h, 0)
    logits = a @ params["w2"] + params["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    d_logits = p
    d_logits[np.arange(len(y)), y] -= 1
    d_logits /= len(y)
    d_a = d_logits @ params["w2"].T
    d_h = d_a * (h > 0)
    grads = {"w2": a.T @ d_logits, "b2": d_logits.sum(0), "w1": x.T @ d_h, "b1": d_h.sum(0)}
    return loss, grads


class MountedRun:
    """The device daemon for the demo, restartable after a simulated crash."""

    def __init__(self, backing: Path, mountpoint: Path) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.pid = daemon.start_background(backing, mountpoint)

    def crash(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        while Path(f"/proc/{self.pid}").exists():
            try:
                os.waitpid(self.pid, 0)
            except ChildProcessError:
                time.sleep(0.01)
        subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)

    def restart(self) -> None:
        self.pid = daemon.start_background(self.backing, self.mountpoint)

    def stop(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{self.pid}").exists() and time.monotonic() < deadline:
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)


def tensor_path(mountpoint: Path, name: str, role: str) -> Path:
    return mountpoint / "ns" / "mlp" / "tensors" / name / role


def read_params(mountpoint: Path) -> dict[str, np.ndarray]:
    params = {}
    for name, shape in LAYERS.items():
        raw = tensor_path(mountpoint, name, "param").read_bytes()
        params[name] = np.frombuffer(raw, dtype=np.float16).astype(np.float32).reshape(shape)
    return params


def write_grads(mountpoint: Path, grads: dict[str, np.ndarray], only: list[str] | None = None) -> None:
    for name in only or list(LAYERS):
        fd = os.open(tensor_path(mountpoint, name, "grad"), os.O_WRONLY)
        try:
            os.pwrite(fd, grads[name].astype(np.float16).tobytes(), 0)
        finally:
            os.close(fd)


def main(args: argparse.Namespace) -> int:
    steps = int(args.steps)
    crash_at = int(args.crash_at) if args.crash_at is not None else steps // 2
    overflow_at = min(steps, crash_at + 5)
    workdir = Path(tempfile.mkdtemp(prefix="cossd-demo-"))
    backing = Path(args.backing) if args.backing else workdir / "backing"
    mountpoint = workdir / "mnt"
    mountpoint.mkdir()
    if not (backing / "superblock.json").exists():
        identity = Device.format(backing)
        _say(f"formatted device {identity['serial']} in {backing}")
    run = MountedRun(backing, mountpoint)
    _say(f"mounted at {mountpoint} (daemon pid {run.pid})")
    report: dict[str, Any] = {"steps": steps, "crash_at": crash_at, "losses": {}}
    try:
        with AdminClient(mountpoint) as client:
            names = [ns["name"] for ns in client.describe()["namespaces"]]
            if "mlp" not in names:
                client.create_namespace({
                    "name": "mlp",
                    "tensors": [[n, int(np.prod(s))] for n, s in LAYERS.items()],
                    "hyperparameters": {"lr": 3e-3, "weight_decay": 0.01, "mode": "adamw"},
                })
        parameters = sum(int(np.prod(s)) for s in LAYERS.values())
        committed = int((mountpoint / "ns/mlp/step").read_text())
        if committed == 0:
            rng = np.random.default_rng(0)
            for name, shape in LAYERS.items():
                scale = 1.0 / np.sqrt(shape[0]) if len(shape) == 2 else 0.0
                init = (rng.standard_normal(int(np.prod(shape))) * scale).astype(np.float32)
                tensor_path(mountpoint, name, "master").write_bytes(init.tobytes())
        _say(f"namespace mlp: {parameters:,} parameters, starting after step {committed}")
        teacher = Teacher()
        params = read_params(mountpoint)
        step = committed + 1
        started = time.perf_counter()
        while step <= steps:
            x, y = teacher.batch(step)
            loss, grads = forward_backward(params, x, y)
            if step == crash_at and not report.get("crash"):
                # Half the gradients reach the device, then the daemon dies (kill -9).
                write_grads(mountpoint, grads, only=["w1", "b1"])
                run.crash()
                _say(f"step {step}: daemon killed (kill -9) in the middle of the step")
                t0 = time.perf_counter()
                run.restart()
                recovered = int((mountpoint / "ns/mlp/step").read_text())
                params = read_params(mountpoint)
                restore_s = time.perf_counter() - t0
                _say(f"          remounted, recovered committed step {recovered}; quick restore read "
                     f"{2 * parameters:,} bytes of params in {restore_s * 1000:.0f} ms")
                report["crash"] = {"step": step, "recovered_step": recovered, "restore_s": restore_s}
                step = recovered + 1
                continue
            if step == overflow_at and not report.get("overflow"):
                grads["w2"][0, 0] = np.inf  # an overflowed gradient, as with too high a loss scale
                write_grads(mountpoint, grads)
                stats = json.loads((mountpoint / "ns/mlp/stats.json").read_text())
                _say(f"step {step}: inf in one gradient element -> step skipped "
                     f"(device step still {stats['committed_step']}, skips {stats['steps_skipped']})")
                report["overflow"] = {"step": step, "skipped": stats["steps_skipped"]}
                grads["w2"][0, 0] = 0.0
            write_grads(mountpoint, grads)
            now = int((mountpoint / "ns/mlp/step").read_text())
            if now != step:
                raise RuntimeError(f"device at step {now}, expected {step}")
            params = read_params(mountpoint)
            report["losses"][step] = loss
            if step % 10 == 0 or step == 1 or step == steps:
                rate = step / max(1e-9, time.perf_counter() - started)
                _say(f"step {step:4d}/{steps}  loss {loss:.4f}  ({rate:.1f} steps/s)")
            step += 1
        stats = json.loads((mountpoint / "ns/mlp/stats.json").read_text())
        report["device"] = stats
        report["bytes_per_step"] = {
            "cossd_host_link": 4 * parameters,
            "conventional_checkpoint_extra": 14 * parameters,
        }
        report["restore_bytes"] = {"params_only": 2 * parameters, "full_state": 14 * parameters}
        first, last = report["losses"][min(report["losses"])], report["losses"][max(report["losses"])]
        _say("")
        _say(f"loss {first:.4f} -> {last:.4f} over {steps} steps; committed {stats['committed_step']}, "
             f"skipped {stats['steps_skipped']}, durable {stats['durable_step']}")
        _say(f"per step over the host link: {4 * parameters:,} bytes (fp16 grads in, fp16 params out); "
             f"a conventional per-step checkpoint adds {14 * parameters:,}")
        _say(f"restore: {2 * parameters:,} bytes of params vs {14 * parameters:,} of full state")
        out = Path(args.output) if getattr(args, "output", None) else Path("demo-out")
        out.mkdir(exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        _say(f"report: {out / 'report.json'}")
        if last >= first:
            _say("loss did not decrease")
            return 1
        return 0
    finally:
        run.stop()
        if not args.backing:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    from cossd.tools.cli import main as cli_main

    sys.exit(cli_main(["demo", *sys.argv[1:]]))
