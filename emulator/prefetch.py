"""Warming a stopped device's committed params into the page cache, from the standard library alone, while the mount daemon is still starting.

Why: a restart's first job is to hand the trainer its params (2 B an element), and a daemon
spends most of its start-up importing (numpy, trio, pyfuse3, its own modules), with the
disk idle. The mount daemon's entry calls `start` before any of those imports: a worker
process finds each namespace's newest superblock slot, works out where the params of the copy it
names lie, and asks the kernel to read them ahead (POSIX_FADV_WILLNEED, which queues the
reads and returns). The reads then overlap the imports, and the trainer's first reads find
the pages in memory. Linux reads at most the disk's read-ahead window (read_ahead_kb) for
one WILLNEED, whatever the length asked, so the params are asked for a window at a time.

It is a hint, never trusted: nothing here is served. The slot is picked by its sequence
number alone (its checksum needs the kernels, which are not imported yet); a torn or stale
slot only means the wrong bytes were read ahead. Recovery at open and the param checksums
decide what is served, as without it. Only a quarter of the memory available is read
ahead, so a state larger than RAM does not push out the page cache it would need.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

from .geometry import FORMAT_VERSION, SLOT_COUNT, SLOT_PREFIX, SUPERBLOCK_MAGIC, Copy, plan_spec_layout

log = logging.getLogger("cossd.emulator.prefetch")

PARAM_ITEMSIZE = 2  # FP16/BF16 params, as every namespace stores them
MEMORY_SHARE = 4  # read ahead at most 1/MEMORY_SHARE of MemAvailable
DEFAULT_WINDOW = 128 << 10  # Linux's own default read-ahead, where the disk's is not found


class ParamRange(NamedTuple):
    """One tensor's params in the copy a namespace's newest slot names."""

    path: Path
    offset: int
    length: int


def _newest_copy(directory: Path) -> int | None:
    """The copy (0 = A, 1 = B) named by the slot with the highest sequence number among
    those that start as a slot of this format should; None where none does."""
    best: tuple[int, int] | None = None
    for index in range(SLOT_COUNT):
        try:
            with open(directory / f"sb.{index}", "rb") as stream:
                prefix = stream.read(SLOT_PREFIX.size)
        except OSError:
            continue
        if len(prefix) < SLOT_PREFIX.size:
            continue
        magic, version, _crc, seq, _step, copy, _flags = SLOT_PREFIX.unpack(prefix)
        if magic != SUPERBLOCK_MAGIC or version != FORMAT_VERSION:
            continue
        if best is None or seq > best[0]:
            best = (seq, copy & 1)
    return None if best is None else best[1]


def namespace_params(directory: Path) -> list[ParamRange]:
    """Where a namespace's committed params lie, as far as its meta.json and slots tell;
    empty where they do not (a namespace being created, damaged media: open will say)."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        spec = meta["spec"]
        tensors = [(str(entry[0]), int(entry[1])) for entry in spec["tensors"]]
        # NamespaceSpec.layout's rule (geometry.plan_spec_layout), which needs no numpy;
        # tests/unit/test_restart_prefetch.py holds the ranges to the namespace's own.
        layouts, _ = plan_spec_layout(tensors, str(spec.get("state_dtype", "fp32")))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return []
    copy = _newest_copy(directory)
    if copy is None:
        return []
    path = directory / f"state.{Copy(copy).name}"
    return [ParamRange(path, tensor.param_offset, tensor.numel * PARAM_ITEMSIZE) for tensor in layouts]


def memory_available() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def readahead_window(path: Path) -> int:
    """The read-ahead window of the block device holding `path` (its queue's read_ahead_kb),
    in bytes; DEFAULT_WINDOW where there is none to read (tmpfs, where WILLNEED reads
    nothing anyway)."""
    try:
        device = os.stat(path).st_dev
        node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
        # A partition has no queue of its own: its disk, one level up, has.
        queue = node / "queue" if (node / "queue").is_dir() else node.resolve().parent / "queue"
        return max(DEFAULT_WINDOW, int((queue / "read_ahead_kb").read_text()) << 10)
    except (OSError, ValueError):
        return DEFAULT_WINDOW


def prefetch_params(backing: Path, budget: int | None = None) -> int:
    """Ask the kernel to read ahead the committed params of every namespace on `backing`,
    in namespace and tensor order, up to `budget` bytes (default: a quarter of the memory
    available). Returns the bytes asked for."""
    budget = memory_available() // MEMORY_SHARE if budget is None else budget
    try:
        directories = sorted(entry for entry in (backing / "ns").iterdir() if entry.is_dir())
    except OSError:
        return 0
    asked = 0
    for directory in directories:
        pieces = namespace_params(directory)
        window = readahead_window(pieces[0].path) if pieces else DEFAULT_WINDOW  # one copy holds them all
        for piece in pieces:
            length = min(piece.length, budget - asked)
            if length <= 0:
                return asked
            try:
                # O_NOFOLLOW, as the device opens its copies: never read through a link.
                fd = os.open(piece.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                end = piece.offset + length
                for offset in range(piece.offset, end, window):
                    os.posix_fadvise(fd, offset, min(window, end - offset), os.POSIX_FADV_WILLNEED)
                asked += length
            except OSError:
                pass
            finally:
                os.close(fd)
    return asked


def start(backing: str | os.PathLike[str]) -> bool:
    """prefetch_params in a process of its own, which logs what it asked for and exits;
    False where it could not be started (the params are then read as the trainer asks).

    A process, not a thread: WILLNEED waits for room in the disk's queue once a window at a
    time, and a thread would then wait for the GIL, held by the imports it should overlap,
    after each window, leaving the disk idle. Forked while the daemon is small and has no
    threads (before its imports), so the fork is cheap and safe; forked twice, so that it
    belongs to init and the daemon has no child to reap."""
    try:
        child = os.fork()
    except OSError as exc:
        log.warning("params not read ahead: %s", exc)
        return False
    if child:
        os.waitpid(child, 0)  # at once: the child only forks the worker
        return True
    code = 0
    try:
        if os.fork() == 0:
            started = time.perf_counter()
            asked = prefetch_params(Path(backing))
            if asked:
                log.info("asked the kernel to read %.0f MiB of committed params ahead (%.3f s)",
                         asked / 2**20, time.perf_counter() - started)
    except BaseException:  # never let a child run on into the daemon's code
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)
