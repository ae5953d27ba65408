"""cossd.trainer.TieredCheckpointer: async checkpoints of resident state through a bounded memory pool, a spill dir and S3."""
from __future__ import annotations

import atexit
import collections
import concurrent.futures as futures
import dataclasses
import os
import threading
import time
import warnings
import weakref
from typing import Any

import crc32c
import torch

from . import tier_payload, tier_policy, tier_spill, tier_store
from .tier_store import CorruptVersionError, StoreError

MIB = 1 << 20
MEMORY, SPILL, STORE = "memory", "spill", "store"


class RestoreError(RuntimeError):
    """No complete version could be restored; the message lists what was tried and why it failed."""


class _Cancelled(Exception):
    """The version being uploaded was dropped, or the checkpointer is abandoning its uploads."""


@dataclasses.dataclass(eq=False)
class _Version:
    step: int
    nbytes: int
    chunk_bytes: int
    buffer: torch.Tensor | None = None        # in the memory pool
    spill: dict[str, Any] | None = None       # its spill manifest, once on the local SSD
    archived: bool = False
    uploading: bool = False
    spilling: bool = False
    dropped: bool = False


class TieredCheckpointer:
    """Checkpoints of a model and its optimizer, taken every step without waiting for storage.

    `save(model, optimizer, step)` copies the state into a memory pool of `memory_bytes` (the
    only synchronous part); background threads upload each version to `url`
    (s3://BUCKET/PREFIX) and, when the store is slower than versions arrive, spill versions
    from the pool to `spill_dir` (at most `spill_bytes`). When every tier is full, versions
    not yet archived are coalesced: the newest is kept, intermediate ones dropped, counted in
    stats() and warned of. `restore` loads the newest complete version from the fastest tier
    that holds it. docs/tiers.md describes the tiers, the policy and the objects."""

    def __init__(self, url: str, *, memory_bytes: int, spill_dir: str | os.PathLike[str] | None = None,
                 spill_bytes: int = 0, endpoint_url: str | None = None, chunk_bytes: int = 8 * MIB,
                 max_concurrency: int = 8, initial_concurrency: int = 2, part_latency_target_s: float = 2.0,
                 max_stall_s: float = 5.0, upload_bytes_per_s: float | None = None, part_retries: int = 3) -> None:
        for name, value in (("memory_bytes", memory_bytes), ("spill_bytes", spill_bytes),
                            ("chunk_bytes", chunk_bytes), ("max_concurrency", max_concurrency),
                            ("initial_concurrency", initial_concurrency), ("part_retries", part_retries)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        if spill_bytes < 0 or (spill_bytes > 0) != (spill_dir is not None):
            raise ValueError("spill_dir and spill_bytes go together: a directory and a positive bound, or neither")
        if not tier_store.MIN_CHUNK_BYTES <= chunk_bytes <= tier_store.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be 5 MiB to 1 GiB (S3's part sizes), got {chunk_bytes}")
        if not 1 <= max_concurrency <= 64 or part_retries < 0 or max_stall_s < 0:
            raise ValueError("max_concurrency must be 1-64, part_retries and max_stall_s at least 0")
        self.memory_bytes, self.spill_bytes, self.chunk_bytes = memory_bytes, spill_bytes, chunk_bytes
        self.max_stall_s, self.part_retries = max_stall_s, part_retries
        self._window = tier_policy.AimdWindow(initial_concurrency, max_concurrency, part_latency_target_s)
        self._meter = tier_policy.StoreMeter()
        self._cap = tier_policy.TokenBucket(upload_bytes_per_s) if upload_bytes_per_s is not None else None
        self._store = tier_store.ObjectStore(url, endpoint_url, connections=max_concurrency)
        self._store.check_bucket()
        self._spill = tier_spill.SpillDir(spill_dir) if spill_dir is not None else None

        self._cv = threading.Condition()
        self._versions: dict[int, _Version] = {}
        self._pool_used = 0
        self._spill_used = 0
        self._need = 0                # the room the spiller keeps free in the pool: the last save's size
        self._last_step: int | None = None
        self._retry_at = 0.0          # the uploader's backoff after a failed version
        self._spill_retry_at = 0.0
        self._failures_in_row = 0
        self._stop = False
        self._closing = False
        self._abandon = threading.Event()
        self._report: dict[str, Any] | None = None
        self._counts: collections.Counter[str] = collections.Counter()
        self._floats: dict[str, float] = collections.defaultdict(float)
        self._dropped_steps: collections.deque[int] = collections.deque(maxlen=100)
        self._last_error: str | None = None
        self._memory_peak = 0
        self._spill_peak = 0

        # A prefix belongs to one checkpointer at a time: uploads a killed process left are aborted.
        self._counts["stale_uploads_aborted"] = self._store.abort_stale_uploads()
        self._adopt_spilled(set(self._store.complete_steps()))
        self._executor = futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="cossd-tier-part")
        # Started here, so they share the constructing thread's network namespace.
        self._threads = [threading.Thread(target=self._upload_loop, name="cossd-tier-upload", daemon=True),
                         threading.Thread(target=self._spill_loop, name="cossd-tier-spill", daemon=True)]
        for thread in self._threads:
            thread.start()
        reference = weakref.ref(self)
        atexit.register(lambda: (checkpointer := reference()) is not None and checkpointer._at_exit())

    # ------------------------------------------------------------------ start-up

    def _adopt_spilled(self, archived: set[int]) -> None:
        """Versions a previous checkpointer left in the spill dir: uploaded from there (or
        removed where the store has them already); files of a spill cut short removed."""
        if self._spill is None:
            return
        complete, removed = self._spill.scan()
        self._counts["spill_leftovers_removed"] = len(removed)
        if removed:
            warnings.warn(f"TieredCheckpointer: removed {len(removed)} file(s) of versions whose spill was cut "
                          f"short in {self._spill.path}: {', '.join(removed[:6])}", RuntimeWarning, stacklevel=3)
        for step, record in complete.items():
            if step in archived:
                self._spill.delete(step)
                continue
            self._versions[step] = _Version(step, record["payload_bytes"], record["chunk_bytes"], spill=record)
            self._spill_used += record["payload_bytes"]
            self._counts["adopted_from_spill"] += 1
        self._spill_peak = self._spill_used

    # ------------------------------------------------------------------ save

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
        """Checkpoint `model` and `optimizer` as version `step` (greater than the last saved).
        Returns once the state is copied into the memory pool; waits only while the pool has
        no room (at most max_stall_s, then versions not yet archived are coalesced)."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        with self._cv:
            if self._closing:
                raise RuntimeError("save() on a closed TieredCheckpointer")
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"step {step} is not after the last saved step {self._last_step}")
        layout = tier_payload.plan({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "optimizer_class": type(optimizer).__qualname__}, step)
        if layout.size > self.memory_bytes:
            raise ValueError(f"a version of this state is {layout.size} bytes and the memory pool holds "
                             f"{self.memory_bytes} (memory_bytes): it must hold at least one version")
        started = time.monotonic()
        version = _Version(step, layout.size, self.chunk_bytes)
        with self._cv:
            self._need = layout.size
            waited = self._make_room(layout.size, step, started)
            self._pool_used += layout.size
            self._memory_peak = max(self._memory_peak, self._pool_used)
        stall = time.monotonic() - started
        try:
            # Page-locked where the state is on a GPU, so the copy out of it is a DMA.
            pinned = torch.cuda.is_available() and any(t.is_cuda for t in layout.tensors)
            buffer = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
            tier_payload.write(layout, buffer)
        except BaseException:
            with self._cv:
                self._pool_used -= layout.size
                self._cv.notify_all()
            raise
        copied = time.monotonic() - started - stall
        with self._cv:
            version.buffer = buffer
            old = self._versions.get(step)
            if old is not None:  # a step saved again by an earlier checkpointer: this one replaces it
                self._drop(old, counted=False)
            self._versions[step] = version
            self._last_step = step
            self._counts["saves"] += 1
            self._counts["stalls"] += waited
            self._floats["stall_s_total"] += stall if waited else 0.0
            self._floats["stall_s_max"] = max(self._floats["stall_s_max"], stall if waited else 0.0)
            self._floats["copy_s_total"] += copied
            self._cv.notify_all()
        return {"step": step, "bytes": layout.size, "stall_s": stall if waited else 0.0, "copy_s": copied}

    def _make_room(self, size: int, step: int, started: float) -> bool:
        """Called with the lock held: wait until `size` bytes of the pool are free; True if it had
        to wait. Past max_stall_s, versions in the pool not yet archived are dropped (the
        coalescing rule, tier_policy.coalesce), the one being uploaded included."""
        waited = False
        while self._pool_free() < size:
            self._evict_archived(size)
            if self._pool_free() >= size:
                break
            waited = True
            remaining = started + self.max_stall_s - time.monotonic()
            if remaining > 0:
                self._cv.notify_all()
                self._cv.wait(remaining)
                continue
            # Bytes a spill under way frees when it ends; only the rest is dropped for.
            moving = sum(v.nbytes for v in self._versions.values() if v.spilling and v.buffer is not None)
            short = size - self._pool_free() - moving
            if short > 0:
                in_pool = [tier_policy.Candidate(v.step, v.nbytes, v.uploading) for v in self._versions.values()
                           if v.buffer is not None and not v.archived and not v.dropped and not v.spilling]
                victims = tier_policy.coalesce(in_pool, short, step, include_uploading=True)
                if victims:
                    self._coalesce(victims, f"the memory pool had no room for version {step} after "
                                            f"{self.max_stall_s} s and the spill tier none for them")
                    continue
            self._cv.wait(0.05)  # spills under way end soon: they free the pool
        return waited

    def _pool_free(self) -> int:
        return self.memory_bytes - self._pool_used

    def _release(self, version: _Version) -> None:
        """Lock held: the version's pool buffer freed (never while it is being spilled)."""
        if version.buffer is not None and not version.spilling:
            version.buffer = None
            self._pool_used -= version.nbytes
            self._forget_if_gone(version)

    def _forget_if_gone(self, version: _Version) -> None:
        if version.buffer is None and version.spill is None and not version.spilling and \
                self._versions.get(version.step) is version:
            del self._versions[version.step]

    def _evict_archived(self, size: int) -> None:
        """Lock held: archived versions kept in the pool (for a fast restore) give up their
        room, oldest first, until `size` bytes are free. Not a drop: the store has them."""
        for version in sorted(self._versions.values(), key=lambda v: v.step):
            if self._pool_free() >= size:
                return
            if version.archived:
                self._release(version)

    def _drop(self, version: _Version, counted: bool = True) -> None:
        """Lock held: a version not archived leaves every local tier (an upload of it stops)."""
        version.dropped = True
        self._release(version)
        if version.spill is not None and not version.spilling:
            assert self._spill is not None
            self._spill.delete(version.step)
            self._spill_used -= version.nbytes
            version.spill = None
        if counted:
            self._counts["coalesced"] += 1
            self._dropped_steps.append(version.step)
        if self._versions.get(version.step) is version and not version.spilling:
            del self._versions[version.step]
        self._cv.notify_all()

    def _coalesce(self, steps: list[int], why: str) -> None:
        for step in steps:
            self._drop(self._versions[step])
        warnings.warn(f"TieredCheckpointer: every tier is full ({why}): dropped version(s) "
                      f"{', '.join(map(str, steps))}, not archived ({self._counts['coalesced']} dropped so far); "
                      "the newest version is kept", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ the spill tier

    def _spill_loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    version = self._plan_spill()
                    if version is not None:
                        break
                    wait = self._spill_retry_at - time.monotonic()
                    self._cv.wait(wait if wait > 0 else None)
                version.spilling = True
                self._spill_used += version.nbytes
                self._spill_peak = max(self._spill_peak, self._spill_used)
                buffer = version.buffer
            assert self._spill is not None and buffer is not None
            try:
                record = self._spill.write(version.step, tier_payload.as_memoryview(buffer), version.chunk_bytes)
            except OSError as exc:
                with self._cv:
                    version.spilling = False
                    self._spill_used -= version.nbytes
                    self._counts["spill_errors"] += 1
                    self._last_error = f"spilling version {version.step} to {self._spill.path}: {exc}"
                    self._spill_retry_at = time.monotonic() + 5.0
                    if version.dropped:
                        self._release(version)
                    self._cv.notify_all()
                warnings.warn(f"TieredCheckpointer: {self._last_error}; the spill tier is paused for 5 s",
                              RuntimeWarning, stacklevel=1)
                continue
            with self._cv:
                version.spilling = False
                if version.dropped or version.archived:
                    self._spill.delete(version.step)
                    self._spill_used -= version.nbytes
                    if version.dropped:
                        self._release(version)
                        self._forget_if_gone(version)
                else:
                    version.spill = record
                    self._counts["spilled"] += 1
                    self._release(version)
                self._cv.notify_all()

    def _plan_spill(self) -> _Version | None:
        """Lock held: the pool version to move to the spill dir now, if the pool is short of
        one save's room; spilled versions not archived are coalesced to make spill room."""
        if self._spill is None or time.monotonic() < self._spill_retry_at or self._need == 0:
            return None
        if self._pool_free() >= self._need:
            return None
        self._evict_archived(self._need)
        if self._pool_free() >= self._need:
            return None
        # Versions waiting first, oldest first; the one being uploaded last (it may finish soon).
        movable = sorted((v for v in self._versions.values() if v.buffer is not None and v.spill is None
                          and not (v.archived or v.dropped or v.spilling)), key=lambda v: (v.uploading, v.step))
        for version in movable:
            free = self.spill_bytes - self._spill_used
            if free >= version.nbytes:
                return version
            spilled = [tier_policy.Candidate(v.step, v.nbytes, v.uploading) for v in self._versions.values()
                       if v.spill is not None and not (v.archived or v.dropped or v.spilling)]
            victims = tier_policy.coalesce(spilled, version.nbytes - free, version.step, include_uploading=False)
            if victims:
                self._coalesce(victims, f"the spill dir had no room for version {version.step}")
                return version
        return None

    # ------------------------------------------------------------------ the store

    def _upload_loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    version = self._next_upload()
                    if version is not None:
                        break
                    wait = self._retry_at - time.monotonic()
                    self._cv.wait(wait if wait > 0 else None)
                version.uploading = True
            try:
                self._upload(version)
            except _Cancelled:
                with self._cv:
                    self._counts["uploads_cancelled"] += 1
            except (StoreError, CorruptVersionError, OSError) as exc:
                self._upload_failed(version, exc)
            finally:
                with self._cv:
                    version.uploading = False
                    self._cv.notify_all()

    def _next_upload(self) -> _Version | None:
        """Lock held: the oldest version not archived, unless the store is in its backoff."""
        if time.monotonic() < self._retry_at:
            return None
        waiting = [v for v in self._versions.values() if not (v.archived or v.dropped)
                   and (v.buffer is not None or v.spill is not None)]
        return min(waiting, key=lambda v: v.step) if waiting else None

    def _upload_failed(self, version: _Version, exc: Exception) -> None:
        with self._cv:
            if isinstance(exc, CorruptVersionError):  # its spill file went bad: nothing to upload
                self._counts["spill_corrupt"] += 1
                self._drop(version, counted=False)
                message = f"version {version.step} discarded: {exc}"
            else:
                self._failures_in_row += 1
                self._counts["upload_failures"] += 1
                delay = min(30.0, 0.5 * 2 ** self._failures_in_row)
                self._retry_at = time.monotonic() + delay
                message = (f"uploading version {version.step} failed ({self._failures_in_row} in a row): {exc}; "
                           f"retrying in {delay:.1f} s, versions wait in the memory pool and spill dir meanwhile")
            self._last_error = message
            self._cv.notify_all()
        warnings.warn(f"TieredCheckpointer: {message}", RuntimeWarning, stacklevel=1)

    def _upload(self, version: _Version) -> None:
        """One version: its parts in parallel (as many in flight as the AIMD window allows),
        each retried up to part_retries times, then the data completed and the manifest last."""
        chunk, total = version.chunk_bytes, version.nbytes
        count = -(-total // chunk)
        if count > tier_store.MAX_PARTS:
            raise StoreError(f"version {version.step}: {count} parts of {chunk} bytes is more than S3's "
                             f"{tier_store.MAX_PARTS}; raise chunk_bytes")
        upload_id = self._store.begin(version.step)
        etags: dict[int, str] = {}
        crcs: list[int] = [0] * count
        pending = collections.deque(range(count))
        attempts: collections.Counter[int] = collections.Counter()
        flying: dict[futures.Future[tuple[str, int]], int] = {}
        try:
            while pending or flying:
                while pending and len(flying) < self._window.limit:
                    index = pending.popleft()
                    flying[self._executor.submit(self._put_part, version, upload_id, index,
                                                 attempts[index])] = index
                done, _ = futures.wait(flying, return_when=futures.FIRST_COMPLETED)
                for future in done:
                    index = flying.pop(future)
                    try:
                        etags[index + 1], crcs[index] = future.result()
                    except StoreError:
                        attempts[index] += 1
                        if attempts[index] > self.part_retries:
                            raise
                        pending.appendleft(index)
            record = tier_store.manifest(version.step, total, chunk, crcs,
                                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self._check_live(version)
            self._store.finish(version.step, upload_id, etags, record)
        except BaseException:
            for future in flying:
                future.cancel()
            futures.wait(flying)
            self._store.abort(self._store.key(version.step, tier_store.DATA_OBJECT), upload_id)
            raise
        with self._cv:
            version.archived = True
            self._failures_in_row = 0
            self._counts["archived"] += 1
            if version.spill is not None:
                assert self._spill is not None
                self._spill.delete(version.step)
                self._spill_used -= version.nbytes
                version.spill = None
            self._forget_if_gone(version)
            self._cv.notify_all()

    def _check_live(self, version: _Version) -> None:
        if version.dropped or self._abandon.is_set():
            raise _Cancelled()

    def _read_chunk(self, version: _Version, index: int) -> bytes:
        start = index * version.chunk_bytes
        stop = min(version.nbytes, start + version.chunk_bytes)
        with self._cv:
            self._check_live(version)
            if version.buffer is not None:
                # Copied under the lock: a pool buffer is never freed while a part reads it.
                return bytes(tier_payload.as_memoryview(version.buffer)[start:stop])
            record = version.spill
        assert record is not None and self._spill is not None
        try:
            data = self._spill.read_range(version.step, start, stop)
        except FileNotFoundError:
            self._check_live(version)  # dropped meanwhile
            raise
        if crc32c.crc32c(data) != record["chunks_crc32c"][index]:
            raise CorruptVersionError(f"version {version.step} in the spill dir: chunk {index} does not match "
                                      "its CRC32C")
        return data

    def _put_part(self, version: _Version, upload_id: str, index: int, attempt: int) -> tuple[str, int]:
        if attempt:
            self._abandon.wait(min(5.0, 0.25 * 2 ** attempt))
        data = self._read_chunk(version, index)
        crc = crc32c.crc32c(data)
        if self._cap is not None:
            self._cap.take(len(data), self._abandon)
        self._check_live(version)
        started = time.monotonic()
        try:
            etag = self._store.put_part(version.step, upload_id, index + 1, data)
        except StoreError as exc:
            self._meter.record(started, time.monotonic(), len(data), ok=False)
            self._window.failure()
            with self._cv:
                self._counts["parts_failed"] += 1
                self._last_error = str(exc)
            raise
        ended = time.monotonic()
        self._meter.record(started, ended, len(data), ok=True)
        self._window.success(ended - started)
        with self._cv:
            self._counts["parts_uploaded"] += 1
            self._counts["bytes_uploaded"] += len(data)
        return etag, crc

    # ------------------------------------------------------------------ restore and listing

    def versions(self) -> list[dict[str, Any]]:
        """Every complete version and where it lives: [{"step", "bytes", "tiers", "state"}],
        ascending. "bytes" is None for a version only in the store (not read to list it)."""
        rows: dict[int, dict[str, Any]] = {}
        with self._cv:
            for v in self._versions.values():
                tiers = [t for t, here in ((MEMORY, v.buffer is not None), (SPILL, v.spill is not None)) if here]
                if tiers and not v.dropped:
                    state = "archived" if v.archived else "uploading" if v.uploading else "waiting"
                    rows[v.step] = {"step": v.step, "bytes": v.nbytes, "tiers": tiers, "state": state}
        try:
            stored = self._store.complete_steps()
        except StoreError as exc:
            warnings.warn(f"TieredCheckpointer: the store could not be listed ({exc}); local tiers only",
                          RuntimeWarning, stacklevel=2)
            stored = []
        for step in stored:
            row = rows.setdefault(step, {"step": step, "bytes": None, "tiers": [], "state": "archived"})
            row["tiers"].append(STORE)
            row["state"] = "archived"
        return [rows[s] for s in sorted(rows)]

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                version: int | None = None) -> dict[str, Any]:
        """Load version `version` (None: the newest complete one) into `model` and
        `optimizer`, bit for bit, from the memory pool, the spill dir or the store, in that
        order. A copy that fails its checks is skipped with a warning (for version=None, older
        versions are tried next); RestoreError if none loads. The model and optimizer change
        only once a version has been read and checked whole."""
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        listed = self.versions()
        in_store = {row["step"] for row in listed if STORE in row["tiers"]}
        if version is not None:
            if version not in {row["step"] for row in listed}:
                raise RestoreError(f"no complete version {version}; complete versions: "
                                   f"{[row['step'] for row in listed] or 'none'}")
            steps = [version]
        else:
            steps = sorted((row["step"] for row in listed), reverse=True)
        failures: list[str] = []
        for step in steps:
            # Each tier is looked at when its turn comes: a version may move down meanwhile.
            for tier in (MEMORY, SPILL, STORE):
                try:
                    state = self._read(step, tier, in_store)
                except (CorruptVersionError, tier_payload.PayloadError, StoreError, OSError) as exc:
                    failures.append(f"version {step} from the {tier} tier: {exc}")
                    warnings.warn(f"TieredCheckpointer: restore skips {failures[-1]}", RuntimeWarning, stacklevel=2)
                    continue
                if state is None:
                    continue
                _check_fits(model, optimizer, state)
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                with self._cv:
                    self._counts["restores"] += 1
                return {"step": step, "tier": tier, "skipped": failures}
        raise RestoreError("no complete version could be restored" +
                           (": " + "; ".join(failures) if failures else ": there is none"))

    def _read(self, step: int, tier: str, in_store: set[int]) -> dict[str, Any] | None:
        """Version `step` from `tier`, checked; None where that tier has no copy of it."""
        with self._cv:
            version = self._versions.get(step)
            if version is not None and version.dropped:
                version = None
            if tier == MEMORY:
                if version is None or version.buffer is None:
                    return None
                # Copied out under the lock: the buffer stays the pool's.
                got, state = tier_payload.read(version.buffer, copy=True)
            record = version.spill if version is not None else None
            archived = version is not None and version.archived
        if tier == SPILL:
            if record is None or self._spill is None:
                return None
            try:
                data = self._spill.read_version(step, record, bytearray(record["payload_bytes"]))
            except FileNotFoundError:
                return None  # uploaded and removed meanwhile: the store has it
        elif tier == STORE:
            if step not in in_store and not archived:
                return None
            _, data = self._store.read_version(step)
        if tier != MEMORY:
            got, state = tier_payload.read(torch.frombuffer(data, dtype=torch.uint8), copy=False)
        if got != step:
            raise CorruptVersionError(f"version {step} holds step {got}")
        return state

    # ------------------------------------------------------------------ figures and closing

    def stats(self) -> dict[str, Any]:
        """The tiers' use and bounds, the saves' stalls, the uploads, the policy's state, and
        what coalescing dropped."""
        with self._cv:
            figures: dict[str, Any] = {
                "memory_bytes": self.memory_bytes, "memory_used": self._pool_used, "memory_peak": self._memory_peak,
                "spill_bytes": self.spill_bytes, "spill_used": self._spill_used, "spill_peak": self._spill_peak,
                "versions_in_memory": sorted(v.step for v in self._versions.values() if v.buffer is not None),
                "versions_in_spill": sorted(v.step for v in self._versions.values() if v.spill is not None),
                "coalesced_steps": list(self._dropped_steps), "last_error": self._last_error,
            }
            for name in ("saves", "stalls", "spilled", "spill_errors", "spill_corrupt", "archived",
                         "parts_uploaded", "parts_failed", "bytes_uploaded", "upload_failures", "coalesced",
                         "uploads_cancelled", "stale_uploads_aborted", "spill_leftovers_removed",
                         "adopted_from_spill", "restores"):
                figures[name] = self._counts[name]
            figures.update({name: self._floats[name] for name in ("stall_s_total", "stall_s_max", "copy_s_total")})
        # Besides the pool: the parts in flight, each a copy of its chunk (boto3 takes bytes).
        figures["upload_buffers_max_bytes"] = self._window.maximum * self.chunk_bytes
        figures.update(concurrency=self._window.limit, concurrency_max=self._window.maximum,
                       concurrency_increases=self._window.increases, concurrency_decreases=self._window.decreases,
                       **self._meter.summary())
        return figures

    def close(self, drain: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop. drain=True first waits until every version not dropped is archived (at most
        timeout_s; it stops early when the store fails 3 times in a row); drain=False
        abandons at once. Uploads under way are aborted. Returns a report whose "statement"
        says what became of every version; a warning repeats it when anything was left."""
        with self._cv:
            if self._report is not None:
                return self._report
            self._closing = True
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while drain and self._failures_in_row < 3:
                if not any(not (v.archived or v.dropped) for v in self._versions.values()):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cv.wait(remaining if remaining is not None else 1.0)
            self._stop = True
            self._abandon.set()
            self._cv.notify_all()
        for thread in self._threads:
            thread.join()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._cv:
            lost = sorted(v.step for v in self._versions.values()
                          if v.buffer is not None and v.spill is None and not v.archived)
            kept = sorted(v.step for v in self._versions.values() if v.spill is not None and not v.archived)
            for v in self._versions.values():  # the pool goes with the checkpointer
                v.buffer = None
            self._pool_used = 0
            parts = [f"{self._counts['archived']} version(s) archived to {self._store.url}",
                     f"{self._counts['coalesced']} dropped by coalescing"]
            if lost:
                parts.append(f"abandoned in memory (lost): {lost}")
            if kept:
                parts.append(f"left in the spill dir {self._spill.path if self._spill else ''}: {kept} "
                             "(the next TieredCheckpointer on it uploads them)")
            if not lost and not kept:
                parts.append("nothing left to archive")
            statement = "TieredCheckpointer closed: " + "; ".join(parts)
            self._report = {"drained": not lost and not kept, "abandoned_in_memory": lost, "left_in_spill": kept,
                            "statement": statement, "stats": None}
        self._report["stats"] = self.stats()
        if lost or kept:
            warnings.warn(statement + (f"; last error: {self._last_error}" if self._last_error else ""),
                          RuntimeWarning, stacklevel=2)
        return self._report

    def _at_exit(self) -> None:
        if self._report is None:
            with self._cv:
                pending = sorted(v.step for v in self._versions.values() if not (v.archived or v.dropped))
            if pending:
                warnings.warn(f"TieredCheckpointer was not closed: versions {pending} not archived at exit "
                              "(those only in memory are lost)", RuntimeWarning, stacklevel=1)

    def __enter__(self) -> "TieredCheckpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=exc[0] is None)


def _check_fits(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """ValueError, before anything is loaded, where the version was not saved from a model and
    optimizer of this form (names, shapes, dtypes, class, param groups)."""
    own = model.state_dict()
    saved = state.get("model", {})
    problems = [f"{name}: missing" for name in own if name not in saved]
    problems += [f"{name}: not in the model" for name in saved if name not in own]
    problems += [f"{name}: {tuple(saved[name].shape)} {saved[name].dtype} saved, {tuple(t.shape)} {t.dtype} here"
                 for name, t in own.items() if isinstance(saved.get(name), torch.Tensor)
                 and (saved[name].shape != t.shape or saved[name].dtype != t.dtype)]
    if state.get("optimizer_class") != type(optimizer).__qualname__:
        problems.append(f"optimizer {state.get('optimizer_class')} saved, {type(optimizer).__qualname__} here")
    groups = state.get("optimizer", {}).get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        problems.append("the optimizer's param groups differ in number or size")
    if problems:
        raise ValueError("this version does not fit the model and optimizer (nothing was loaded): " +
                         "; ".join(problems[:8]))
