"""Options of `cossd demo` and `cossd bench`, kept free of torch so `cossd --help` stays quick."""
from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

DTYPE_NAMES = ("bf16", "fp16")


@dataclasses.dataclass
class Settings:
    steps: int
    crash_at: int
    model: str
    batch: int
    lr: float
    weight_decay: float
    interval: int
    dcp_steps: int
    device: str
    dtype: str
    seed: int
    output: Path
    # The cossd runs train through a storage server on loopback (cossd://) instead of a mount.
    remote: bool = False

    def lr_at(self, step: int) -> float:
        """Linear warmup over 10% of the run, then cosine decay to 10%."""
        warmup = max(1, self.steps // 10)
        if step <= warmup:
            return self.lr * step / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))



def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--crash-at", type=int, default=None,
                        help="step in the middle of which the daemon is killed (default: steps/2)")
    parser.add_argument("--model", default="small", choices=("tiny", "small", "medium"),
                        help="model size: tiny ~0.1M, small ~3.3M (default), medium ~10.8M params")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--weight-decay", type=float, default=0.1,
                        help="AdamW weight decay of every method (default: %(default)s)")
    parser.add_argument("--checkpoint-interval", type=int, default=1,
                        help="steps between the conventional baselines' checkpoints (default 1)")
    parser.add_argument("--dcp-steps", type=int, default=None,
                        help="steps of the DCP async_save baseline (default: --steps)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the model trains (default cpu)")
    parser.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                        help="half precision of model, grads and params (default bf16; fp16 runs without loss "
                             "scaling, and CPUs without fp16 matmul units are slow at it)")
    parser.add_argument("--backing", type=Path, default=None,
                        help="an existing backing directory to use (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the model's initial weights and the data (default: %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("demo-out"),
                        help="directory for report.json and demo.png (default ./demo-out)")
    parser.add_argument("--remote", action="store_true",
                        help="train the cossd runs through a storage server (`cossd serve` on 127.0.0.1 with a "
                             "token; the trainer speaks cossd://, no FUSE): the server is the one killed -9 "
                             "mid-step and restarted; the baselines then write through a mount of the same "
                             "device as usual")


def settings_from(args: argparse.Namespace) -> Settings:
    if args.steps < 2:
        raise ValueError("--steps must be at least 2")
    crash_at = args.crash_at if args.crash_at is not None else max(2, args.steps // 2)
    if not 2 <= crash_at <= args.steps:
        raise ValueError(f"--crash-at must be in 2..{args.steps}")
    dtype = args.dtype or "bf16"
    dcp_steps = args.dcp_steps if args.dcp_steps is not None else args.steps
    if args.checkpoint_interval < 1 or not 1 <= dcp_steps <= args.steps:
        raise ValueError("--checkpoint-interval must be >= 1 and --dcp-steps in 1..--steps")
    return Settings(steps=args.steps, crash_at=crash_at, model=args.model, batch=args.batch, lr=args.lr,
                    weight_decay=args.weight_decay, interval=args.checkpoint_interval, dcp_steps=dcp_steps,
                    device=args.device, dtype=dtype, seed=args.seed, output=args.output,
                    remote=getattr(args, "remote", False))


BENCH_SECTIONS = frozenset({"kernel", "mount", "trainer", "net", "oom", "ranks", "devices", "scale", "peers",
                            "formats", "frameworks"})
# `net` starts storage servers and takes a minute and a half; `oom` makes cgroups (root) and
# drives workers into their memory caps for a few minutes; `ranks` runs 7 jobs of up to 4 rank
# processes; `devices` starts up to 4 daemons for 3 jobs; `scale` steps namespaces up to 1B elements (30 GB of state on the disk, most of an
# hour): each asked for by name, not by default.
DEFAULT_BENCH_SECTIONS = frozenset({"kernel", "mount", "trainer"})
# The frameworks section's figure tests (harness/bench/frameworks.py runs them; all of them
# take about ten minutes on 2 cores; --frameworks picks some).
BENCH_FRAMEWORKS = ("plain", "hf", "deepspeed", "dcp", "torchtitan")


def parse_bench_frameworks(text: str) -> list[str]:
    """`--frameworks a,b`: names of BENCH_FRAMEWORKS in its order; an unknown one refused by name."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BENCH_FRAMEWORKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown framework(s) {unknown or [text]}: choose from "
                                         f"{', '.join(BENCH_FRAMEWORKS)}")
    return [name for name in BENCH_FRAMEWORKS if name in names]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_SIZE_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1 << 30}


def _element_sizes(text: str) -> list[int]:
    """'1M,16M' -> [1048576, 16777216]: K, M and G (or B, as in "1B parameters") are powers of 2."""
    sizes = []
    for part in (piece.strip().upper() for piece in text.split(",") if piece.strip()):
        digits, suffix = (part[:-1], part[-1]) if part[-1] in _SIZE_SUFFIXES else (part, "")
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"sizes are counts like 64K, 16M or 1B, comma separated; got {text!r}")
        sizes.append(int(digits) * _SIZE_SUFFIXES[suffix])
    if not sizes:
        raise argparse.ArgumentTypeError(f"no sizes in {text!r}")
    return sorted(set(sizes))


def _bench_sections(text: str) -> frozenset[str]:
    chosen = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = chosen - BENCH_SECTIONS
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"sections are {', '.join(sorted(BENCH_SECTIONS))}; got {text!r}")
    return chosen


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--elements", type=int, default=1 << 24,
                        help="elements for the kernel runs (default 16M: 448 MB of state traffic per step)")
    parser.add_argument("--file-elements", type=int, default=1 << 24,
                        help="elements of the tensor behind the mount (default 16M)")
    parser.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="thread counts for the kernel runs, comma separated (default 1,2)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure; the median is reported (default: %(default)s)")
    parser.add_argument("--rounds", type=_positive_int, default=3,
                        help="kernel section: fresh buffer allocations, each timed --repeat times per "
                             "contender (default 3)")
    parser.add_argument("--sections", type=_bench_sections, default=DEFAULT_BENCH_SECTIONS,
                        help="what to measure, comma separated: kernel (in memory), mount (file path, "
                             "checkpoint, restore through a mount), trainer (one optimizer step as the "
                             "trainer sees it: state resident on --device with a per-step checkpoint, "
                             "against cossd offload), net (the step through a storage server on loopback "
                             "against a plain TCP socket pair and the local steps, and the I/O-path "
                             "comparison), oom (per-step checkpoints under a cgroup memory cap with a "
                             "throttled sink: DCP async_save, the tiered checkpointer, cossd offload; root), "
                             "ranks (the sharded optimizer at 1, 2 and 4 ranks on one namespace: step time "
                             "and bytes per rank), devices (one optimizer over 1, 2 and 4 devices, each its "
                             "own daemon, a GPT-shaped model whose embedding is 30%% of its params: step time, "
                             "each device's share of elements and time, the bytes on each link), scale (one step through the CMB and through the files at "
                             "--scale-sizes on fresh devices backed by the temp dir's disk: step time, bytes "
                             "moved, the daemon's peak RSS, growth exponents, the disk's dd figure, and the "
                             "restore at 16M and 256M against torch.load), formats (the CMB step with fp32, "
                             "bf16, fp16 and int8 moments at --file-elements: G el/s and the media bytes the "
                             "device counted per step; the kernel per format at --elements beside torchao's "
                             "and bitsandbytes' 8-bit AdamW on the CPU where they import); frameworks (the checkpoint "
                             "of the plain loop, HF Trainer, DeepSpeed ZeRO-1/2/3, FSDP2 + DCP and torchtitan "
                             "with torch.optim.AdamW and with cossd: bytes, save stall, restore; runs their "
                             "slow figure tests, minutes); peers (a GPT at --peers-params trained by cossd "
                             "through the CMB (gradients at step(), streamed, streamed with BF16 moments, and "
                             "streamed into a second device whose media is in RAM), DeepSpeed ZeRO-Infinity's NVMe offload on the disk and on "
                             "the device, ZeRO-Offload, resident AdamW with DCP async_save every step and with "
                             "no checkpoint (the floor), pinned and unpinned: step time, bytes to storage, save "
                             "stall, restore after kill -9, peak RSS, the timing model's check; root (an ext4 "
                             "volume on a loop device), about 25 minutes at the default sizes); "
                             "default kernel,mount,trainer")
    parser.add_argument("--scale-sizes", type=_element_sizes, default=[1 << 20, 1 << 24, 1 << 28, 1 << 30],
                        help="scale section: namespace sizes in elements, comma separated, K/M/G(B) as powers "
                             "of 2 (default 1M,16M,256M,1B; e.g. 1M,16M for a quick run)")
    parser.add_argument("--rank-elements", type=_positive_int, default=1 << 22,
                        help="ranks section: the model's parameters, in layers of 1024x1024 (default 4M)")
    parser.add_argument("--device-width", type=_positive_int, default=512,
                        help="devices section: the GPT's width (its layers are --device-layers; default 512)")
    parser.add_argument("--device-layers", type=_positive_int, default=4,
                        help="devices section: the GPT's layers (default 4: 18M params at width 512)")
    parser.add_argument("--devices-link", choices=("daemons", "netns"), default="daemons",
                        help="devices section: each device its own FUSE daemon (daemons, the default), or its own "
                             "`cossd serve` in a network namespace of its own reached over a veth pair (netns; root)")
    parser.add_argument("--devices-link-mbit", type=float, default=None,
                        help="devices section with --devices-link netns: a tc tbf rate on each veth, each way, in "
                             "Mbit/s (default: none)")
    parser.add_argument("--net-elements", type=_positive_int, default=1 << 22,
                        help="net section: elements of the served tensor and parameters of the I/O-path "
                             "comparison's model (default 4M)")
    parser.add_argument("--peers-params", type=_element_sizes, default=None,
                        help="peers section: GPT sizes in parameters, comma separated, K/M as powers of 2 "
                             "(default about 25M and 100M; e.g. 1M for a quick run)")
    parser.add_argument("--frameworks", type=parse_bench_frameworks, default=list(BENCH_FRAMEWORKS),
                        help=f"frameworks section: which, comma separated, of {', '.join(BENCH_FRAMEWORKS)} "
                             "(default all; plain alone takes about a minute)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the trainer section keeps the model's tensors: cpu, or cuda for a "
                             "GPU-resident fused AdamW against offload with device-host copies "
                             "(default cpu)")
    parser.add_argument("--output", type=Path, default=Path("bench-out"),
                        help="directory for bench.json, bench.md and bench.png (default ./bench-out)")
