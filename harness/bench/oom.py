"""`cossd bench`'s oom section: per-step checkpoints under a cgroup memory cap and a throttled sink: DCP async_save, the tiered checkpointer, cossd offload.

Each method trains the same model in a worker process of its own (harness/oom/worker.py),
placed in a fresh cgroup v1 memory group (the cap) and blkio group (the sink's write
throttle) before it allocates anything. The bench samples the group's memory every ~50 ms
and reports what happened: the peak, an OOM kill or a failure (never counted as success),
the steps done, the stall per step and the bytes written. oom_report.py draws and
tabulates it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .. import cgroups
from ..measure import say
from ..oom.sink import SinkUnavailable, SyncSink
from ..oom.targets import BUCKET, Drive, Store

METHODS = ("dcp", "tiered", "cossd")
LABELS = {"dcp": "PyTorch DCP async_save, no wait", "tiered": "cossd.trainer.TieredCheckpointer",
          "cossd": "cossd offload (cossd.trainer.AdamW)"}
MIB = 1 << 20


@dataclasses.dataclass
class OomSettings:
    """The section's model, cap and sink. The cap is each worker's own footprint once training
    has warmed up (model, grads, optimizer state, torch itself) plus `budget` versions of the
    resident state: what checkpointing may use on top of training."""

    d_model: int = 1024
    layers: int = 2
    heads: int = 8
    context: int = 64
    batch: int = 4
    steps: int = 10
    budget: float = 2.5           # versions of the state the cap leaves for checkpointing
    pool: float = 2.0             # the tiered checkpointer's memory pool, in versions (within the budget)
    spill: float = 4.0            # its spill dir's bound, in versions
    sink_bytes_per_s: int = 32 * MIB
    max_stall_s: float = 1.0      # the longest a tiered save waits for pool room before coalescing
    chunk_bytes: int = 8 * MIB
    max_concurrency: int = 2      # parts in flight to the store: each is a chunk-sized copy
    drain_s: float = 30.0         # close() of the tiered checkpointer, and the drive's archive, wait this long
    run_s: float = 150.0          # the longest a worker may run after warm-up before it is stopped
    sample_s: float = 0.05
    probe_bytes: int = 0          # the throttle probe's write (0: two seconds' worth at the limit)
    archive_every: int = 5        # cossd's drive archives a version to the store every K steps (0: off)
    methods: tuple[str, ...] = METHODS

    def model(self) -> dict[str, int]:
        return {"d_model": self.d_model, "layers": self.layers, "heads": self.heads, "context": self.context}


def oom_costs(workdir: Path, settings: OomSettings) -> dict[str, Any]:
    """The section's report, or {"measured": False, "why": "not measured: ..."} where this
    machine has no cgroup v1 memory and blkio controllers, no root, no loop devices, or a
    throttle that does not bind."""
    why = cgroups.unavailable()
    if why is not None:
        return {"measured": False, "why": f"not measured: {why}"}
    state_bytes = resident_state_bytes(settings)
    try:
        # Room for every version DCP could write before it is killed, or the spill dir's bound.
        sink = SyncSink(workdir, int(max(settings.steps, settings.spill + 1) * (state_bytes + MIB) * 1.1) + (256 * MIB))
    except (SinkUnavailable, ValueError) as exc:
        return {"measured": False, "why": f"not measured: no sink ({exc})"}
    with sink:
        return _measure(workdir, sink, settings, state_bytes)


def _measure(workdir: Path, sink: SyncSink, settings: OomSettings, state_bytes: int) -> dict[str, Any]:
    probe = throttle_probe(sink.mountpoint, sink.disk, settings)
    setup: dict[str, Any] = {
        "model": settings.model(), "batch": settings.batch, "steps": settings.steps,
        "budget_versions": settings.budget, "pool_versions": settings.pool, "spill_versions": settings.spill,
        "sink": {"kind": "blkio write throttle", "disk": sink.disk, "filesystem": sink.describe(),
                 "write_bytes_per_s": settings.sink_bytes_per_s, "probe": probe},
        "max_stall_s": settings.max_stall_s, "chunk_bytes": settings.chunk_bytes,
        "max_concurrency": settings.max_concurrency, "sample_s": settings.sample_s,
        "archive_every": settings.archive_every, "resident_state_bytes": state_bytes,
    }
    if not probe["binds"]:
        return {"measured": False, "setup": setup,
                "why": (f"not measured: the blkio throttle does not bind here (a write in the group ran at "
                        f"{probe['bytes_per_s'] / MIB:.0f} MiB/s against a {settings.sink_bytes_per_s / MIB:.0f} "
                        "MiB/s limit)")}
    say(f"  oom: sink {sink.describe()}, writes throttled to {settings.sink_bytes_per_s / MIB:.0f} MiB/s "
        f"(probe: {probe['bytes_per_s'] / MIB:.1f} MiB/s)")
    methods: dict[str, Any] = {}
    with Store(workdir / "store") as store, Drive(workdir / "drive", store) as drive:
        setup["store"] = store.describe()
        for method in settings.methods:
            directory = sink.mountpoint / method
            directory.mkdir()
            config: dict[str, Any] = {"method": method, "model": settings.model(), "batch": settings.batch,
                                      "steps": settings.steps, "sink": str(directory),
                                      "resident_state_bytes": state_bytes}
            if method == "tiered":
                if store.why is not None:
                    methods[method] = {"label": LABELS[method], "measured": False, "why": store.why}
                    continue
                config |= {"store_url": f"s3://{BUCKET}/run-{os.getpid()}", "endpoint": store.endpoint,
                           # A version is the state plus its header, each tensor 64-byte aligned:
                           # a MiB of room a version for that, so `pool` versions fit.
                           "tiered": {"memory_bytes": int(settings.pool * (state_bytes + MIB)),
                                      "spill_bytes": int(settings.spill * (state_bytes + MIB)),
                                      "chunk_bytes": settings.chunk_bytes, "max_stall_s": settings.max_stall_s,
                                      "max_concurrency": settings.max_concurrency, "drain_s": settings.drain_s}}
            on_warm = None
            if method == "cossd":
                config |= {"mount": str(drive.mountpoint), "namespace": "oom"}
                if settings.archive_every and store.why is None:
                    # The namespace exists once the worker has warmed up: from then on the
                    # drive archives it by itself, from its side of the link.
                    def on_warm() -> None:
                        drive.archive_every("oom", settings.archive_every, f"s3://{BUCKET}/drive-{os.getpid()}")
            # Each method starts on a quiet disk: what the one before left dirty is written now.
            os.sync()
            methods[method] = run_worker(method, config, settings, sink.disk, store, on_warm)
            # What its files hold as it ended (DCP's checkpoints, cut or not; the spill files
            # the tiered checkpointer had not deleted yet).
            methods[method]["sink_file_bytes"] = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            if on_warm is not None and methods[method].get("steps_done") and "on_warm_error" not in methods[method]:
                try:
                    methods[method]["drive_archive"] = drive.archive_report("oom", settings.drain_s)
                except Exception as exc:  # the drive's log page could not be read: said, not hidden
                    methods[method]["drive_archive"] = {"error": f"{type(exc).__name__}: {exc}"}
            shutil.rmtree(directory, ignore_errors=True)
            _say_row(methods[method])
    return {"measured": True, "setup": setup, "methods": methods}


def throttle_probe(directory: Path, disk: str, settings: OomSettings) -> dict[str, Any]:
    """Whether the throttle binds: a process in a throttled group writes a file into the sink
    (plain buffered writes, no fsync: the sink's sync mount is what makes them pass the
    throttle); binds when it ran at no more than 1.5x the limit."""
    size = settings.probe_bytes or 2 * settings.sink_bytes_per_s
    path = directory / "throttle-probe"
    group = cgroups.BlkioThrottle(f"cossd-oom-probe-{os.getpid()}", disk, settings.sink_bytes_per_s)
    code = ("import os, sys, time\n"
            "sys.stdin.readline()\n"
            "block = os.urandom(1 << 20)\n"
            "started = time.perf_counter()\n"
            f"with open({str(path)!r}, 'wb') as f:\n"
            f"    for _ in range({max(1, size >> 20)}):\n"
            "        f.write(block)\n"
            "print(time.perf_counter() - started)\n")
    try:
        process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
        group.add(process.pid)
        out, _ = process.communicate("go\n", timeout=120)
        seconds = float(out.strip())
        written = group.written()
    finally:
        group.remove()
        path.unlink(missing_ok=True)
    rate = max(1, size >> 20) * MIB / seconds
    return {"bytes": max(1, size >> 20) * MIB, "seconds": seconds, "bytes_per_s": rate,
            "group_bytes_written": written, "binds": rate <= 1.5 * settings.sink_bytes_per_s}


def run_worker(method: str, config: dict[str, Any], settings: OomSettings, disk: str, store: Any,
               on_warm: Callable[[], None] | None = None) -> dict[str, Any]:
    """One worker in its cgroups, sampled until it exits (or run_s passes: then stopped);
    on_warm runs once its first warm-up step is done."""
    name = f"cossd-oom-{os.getpid()}-{method}"
    # Until warm-up the cap is loose (half the machine): the trainer's own footprint decides it.
    memory = cgroups.MemoryGroup(name, _mem_total() // 2)
    throttle = cgroups.BlkioThrottle(name, disk, settings.sink_bytes_per_s)
    row: dict[str, Any] = {"label": LABELS[method], "measured": True, "steps_asked": settings.steps}
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if method == "tiered":
        env |= store.credentials()
    log = tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-m", "cossd.harness.oom.worker", json.dumps(config)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    events: list[dict[str, Any]] = []
    reader = threading.Thread(target=_read_events, args=(process, events), daemon=True)
    reader.start()
    try:
        memory.add(process.pid)
        throttle.add(process.pid)
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
        if _wait_for(events, "warm", process, timeout_s=300) is None:
            return row | _failure(process, log, "did not warm up")
        if on_warm is not None:
            try:
                on_warm()
            except Exception as exc:  # the drive refused its policy: the row says so, the run goes on
                row["on_warm_error"] = f"{type(exc).__name__}: {exc}"
        _reset_peak(memory)
        _go(process)
        sampler = _Sampler(memory, settings.sample_s)  # from the warm-up step on: the figure shows it
        try:
            ready = _wait_for(events, "ready", process, timeout_s=300)
            if ready is None:
                return row | _failure(process, log, "did not warm up")
            # The trainer's own footprint: the group's peak over a step of training alone
            # (activations included), torch and the model and optimizer state beneath it.
            footprint, footprint_anon = memory.max_usage(), sampler.peak_anon()
            # The same room for checkpointing in every worker: cossd's state is on the drive,
            # and it gets what the resident trainers get.
            cap = footprint + int(settings.budget * config["resident_state_bytes"])
            memory.set_limit(cap)
            _reset_peak(memory)
            sampler.mark()
            _go(process)
            try:
                process.wait(timeout=settings.run_s)
            except subprocess.TimeoutExpired:
                process.kill()  # the outcome says it was stopped, never that it completed
                process.wait()
            sampler.exited()
        finally:
            series = sampler.stop()
        row |= {"parameters": ready["parameters"], "state_bytes": ready["state_bytes"], "footprint_bytes": footprint,
                "footprint_anon_bytes": footprint_anon, "cap_bytes": cap}
        row |= _outcome(process, memory, events, log)
        row["bytes_to_sink"] = throttle.written()
        after = [i for i, t in enumerate(series["t"]) if t >= 0]
        row["peak_bytes"] = max([series["usage"][i] for i in after] + [memory.max_usage()])
        row["peak_anon_bytes"] = max((series["anon"][i] for i in after), default=0)
        # What checkpointing added: by the cap's count (page cache included: it fills what is
        # free under the cap, and is reclaimed first), and in anonymous memory (buffers).
        row["checkpoint_memory_bytes"] = max(0, row["peak_bytes"] - footprint)
        row["checkpoint_anon_bytes"] = max(0, row["peak_anon_bytes"] - footprint_anon)
        row["run_s"] = series["t"][-1] if series["t"] else 0.0
        # MiB with one decimal: the figure's resolution, and a report a reader can open.
        row["series_mib"] = {"t": series["t"]} | {key: [round(v / MIB, 1) for v in series[key]]
                                                  for key in ("usage", "anon", "cache")}
        return row
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        reader.join(timeout=5)
        log.close()
        memory.remove()
        throttle.remove()


def resident_state_bytes(settings: OomSettings) -> int:
    """What a resident trainer checkpoints: FP32 params and AdamW's two moments (and each
    param's step counter), counted on a model built on the meta device (no memory)."""
    import torch

    from ..gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**settings.model()))
    params = list(model.parameters())
    return sum(12 * p.numel() + 4 for p in params)


def _reset_peak(memory: cgroups.MemoryGroup) -> None:
    """memory.max_usage_in_bytes counts from now (a write of 0 resets it)."""
    (memory.path / "memory.max_usage_in_bytes").write_text("0")


def _read_events(process: subprocess.Popen[str], events: list[dict[str, Any]]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a library's print: not the worker's


def _wait_for(events: list[dict[str, Any]], kind: str, process: subprocess.Popen[str],
              timeout_s: float) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((e for e in events if e["event"] == kind), None)
        if found is not None or process.poll() is not None:
            return found
        time.sleep(0.05)
    return None


def _go(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


class _Sampler:
    """The group's memory every `interval` s on a thread of its own: usage (what the cap acts
    on), anon (memory.stat's rss + shmem: what the process allocated) and cache (page cache
    charged to the group). Times are seconds from mark(), negative before it."""

    def __init__(self, memory: cgroups.MemoryGroup, interval: float) -> None:
        self.memory, self.interval = memory, interval
        self.samples: list[tuple[float, int, int, int]] = []
        self.origin: float | None = None
        self._exit: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cossd-oom-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                usage, stat = self.memory.usage(), self.memory.stat()
            except OSError:
                return
            self.samples.append((time.monotonic(), usage, stat.get("rss", 0) + stat.get("shmem", 0),
                                 stat.get("cache", 0)))
            self._stop.wait(self.interval)

    def peak_anon(self) -> int:
        return max((anon for _, _, anon, _ in list(self.samples)), default=0)

    def mark(self) -> None:
        self.origin = time.monotonic()

    def exited(self) -> None:
        """The worker is gone: samples after this are the empty group, not the worker."""
        self._exit = time.monotonic()

    def stop(self) -> dict[str, list[Any]]:
        self._stop.set()
        self._thread.join()
        origin = self.origin if self.origin is not None else time.monotonic()
        end = self._exit
        if end is not None:
            # The last sample before the exit is where a killed worker stood when it was killed.
            self.samples = [sample for sample in self.samples if sample[0] <= end] or self.samples[:1]
        return {"t": [round(t - origin, 3) for t, *_ in self.samples], "usage": [s[1] for s in self.samples],
                "anon": [s[2] for s in self.samples], "cache": [s[3] for s in self.samples]}


def _outcome(process: subprocess.Popen[str], memory: cgroups.MemoryGroup, events: list[dict[str, Any]],
             log: Any) -> dict[str, Any]:
    """What became of the run: completed, killed by the OOM killer, failed (with the error), or
    stopped at run_s; its steps, stalls and what it said it wrote."""
    import statistics

    time.sleep(0.2)  # the reader's last lines
    steps = [e for e in events if e["event"] == "step"]
    done = next((e for e in events if e["event"] == "done"), None)
    oom_kills = memory.oom_control().get("oom_kill", 0)
    failcnt = memory.failcnt()
    code = process.returncode
    if done is not None and code == 0:
        outcome, error = "completed", None
    elif code == -9 and oom_kills:
        outcome, error = "killed by the OOM killer", None
    elif code == -9:
        outcome, error = "stopped by the bench after run_s", None
    else:
        outcome, error = "failed", _tail(log)
    stalls = [e["stall_s"] for e in steps]
    return {"outcome": outcome, "oom_killed": outcome == "killed by the OOM killer", "error": error,
            "exit_code": code, "oom_kills": oom_kills, "failcnt": failcnt, "steps_done": len(steps),
            "stall_mean_s": statistics.fmean(stalls) if stalls else None,
            "stall_max_s": max(stalls) if stalls else None,
            "stall_median_s": statistics.median(stalls) if stalls else None,
            "step_mean_s": statistics.fmean(e["step_s"] for e in steps) if steps else None,
            "done": {k: v for k, v in (done or {}).items() if k not in ("event", "t")}}


def _failure(process: subprocess.Popen[str], log: Any, what: str) -> dict[str, Any]:
    process.kill()
    process.wait()
    return {"outcome": "failed", "oom_killed": False, "error": f"{what}: {_tail(log)}", "exit_code": process.returncode,
            "steps_done": 0}


def _tail(log: Any) -> str:
    log.seek(0)
    lines = [line for line in log.read().decode(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-600:]


def _mem_total() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def _say_row(row: dict[str, Any]) -> None:
    if not row.get("measured"):
        say(f"  oom, {row['label']}: {row['why']}")
        return
    stall = f"{row['stall_mean_s'] * 1e3:.0f} ms mean" if row.get("stall_mean_s") is not None else "no step"
    say(f"  oom, {row['label']}: {row['outcome']} after {row['steps_done']}/{row['steps_asked']} steps; peak "
        f"{row.get('peak_bytes', 0) / MIB:.0f} MiB against a cap of {row.get('cap_bytes', 0) / MIB:.0f} MiB "
        f"(footprint {row.get('footprint_bytes', 0) / MIB:.0f} MiB); stall {stall}")
