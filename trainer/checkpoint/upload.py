"""The tiered checkpointer's upload thread: versions to the store oldest first, each one's parts in parallel as the AIMD window allows, failures backed off."""
from __future__ import annotations

import collections
import concurrent.futures as futures
import threading
import time
import warnings

import crc32c

from . import payload as tier_payload, policy as tier_policy, store as tier_store
from .state import Cancelled, TierState, Version
from .store import CorruptVersionError, StoreError


class Uploader:
    """One thread that archives the oldest version not archived, then the next. The thread
    starts in the constructor, so it (and the part threads it starts) share the constructing
    thread's network namespace."""

    def __init__(self, state: TierState, store: tier_store.ObjectStore, window: tier_policy.AimdWindow,
                 meter: tier_policy.StoreMeter, cap: tier_policy.TokenBucket | None, part_retries: int) -> None:
        self.state, self.store, self.window, self.meter, self.cap = state, store, window, meter, cap
        self.part_retries = part_retries
        self.failures_in_row = 0      # versions whose upload failed since the last success
        self._retry_at = 0.0          # the backoff after a failed version
        self._executor = futures.ThreadPoolExecutor(window.maximum, thread_name_prefix="cossd-tier-part")
        self.thread = threading.Thread(target=self._run, name="cossd-tier-upload", daemon=True)
        self.thread.start()

    def shutdown(self, wait: bool) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def _run(self) -> None:
        state = self.state
        while True:
            with state.cv:
                while True:
                    if state.stop:
                        return
                    version = self._next()
                    if version is not None:
                        break
                    wait = self._retry_at - time.monotonic()
                    state.cv.wait(wait if wait > 0 else None)
                version.uploading = True
            try:
                self._upload(version)
            except Cancelled:
                with state.cv:
                    state.counts["uploads_cancelled"] += 1
            except (StoreError, CorruptVersionError, OSError) as exc:
                self._failed(version, exc)
            finally:
                with state.cv:
                    version.uploading = False
                    state.cv.notify_all()

    def _next(self) -> Version | None:
        """Lock held: the oldest version not archived, unless the store is in its backoff."""
        if time.monotonic() < self._retry_at:
            return None
        waiting = self.state.pending()
        return min(waiting, key=lambda v: v.step) if waiting else None

    def _failed(self, version: Version, exc: Exception) -> None:
        state = self.state
        with state.cv:
            if isinstance(exc, CorruptVersionError):  # its spill file went bad: nothing to upload
                state.counts["spill_corrupt"] += 1
                state.drop(version, counted=False)
                message = f"version {version.step} discarded: {exc}"
            else:
                self.failures_in_row += 1
                state.counts["upload_failures"] += 1
                delay = min(30.0, 0.5 * 2 ** self.failures_in_row)
                self._retry_at = time.monotonic() + delay
                message = (f"uploading version {version.step} failed ({self.failures_in_row} in a row): {exc}; "
                           f"retrying in {delay:.1f} s, versions wait in the memory pool and spill dir meanwhile")
            state.last_error = message
            state.cv.notify_all()
        warnings.warn(f"TieredCheckpointer: {message}", RuntimeWarning, stacklevel=1)

    def _upload(self, version: Version) -> None:
        """One version: its parts in parallel (as many in flight as the AIMD window allows),
        each retried up to part_retries times, then the data completed and the manifest last."""
        state = self.state
        chunk, total = version.chunk_bytes, version.nbytes
        count = -(-total // chunk)
        if count > tier_store.MAX_PARTS:
            raise StoreError(f"version {version.step}: {count} parts of {chunk} bytes is more than S3's "
                             f"{tier_store.MAX_PARTS}; raise chunk_bytes")
        upload_id = self.store.begin(version.step)
        etags: dict[int, str] = {}
        crcs: list[int] = [0] * count
        pending = collections.deque(range(count))
        attempts: collections.Counter[int] = collections.Counter()
        flying: dict[futures.Future[tuple[str, int]], int] = {}
        try:
            while pending or flying:
                while pending and len(flying) < self.window.limit:
                    index = pending.popleft()
                    flying[self._executor.submit(self._put_part, version, upload_id, index, attempts[index])] = index
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
            with state.cv:
                state.check_live(version)
                version.finishing = True  # from here it reaches the store: coalescing passes it by
            self.store.finish(version.step, upload_id, etags, record)
        except BaseException:
            with state.cv:
                version.finishing = False
            for future in flying:
                future.cancel()
            futures.wait(flying)
            self.store.abort(self.store.key(version.step, tier_store.DATA_OBJECT), upload_id)
            raise
        with state.cv:
            version.archived = True
            version.finishing = False
            self.failures_in_row = 0
            state.counts["archived"] += 1
            state.unspill(version)
            state.forget_if_gone(version)
            state.cv.notify_all()

    def _read_chunk(self, version: Version, index: int) -> bytes:
        state = self.state
        start = index * version.chunk_bytes
        stop = min(version.nbytes, start + version.chunk_bytes)
        with state.cv:
            state.check_live(version)
            if version.buffer is not None:
                # Copied under the lock: a pool buffer is never freed while a part reads it.
                return bytes(tier_payload.as_memoryview(version.buffer)[start:stop])
            record = version.spill
        assert record is not None and state.spill is not None
        try:
            data = state.spill.read_range(version.step, start, stop)
        except FileNotFoundError:
            state.check_live(version)  # dropped meanwhile
            raise
        if crc32c.crc32c(data) != record["chunks_crc32c"][index]:
            raise CorruptVersionError(f"version {version.step} in the spill dir: chunk {index} does not match "
                                      "its CRC32C")
        return data

    def _put_part(self, version: Version, upload_id: str, index: int, attempt: int) -> tuple[str, int]:
        state = self.state
        if attempt:
            state.abandon.wait(min(5.0, 0.25 * 2 ** attempt))
        data = self._read_chunk(version, index)
        crc = crc32c.crc32c(data)
        if self.cap is not None:
            self.cap.take(len(data), state.abandon)
        state.check_live(version)
        started = time.monotonic()
        try:
            etag = self.store.put_part(version.step, upload_id, index + 1, data)
        except StoreError as exc:
            self.meter.record(started, time.monotonic(), len(data), ok=False)
            self.window.failure()
            with state.cv:
                state.counts["parts_failed"] += 1
                state.last_error = str(exc)
            raise
        ended = time.monotonic()
        self.meter.record(started, ended, len(data), ok=True)
        self.window.success(ended - started)
        with state.cv:
            state.counts["parts_uploaded"] += 1
            state.counts["bytes_uploaded"] += len(data)
        return etag, crc
