"""One peer of `cossd bench --sections peers` in a process of its own: train a GPT some steps, save, report JSON; or restore after a kill -9.

DeepSpeed's engine, its process group and its JIT ops are process-global, so each peer (and each
turn of it) runs here, started by peers.py with a JSON job on argv[1]. The result is one
line on stdout that starts with RESULT_PREFIX (DeepSpeed prints its own lines around it). After a
"train" job has printed its result it waits: the bench kills it with SIGKILL, and a "restore" job
then brings the trainer back from what the storage kept.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

RESULT_PREFIX = "PEERS-RESULT "
COSSD_PEERS = ("cossd", "cossd_streaming", "cossd_streaming_ram", "cossd_streaming_bf16")  # a cossd device's rows
# The cossd rows whose gradients leave in buckets while backward runs.
STREAMING_PEERS = ("cossd_streaming", "cossd_streaming_ram", "cossd_streaming_bf16")
# The cossd rows whose namespace keeps its moments in fewer bytes (docs/trainer.md#state_dtype).
STATE_DTYPE_OF = {"cossd_streaming_bf16": "bf16"}
TOKENS_PER_STEP = (1, 128)  # batch, context: small, so the optimizer's part of a step shows
LR = 1e-4
SEED = 7


def gpt_shape(params: int) -> dict[str, int]:
    """A GPT config of about `params` parameters: 12 d^2 per layer, d a multiple of 64."""
    layers = 4 if params < 4_000_000 else 8 if params < 50_000_000 else 12
    d_model = max(64, round((params / (12 * layers)) ** 0.5 / 64) * 64)
    return {"d_model": d_model, "layers": layers, "heads": d_model // 64, "context": TOKENS_PER_STEP[1]}


# ---------------------------------------------------------------------- counters


def disk_sectors(disk: str) -> tuple[int, int]:
    """Sectors read and written by `disk` (a name in /proc/diskstats), 512 B each."""
    with open("/proc/diskstats") as stats:
        for line in stats:
            fields = line.split()
            if fields[2] == disk:
                return int(fields[5]), int(fields[9])
    raise KeyError(f"no disk {disk!r} in /proc/diskstats")


class StorageCounter:
    """Bytes between this host and the storage a peer uses, as the storage counts them: a cossd
    namespace's statistics (its host link, or a plain NVM namespace's reads and writes), or
    /proc/diskstats of a block device; None where the job names none."""

    def __init__(self, spec: dict[str, Any] | None) -> None:
        self.spec = spec

    def read(self) -> int | None:
        if self.spec is None:
            return None
        os.sync()  # what the page cache still holds counts now, not in the next reading
        if self.spec["kind"] == "diskstats":
            read, written = disk_sectors(self.spec["disk"])
            return 512 * (read + written)
        from ...client import AdminClient

        with AdminClient(Path(self.spec["mount"])) as admin:
            stats = admin.statistics(admin.nsid(self.spec["namespace"]))
        if stats.get("kind") == "nvm":
            return int(stats["bytes_read"]) + int(stats["bytes_written"])
        return int(stats["model"]["host_link_bytes"])


def _bytes_between(before: int | None, after: int | None) -> int | None:
    """What a StorageCounter counted between two readings (None where it counts nothing)."""
    return None if before is None or after is None else after - before


def device_times(job: dict[str, Any]) -> dict[str, Any] | None:
    """The cossd namespace's own clocks (block updates, flushes), where the job is cossd's, and
    how its new state reaches the media ("pwrite" on a disk's filesystem, "mapped" on tmpfs)."""
    if job["peer"] not in COSSD_PEERS:
        return None
    from ...client import AdminClient

    with AdminClient(Path(job["mount"])) as admin:
        nsid = admin.nsid(job["namespace"])
        stats = admin.statistics(nsid)
        # The media's own count (log page C0h): what a step writes, 14 B an element with FP32
        # moments, 10 with BF16.
        media = int(admin.optimizer_log(nsid)[job["namespace"]]["media_bytes_written"])
    times = {"kernel_ns": int(stats["kernel_ns"]), "flush_ns": int(stats["flush_ns"]),
             "kernel_blocks": int(stats["kernel_blocks"]), "state_writes": stats.get("state_writes"),
             "media_bytes": media}
    if job.get("device_pid"):
        times["cpu_ns"] = process_cpu_ns(int(job["device_pid"]))
    return times


def process_cpu_ns(pid: int) -> int:
    """CPU time a process has used, all its threads, in ns: from its CPU-time clock (the id
    clock_getcpuclockid gives, ((~pid) << 3) | 2 on Linux), as /proc/PID/stat counts only
    in 10 ms ticks, coarse for a few short steps."""
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)
    except OSError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime: the stat fields 14 and 15
        return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.exists() else 0


def drop_cached(directory: Path) -> None:
    """Write back and evict a directory's files from the page cache, so a restore reads storage."""
    for path in directory.rglob("*") if directory.exists() else ():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------- the peers


class Peer:
    """A model and the way it steps; `save` and `restore` where the peer checkpoints."""

    module: Any  # the torch model each kind builds (or DeepSpeed's engine wraps)

    def __init__(self, job: dict[str, Any]) -> None:
        import torch

        from ..gpt import GPT, GPTConfig, StdlibCorpus

        self.job, self.torch = job, torch
        self.config = GPTConfig(**gpt_shape(job["params"]))
        self.corpus = StdlibCorpus(max_bytes=1 << 20)
        self.GPT = GPT

    def model(self, dtype: Any) -> Any:
        self.torch.manual_seed(SEED)
        return self.GPT(self.config).to(dtype=dtype)

    def batch(self, step: int) -> tuple[Any, Any]:
        return self.corpus.batch(step, TOKENS_PER_STEP[0], TOKENS_PER_STEP[1], seed=SEED)

    def step(self, index: int) -> dict[str, float]:
        raise NotImplementedError

    def save(self) -> dict[str, Any]:
        return {"stall_s": 0.0, "bytes": 0, "note": "no checkpoint"}

    def restore(self) -> None:
        raise NotImplementedError

    def parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


class Resident(Peer):
    """FP32 params, BF16 autocast, torch's fused AdamW in the trainer's memory; with
    `checkpoint` a DCP async_save (process mode) of model and optimizer after every step."""

    def __init__(self, job: dict[str, Any], checkpoint: bool) -> None:
        super().__init__(job)
        self.module = self.model(self.torch.float32)
        self.optimizer = self.torch.optim.AdamW(self.module.parameters(), lr=LR, fused=True)
        self.checkpoint = checkpoint
        self.pending: Any = None
        self.saves: list[float] = []
        self.directory = Path(job["checkpoint_dir"]) if checkpoint else None
        if checkpoint:
            _single_process_group()

    def state(self) -> dict[str, Any]:
        """Model and optimizer as DCP's own helpers key them (by parameter name); for a fresh
        optimizer they allocate its state, which a load then fills in place."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def step(self, index: int) -> dict[str, float]:
        torch = self.torch
        started = time.perf_counter()
        tokens, targets = self.batch(index)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.module.loss(tokens, targets)
        loss.backward()
        backward = time.perf_counter()
        self.optimizer.step()
        stepped = time.perf_counter()
        phases = {"forward_backward_s": backward - started, "optimizer_s": stepped - backward}
        if self.checkpoint:
            phases["checkpoint_stall_s"] = self._async_save()
        return phases

    def _async_save(self) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        started = time.perf_counter()
        self._wait()  # DCP keeps one save in flight: the next one waits for the last
        assert self.directory is not None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.pending = dcp.async_save(self.state(), checkpoint_id=str(self.directory),
                                          async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        stall = time.perf_counter() - started
        self.saves.append(stall)
        return stall

    def _wait(self) -> None:
        if self.pending is not None:
            future = getattr(self.pending, "upload_completion", self.pending)
            future.result()
            self.pending = None

    def save(self) -> dict[str, Any]:
        if not self.checkpoint:
            return super().save()
        started = time.perf_counter()
        self._wait()
        assert self.directory is not None
        return {"stall_s": statistics.median(self.saves), "last_save_wait_s": time.perf_counter() - started,
                "bytes": files_bytes(self.directory),
                "note": "DCP async_save (process mode) after every step; the stall is each step's"}

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp

        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not self.checkpoint:
            raise RuntimeError("no checkpoint: nothing to restore")
        state = self.state()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(self.directory))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])


class Cossd(Peer):
    """BF16 params, cossd.trainer.AdamW through the drive's memory buffer (the default);
    every step committed on the drive, so there is no save. `streaming`: each tensor's
    gradients go to the drive as backward makes them, so its kernel runs beside backward.
    The moments are FP32 unless the row names another format (STATE_DTYPE_OF)."""

    def __init__(self, job: dict[str, Any], streaming: bool = False) -> None:
        super().__init__(job)
        from ...trainer import AdamW

        self.module = self.model(self.torch.bfloat16)
        self.optimizer = AdamW(self.module.parameters(), mount=job["mount"], namespace=job["namespace"], lr=LR,
                               streaming=streaming, state_dtype=STATE_DTYPE_OF.get(job["peer"], "fp32"))
        self.transport = "cmb" if self.optimizer.files.cmb() is not None else "files"

    def step(self, index: int) -> dict[str, float]:
        started = time.perf_counter()
        tokens, targets = self.batch(index)
        self.optimizer.zero_grad(set_to_none=True)
        self.module.loss(tokens, targets).backward()
        backward = time.perf_counter()
        self.optimizer.step()
        phases = {"forward_backward_s": backward - started, "optimizer_s": time.perf_counter() - backward}
        return phases | {f"cossd_{key}": value for key, value in self.optimizer.last_timing.items()}

    def save(self) -> dict[str, Any]:
        return {"stall_s": 0.0, "bytes": 0, "note": "every step is committed on the drive: no save"}

    def restore(self) -> None:
        pass  # attaching to the namespace (in __init__) reads the committed params into the model


def _single_process_group() -> None:
    """A gloo group of one (DeepSpeed and DCP's process mode want one), on a free port."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


class DeepSpeedZero(Peer):
    """ZeRO-3 with BF16; the optimizer's state on NVMe (ZeRO-Infinity: `nvme_dir`) or in host
    memory (ZeRO-Offload). save_checkpoint writes a tag under `checkpoint_dir`."""

    def __init__(self, job: dict[str, Any], nvme: bool) -> None:
        super().__init__(job)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _single_process_group()
        import deepspeed

        offload: dict[str, Any] = {"device": "cpu", "pin_memory": False}
        if nvme:
            offload = {"device": "nvme", "nvme_path": job["nvme_dir"], "pin_memory": False, "buffer_count": 4}
        config = {
            "train_micro_batch_size_per_gpu": TOKENS_PER_STEP[0], "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload},
            "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1,
                    "single_submit": False, "overlap_events": True},
            "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
        }
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.engine, *_ = deepspeed.initialize(model=self.model(self.torch.float32), config=config)
        self.module = self.engine.module
        self.directory = Path(job["checkpoint_dir"])
        self.swap_dir = Path(job["nvme_dir"]) if nvme else None

    def parameters(self) -> int:
        return sum(getattr(p, "ds_numel", p.numel()) for p in self.module.parameters())

    def step(self, index: int) -> dict[str, float]:
        started = time.perf_counter()
        tokens, targets = self.batch(index)
        loss = self.module.loss(tokens, targets)
        self.engine.backward(loss)
        backward = time.perf_counter()
        self.engine.step()
        return {"forward_backward_s": backward - started, "optimizer_s": time.perf_counter() - backward}

    def save(self) -> dict[str, Any]:
        started = time.perf_counter()
        self.engine.save_checkpoint(str(self.directory), tag="peers")
        os.sync()  # DeepSpeed does not fsync; a checkpoint is one once it is on the storage
        stall = time.perf_counter() - started
        return {"stall_s": stall, "bytes": files_bytes(self.directory / "peers"),
                "note": "engine.save_checkpoint (with sync)"
                        + (": it copies the swap folder into the tag" if self.swap_dir else "")}

    def restore(self) -> None:
        self.engine.load_checkpoint(str(self.directory), tag="peers")


def make_peer(job: dict[str, Any]) -> Peer:
    peer = job["peer"]
    if peer in COSSD_PEERS:
        return Cossd(job, streaming=peer in STREAMING_PEERS)
    if peer in ("zero_infinity_disk", "zero_infinity_device"):
        return DeepSpeedZero(job, nvme=True)
    if peer == "zero_offload":
        return DeepSpeedZero(job, nvme=False)
    if peer in ("dcp_async", "resident"):
        return Resident(job, checkpoint=peer == "dcp_async")
    raise ValueError(f"unknown peer {peer!r}")


# ---------------------------------------------------------------------- the jobs


def train(job: dict[str, Any]) -> dict[str, Any]:
    counter = StorageCounter(job.get("counter"))
    peer = make_peer(job)
    for index in range(job["warmup"]):
        peer.step(index)
    bytes_before, times_before = counter.read(), device_times(job)
    turns = [peer.step(job["warmup"] + index) for index in range(job["steps"])]
    bytes_after, times_after = counter.read(), device_times(job)
    steps = job["steps"]
    seconds = [sum(v for k, v in turn.items() if not k.startswith("cossd_")) for turn in turns]
    result: dict[str, Any] = {
        "parameters": peer.parameters(), "shape": gpt_shape(job["params"]), "step_seconds": seconds,
        "phases_seconds": {key: statistics.median(turn[key] for turn in turns) for key in turns[0]},
        "storage_bytes_per_step": (None if (counted := _bytes_between(bytes_before, bytes_after)) is None
                                   else counted / steps),
    }
    if times_before is not None and times_after is not None:
        result["device_seconds_per_step"] = {
            "block_updates": (times_after["kernel_ns"] - times_before["kernel_ns"]) / 1e9 / steps,
            "flushes": (times_after["flush_ns"] - times_before["flush_ns"]) / 1e9 / steps,
            "blocks": (times_after["kernel_blocks"] - times_before["kernel_blocks"]) / steps}
        if "cpu_ns" in times_before and "cpu_ns" in times_after:
            # The daemon's CPU time over the timed steps (its FUSE and CMB handling, the block
            # updates, the media writes, its background work), and the cores it had.
            result["device_seconds_per_step"]["cpu"] = (times_after["cpu_ns"] - times_before["cpu_ns"]) / 1e9 / steps
            result["device_seconds_per_step"]["cores"] = job["device_cores"]
        result["transport"] = getattr(peer, "transport", None)
        result["state_writes"] = times_after["state_writes"]
        result["media_bytes_per_step"] = (times_after["media_bytes"] - times_before["media_bytes"]) / steps
        result["state_dtype"] = STATE_DTYPE_OF.get(job["peer"], "fp32")
    before = counter.read()
    result["checkpoint"] = peer.save()
    after = counter.read()
    result["checkpoint"]["storage_bytes"] = _bytes_between(before, after)
    result["trainer_peak_rss_bytes"] = peak_rss_bytes()
    return result


def restore(job: dict[str, Any]) -> dict[str, Any]:
    counter = StorageCounter(job.get("counter"))
    for directory in (job.get("checkpoint_dir"), job.get("nvme_dir")):
        if directory:
            drop_cached(Path(directory))
    before = counter.read()
    started = time.perf_counter()
    peer = make_peer(job)
    built = time.perf_counter()
    peer.restore()
    done = time.perf_counter()
    after = counter.read()
    return {"seconds": done - started, "setup_seconds": built - started, "load_seconds": done - built,
            "storage_bytes": _bytes_between(before, after),
            "trainer_peak_rss_bytes": peak_rss_bytes()}


def main(argv: list[str]) -> int:
    job = json.loads(argv[1])
    import torch

    torch.set_num_threads(job["threads"])
    work: Callable[[dict[str, Any]], dict[str, Any]] = train if job["mode"] == "train" else restore
    try:
        result = {"ok": True, "job_id": job["job_id"]} | work(job)
    except Exception as exc:  # noqa: BLE001 - the bench reports why a peer could not run
        result = {"ok": False, "job_id": job["job_id"], "why": f"{type(exc).__name__}: {exc}"[:500]}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    if job["mode"] == "train" and result["ok"] and job.get("wait_for_kill"):
        # The bench's kill -9 lands here, as it would anywhere in a training loop.
        signal.pause()
    os._exit(0)  # DeepSpeed's and DCP's helper threads and processes must not hold the exit


if __name__ == "__main__":
    sys.exit(main(sys.argv))
