"""cossd.trainer.TieredCheckpointer: async checkpoints of resident state through a bounded memory pool, a spill dir and S3."""
from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from ...model import pools
from . import payload as tier_payload, policy as tier_policy, restore as tier_restore
from . import spill as tier_spill, store as tier_store
from .restore import MEMORY, SPILL, STORE, RestoreError
from .state import TierState, Version
from .store import StoreError
from .upload import Uploader

__all__ = ["TieredCheckpointer", "RestoreError", "StoreError"]

MIB = 1 << 20
CLOSE_JOIN_S = 30.0  # how long close() waits for the upload thread once it is told to stop
SPILL_PAUSE_S = 5.0  # the spill tier's pause after a write failed (a full or failing disk)
# Past max_stall_s, how much longer a save waits for a spill under way to end by itself before
# its version is coalesced (a spill about to finish keeps its version).
SPILL_GRACE_S = 0.25


class TieredCheckpointer:
    """Checkpoints of a model and its optimizer, taken every step without waiting for storage.

    `save(model, optimizer, step)` copies the state into a memory pool of `memory_bytes` (the
    only synchronous part); background threads upload each version to `url`
    (s3://BUCKET/PREFIX) and, when the store is slower than versions arrive, spill versions
    from the pool to `spill_dir` (at most `spill_bytes`). When every tier is full, versions
    not yet archived are coalesced: the newest is kept, intermediate ones dropped, counted in
    stats() and warned of. `restore` loads the newest complete version from the fastest tier
    that holds it. Manifests written before they carried their own checksum (format 1) are
    used only with `accept_unchecked_manifests=True`. docs/tiers.md describes the tiers, the
    policy and the objects."""

    def __init__(self, url: str, *, memory_bytes: int, spill_dir: str | os.PathLike[str] | None = None,
                 spill_bytes: int = 0, endpoint_url: str | None = None, chunk_bytes: int = 8 * MIB,
                 max_concurrency: int = 8, initial_concurrency: int = 2, part_latency_target_s: float = 2.0,
                 max_stall_s: float = 5.0, upload_bytes_per_s: float | None = None, part_retries: int = 3,
                 pool_profile: str | os.PathLike[str] | None = None, pool_timed: bool = False,
                 accept_unchecked_manifests: bool = False) -> None:
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
        self.chunk_bytes, self.max_stall_s = chunk_bytes, max_stall_s
        # The pool as a tier of its own (the talk's CXL memory): its profile models each save's
        # copy into it (cossd.model.pools); timed, a save takes at least that long.
        if pool_timed and pool_profile is None:
            raise ValueError("pool_timed needs a pool_profile (e.g. 'cxl-x8')")
        self.pool = None if pool_profile is None else pools.load_pool(os.fspath(pool_profile))
        self.pool_timed = bool(pool_timed)
        window = tier_policy.AimdWindow(initial_concurrency, max_concurrency, part_latency_target_s)
        meter = tier_policy.StoreMeter()
        cap = tier_policy.TokenBucket(upload_bytes_per_s) if upload_bytes_per_s is not None else None
        # Format-1 manifests and sidecars (no checksum of their own) are refused unless accepted.
        accept = bool(accept_unchecked_manifests)
        self._store = tier_store.ObjectStore(url, endpoint_url, connections=max_concurrency, accept_unchecked=accept)
        self._store.check_bucket()
        spill = tier_spill.SpillDir(spill_dir, accept_unchecked=accept) if spill_dir is not None else None
        self._state = TierState(memory_bytes, spill_bytes, spill)
        self._need = 0                # the room the spill thread keeps free in the pool: the last save's size
        self._last_step: int | None = None
        self._spill_retry_at = 0.0
        self._closing = False
        self._report: dict[str, Any] | None = None

        # A prefix belongs to one checkpointer at a time: uploads a killed process left are aborted.
        self._state.counts["stale_uploads_aborted"] = self._store.abort_stale_uploads()
        self._adopt_spilled(set(self._store.complete_steps()))
        # Both threads start here, so they share the constructing thread's network namespace.
        self._uploader = Uploader(self._state, self._store, window, meter, cap, part_retries)
        self._spiller = threading.Thread(target=self._spill_loop, name="cossd-tier-spill", daemon=True)
        self._spiller.start()
        reference = weakref.ref(self)

        def exit_hook() -> None:
            checkpointer = reference()
            if checkpointer is not None:
                checkpointer._at_exit()

        self._exit_hook = exit_hook
        atexit.register(self._exit_hook)

    @property
    def memory_bytes(self) -> int:
        return self._state.memory_bytes

    @property
    def spill_bytes(self) -> int:
        return self._state.spill_bytes

    def _adopt_spilled(self, archived: set[int]) -> None:
        """Versions a previous checkpointer left in the spill dir: uploaded from there (or
        removed where the store has them already); files of a spill cut short removed; a
        version whose sidecar fails its checks discarded, and a format-1 one left, each warned of."""
        state, spill = self._state, self._state.spill
        if spill is None:
            return
        found = spill.scan()
        removed = found.cut_short
        state.counts["spill_leftovers_removed"] = len(removed)
        if removed:
            warnings.warn(f"TieredCheckpointer: removed {len(removed)} file(s) of versions whose spill was cut "
                          f"short in {spill.path}: {', '.join(removed[:6])}", RuntimeWarning, stacklevel=3)
        state.counts["spill_corrupt"] += len(found.corrupt)
        for why in found.corrupt:
            warnings.warn(f"TieredCheckpointer: discarded {why}", RuntimeWarning, stacklevel=3)
        for why in found.unchecked:
            warnings.warn(f"TieredCheckpointer: left in place, not adopted: {why}", RuntimeWarning, stacklevel=3)
        for step, record in found.complete.items():
            if step in archived:
                spill.delete(step)
                continue
            state.versions[step] = Version(step, record["payload_bytes"], record["chunk_bytes"], spill=record)
            state.reserve_spill(record["payload_bytes"])
            state.counts["adopted_from_spill"] += 1
        if state.spill_used > state.spill_bytes:
            warnings.warn(f"TieredCheckpointer: the spill dir {spill.path} holds {state.spill_used} bytes of "
                          f"versions from before, more than spill_bytes ({state.spill_bytes}): nothing more is "
                          "spilled until they are uploaded", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ save

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
        """Checkpoint `model` and `optimizer` as version `step` (greater than the last saved).
        Returns once the state is copied into the memory pool; waits only while the pool has
        no room (at most max_stall_s, then versions not yet archived are coalesced)."""
        state = self._state
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        with state.cv:
            if self._closing:
                raise RuntimeError("save() on a closed TieredCheckpointer")
            if self._last_step is not None and step <= self._last_step:
                raise ValueError(f"step {step} is not after the last saved step {self._last_step}")
        layout = tier_payload.plan({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "optimizer_class": type(optimizer).__qualname__}, step)
        if layout.size > state.memory_bytes:
            raise ValueError(f"a version of this state is {layout.size} bytes and the memory pool holds "
                             f"{state.memory_bytes} (memory_bytes): it must hold at least one version")
        started = time.monotonic()
        with state.cv:
            self._need = layout.size
            waited = self._make_room(layout.size, step, started)
            state.reserve_pool(layout.size)
        stall = time.monotonic() - started if waited else 0.0
        try:
            # Page-locked where the state is on a GPU, so the copy out of it is a DMA.
            pinned = torch.cuda.is_available() and any(t.is_cuda for t in layout.tensors)
            buffer = torch.empty(layout.size, dtype=torch.uint8, pin_memory=pinned)
            tier_payload.write(layout, buffer)
        except BaseException:
            with state.cv:
                state.pool_used -= layout.size
                state.cv.notify_all()
            raise
        copied = time.monotonic() - started - stall
        modeled = 0.0 if self.pool is None else self.pool.copy_ns(layout.size) / 1e9
        if self.pool_timed and modeled > copied:
            time.sleep(modeled - copied)  # host memory is faster than the pool it stands for
            copied = modeled
        with state.cv:
            old = state.versions.get(step)
            if old is not None:  # a step saved again by an earlier checkpointer: this one replaces it
                state.drop(old, counted=False)
            state.versions[step] = Version(step, layout.size, self.chunk_bytes, buffer=buffer)
            self._last_step = step
            state.counts["saves"] += 1
            state.counts["stalls"] += waited
            state.floats["stall_s_total"] += stall
            state.floats["stall_s_max"] = max(state.floats["stall_s_max"], stall)
            state.floats["copy_s_total"] += copied
            state.floats["pool_modeled_copy_s_total"] += modeled
            state.cv.notify_all()
        return {"step": step, "bytes": layout.size, "stall_s": stall, "copy_s": copied} | (
            {} if self.pool is None else {"modeled_copy_s": modeled})

    def _make_room(self, size: int, step: int, started: float) -> bool:
        """Lock held: wait until `size` bytes of the pool are free; True if it had to wait. Past
        max_stall_s, versions in the pool not yet archived are coalesced, the one being
        uploaded included."""
        state = self._state
        waited = False
        while state.pool_free() < size:
            state.evict_archived(size)
            if state.pool_free() >= size:
                break
            waited = True
            remaining = started + self.max_stall_s - time.monotonic()
            if remaining > 0:
                state.cv.notify_all()
                state.cv.wait(remaining)
                continue
            # Bytes a spill under way frees when it ends; only the rest is dropped for.
            spilling = [v for v in state.versions.values() if v.spilling and v.buffer is not None
                        and not (v.archived or v.dropped)]
            short = size - state.pool_free() - sum(v.nbytes for v in spilling)
            if short > 0:
                in_pool = [v for v in state.versions.values() if v.buffer is not None
                           and not (v.archived or v.dropped or v.spilling or v.finishing)]
                # Why the spill tier took none: its bound, or its disk failing (full, read-only),
                # which the warning names so a failing disk is not read as a small bound.
                spill_why = (f"the spill tier failing ({state.last_error})" if state.spill is not None
                             and time.monotonic() < self._spill_retry_at else "the spill tier none for its versions")
                if state.coalesce(in_pool, short, step, include_uploading=True,
                                  why=f"the memory pool had no room for version {step} after {self.max_stall_s} s "
                                      f"and {spill_why}"):
                    continue
            if spilling and time.monotonic() >= started + self.max_stall_s + SPILL_GRACE_S:
                # The spill tier's disk is slower than the saves: its spill would hold this
                # save for the rest of the version. It is coalesced too, and its write stops
                # at its next chunk (tier_spill.SpillDir.write), which frees its pool room.
                if state.coalesce(spilling, size - state.pool_free(), step, include_uploading=True,
                                  why=f"version {step} waited {self.max_stall_s} s for the spill of "
                                      f"version(s) {', '.join(str(v.step) for v in spilling)} to a disk slower "
                                      "than the saves"):
                    continue
            state.cv.wait(0.05)  # spills under way end soon: they free the pool
        return waited

    # ------------------------------------------------------------------ the spill tier

    def _spill_loop(self) -> None:
        state = self._state
        while True:
            with state.cv:
                while True:
                    if state.stop:
                        return
                    version = self._plan_spill()
                    if version is not None:
                        break
                    wait = self._spill_retry_at - time.monotonic()
                    state.cv.wait(wait if wait > 0 else None)
                version.spilling = True
                state.reserve_spill(version.nbytes)
                buffer = version.buffer
            assert state.spill is not None and buffer is not None
            try:
                # Read without the lock: a flag turning true only ends the spill sooner.
                record = state.spill.write(version.step, tier_payload.as_memoryview(buffer), version.chunk_bytes,
                                           needed=lambda: not (version.archived or version.dropped))
            except OSError as exc:
                del buffer
                with state.cv:
                    version.spilling = False
                    state.spill_used -= version.nbytes
                    state.counts["spill_errors"] += 1
                    state.last_error = f"spilling version {version.step} to {state.spill.path}: {exc}"
                    self._spill_retry_at = time.monotonic() + SPILL_PAUSE_S
                    if version.dropped:
                        state.release(version)
                    state.cv.notify_all()
                warnings.warn(f"TieredCheckpointer: {state.last_error}; the spill tier pauses {SPILL_PAUSE_S} s",
                              RuntimeWarning, stacklevel=1)
                continue
            # Not held past the release below: the pool's bound counts real memory.
            del buffer
            with state.cv:
                version.spilling = False
                if record is None:  # stopped: archived or dropped meanwhile, its files removed
                    state.spill_used -= version.nbytes
                    state.counts["spills_stopped"] += 1
                    if not version.archived:  # an archived one stays as a cache, evicted when room is needed
                        state.release(version)
                    state.cv.notify_all()
                    continue
                version.spill = record
                if version.dropped or version.archived:  # meanwhile: the file is not needed
                    state.unspill(version)
                else:
                    state.counts["spilled"] += 1
                if not version.archived:  # an archived one stays in the pool as a cache
                    state.release(version)
                state.cv.notify_all()

    def _plan_spill(self) -> Version | None:
        """Lock held: the pool version to move to the spill dir now, if the pool is short of
        one save's room; spilled versions not archived are coalesced to make spill room."""
        state = self._state
        if state.spill is None or time.monotonic() < self._spill_retry_at or self._need == 0:
            return None
        state.evict_archived(self._need)
        if state.pool_free() >= self._need:
            return None
        # Versions waiting first, oldest first; the one being uploaded last (it may finish soon).
        movable = sorted((v for v in state.versions.values() if v.buffer is not None and v.spill is None
                          and not (v.archived or v.dropped or v.spilling or v.finishing)),
                         key=lambda v: (v.uploading, v.step))
        for version in movable:
            free = state.spill_bytes - state.spill_used
            if free >= version.nbytes:
                return version
            spilled = [v for v in state.versions.values()
                       if v.spill is not None and not (v.archived or v.dropped or v.spilling or v.finishing)]
            if state.coalesce(spilled, version.nbytes - free, version.step, include_uploading=False,
                              why=f"the spill dir had no room for version {version.step}"):
                return version
        return None

    # ------------------------------------------------------------------ listing and restore

    def versions(self) -> list[dict[str, Any]]:
        """Every complete version and where it lives: [{"step", "bytes", "tiers", "state"}],
        ascending. "bytes" is None for a version only in the store (not read to list it)."""
        state = self._state
        rows: dict[int, dict[str, Any]] = {}
        with state.cv:
            for v in state.versions.values():
                tiers = [t for t, here in ((MEMORY, v.buffer is not None), (SPILL, v.spill is not None)) if here]
                if tiers and not v.dropped:
                    status = "archived" if v.archived else "uploading" if v.uploading else "waiting"
                    rows[v.step] = {"step": v.step, "bytes": v.nbytes, "tiers": tiers, "state": status}
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
        order; {"step", "tier", "skipped"}. A copy that fails its checks (its manifest's own
        checksum, verified first; a chunk's CRC32C) is skipped with a warning naming it (for
        version=None, older versions are tried next); RestoreError if none
        loads. The model and optimizer change only once a version has been read and checked
        whole (ValueError, nothing loaded, where it does not fit them)."""
        done = tier_restore.restore(self._state, self._store, self.versions(), model, optimizer, version)
        with self._state.cv:
            self._state.counts["restores"] += 1
        return done

    # ------------------------------------------------------------------ figures and closing

    def stats(self) -> dict[str, Any]:
        """The tiers' use and bounds, the saves' stalls, the uploads, the policy's state, and
        what coalescing dropped."""
        state, uploader = self._state, self._uploader
        with state.cv:
            figures: dict[str, Any] = {
                "memory_bytes": state.memory_bytes, "memory_used": state.pool_used, "memory_peak": state.memory_peak,
                "spill_bytes": state.spill_bytes, "spill_used": state.spill_used, "spill_peak": state.spill_peak,
                "versions_in_memory": sorted(v.step for v in state.versions.values() if v.buffer is not None),
                "versions_in_spill": sorted(v.step for v in state.versions.values() if v.spill is not None),
                "coalesced_steps": list(state.dropped_steps), "last_error": state.last_error,
            }
            for name in ("saves", "stalls", "spilled", "spill_errors", "spill_corrupt", "archived",
                         "parts_uploaded", "parts_failed", "bytes_uploaded", "upload_failures", "coalesced",
                         "uploads_cancelled", "stale_uploads_aborted", "spill_leftovers_removed", "spills_stopped",
                         "adopted_from_spill", "restores"):
                figures[name] = state.counts[name]
            figures["spill_delete_errors"] = state.spill.delete_errors if state.spill is not None else 0
            figures.update({name: state.floats[name] for name in ("stall_s_total", "stall_s_max", "copy_s_total",
                                                                  "pool_modeled_copy_s_total")})
            figures["pool_profile"] = None if self.pool is None else self.pool.name
            figures["pool_timed"] = self.pool_timed
        window = uploader.window
        # Besides the pool: the parts in flight, each a copy of its chunk (boto3 takes bytes).
        figures["upload_buffers_max_bytes"] = window.maximum * self.chunk_bytes
        figures.update(concurrency=window.limit, concurrency_max=window.maximum,
                       concurrency_increases=window.increases, concurrency_decreases=window.decreases,
                       **uploader.meter.summary())
        return figures

    def close(self, drain: bool = True, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop. drain=True first waits until every version not dropped is archived (at most
        timeout_s; it stops early when the store fails 3 times in a row); drain=False
        abandons at once. Uploads under way are aborted. Returns a report whose "statement"
        says what became of every version; a warning repeats it when anything was left."""
        state = self._state
        with state.cv:
            if self._report is not None:
                return self._report
            self._closing = True
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while drain and self._uploader.failures_in_row < 3 and state.pending():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                state.cv.wait(min(remaining, 1.0) if remaining is not None else 1.0)
            state.stop = True
            state.abandon.set()
            state.cv.notify_all()
        # A request to a hung store ends only at boto3's timeout: it is left to end in the
        # background rather than holding close() (the statement says so).
        deadline = time.monotonic() + CLOSE_JOIN_S
        for thread in (self._uploader.thread, self._spiller):
            thread.join(max(0.0, deadline - time.monotonic()))
        blocked = self._uploader.thread.is_alive() or self._spiller.is_alive()
        self._uploader.shutdown(wait=not blocked)
        atexit.unregister(self._exit_hook)
        with state.cv:
            lost = sorted(v.step for v in state.versions.values()
                          if v.buffer is not None and v.spill is None and not v.archived)
            kept = sorted(v.step for v in state.versions.values() if v.spill is not None and not v.archived)
            for v in state.versions.values():  # the pool goes with the checkpointer
                v.buffer = None
            state.pool_used = 0
            parts = [f"{state.counts['archived']} version(s) archived to {self._store.url}",
                     f"{state.counts['coalesced']} dropped by coalescing"]
            if lost:
                parts.append(f"abandoned in memory (lost): {lost}")
            if kept:
                parts.append(f"left in the spill dir {state.spill.path if state.spill else ''}: {kept} "
                             "(the next TieredCheckpointer on it uploads them)")
            if not lost and not kept:
                parts.append("nothing left to archive")
            if blocked:
                parts.append(f"a request to the store was still under way after {CLOSE_JOIN_S:.0f} s: "
                             "left to time out in the background")
            statement = "TieredCheckpointer closed: " + "; ".join(parts)
            last_error = state.last_error
        self._report = {"drained": not lost and not kept, "abandoned_in_memory": lost, "left_in_spill": kept,
                        "statement": statement, "stats": self.stats()}
        if lost or kept:
            warnings.warn(statement + (f"; last error: {last_error}" if last_error else ""),
                          RuntimeWarning, stacklevel=2)
        return self._report

    def _at_exit(self) -> None:
        if self._report is None:
            with self._state.cv:
                pending = sorted(v.step for v in self._state.pending())
            if pending:
                warnings.warn(f"TieredCheckpointer was not closed: versions {pending} not archived at exit "
                              "(those only in memory are lost)", RuntimeWarning, stacklevel=1)

    def __enter__(self) -> "TieredCheckpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(drain=exc[0] is None)
