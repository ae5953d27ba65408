"""An optimizer namespace's media: fsyncs and superblock writes, damaged copies, block checksums, scrub and injected corruption."""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from ...protocol.status import DeviceError, Status
from ..accounting import modeled_command
from ..media import SlotFile, StateFile
from ..superblock import Superblock

log = logging.getLogger("cossd.emulator.namespace")


class _Media:
    """Durability and media health: fsyncs, superblock writes, damaged copies, checksums, scrub and injected corruption.

    A part of Namespace (emulator/namespace.py), which holds the state these methods share.
    """

    def _verify_copy(self, superblock: Superblock) -> list[tuple[str, int]]:
        """Blocks of the copy `superblock` names whose checksum (or param checksum, where
        the superblock has them) does not match (_block_fails, namespace/verify.py). Its
        wall time adds to counters.copy_verify_ns (the bench's restore takes an open apart)."""
        started = time.perf_counter_ns()
        try:
            return [(tensor.name, block) for tensor in self.layouts for block in range(tensor.block_count)
                    if self._block_fails(superblock, tensor, block)]
        finally:
            self.counters.copy_verify_ns += time.perf_counter_ns() - started

    def _sync(self, media: StateFile | SlotFile) -> None:
        """fsync one file; a failure stops the namespace (see media_failure)."""
        try:
            media.sync()
        except DeviceError as exc:
            self.media_failure = exc.message
            log.error("namespace %s: %s; refusing further steps until reopened", self.name, exc.message)
            raise

    def _check_media(self) -> None:
        """Refuse to go on once the media failed: a failed fsync (WRITE_FAULT), or a state copy
        damaged under the namespace (UNRECOVERED_READ_ERROR), which every call checks for
        first (a few system calls: both copies' size, link count and identity, and the
        guard's fault counts)."""
        if self.media_failure is None:
            self._check_copies()
        failure = self.media_failure
        if failure is not None:
            raise DeviceError(
                self.__dict__.get("_media_status", Status.WRITE_FAULT),
                f"namespace {self.name!r} stopped ({failure}); "
                "remount the device to recover the last durable step",
            )

    def _check_copies(self) -> None:
        """Stop the namespace if either state copy is damaged (see StateFile.damage)."""
        for state in self._copies:
            reason = state.damage()
            if reason is not None:
                self._media_damaged(reason)
                return

    def _media_damaged(self, reason: str) -> str:
        """Record a damaged state copy: a media error (SMART, statistics), logged, and the
        namespace refuses steps until the device is opened again, when recovery judges each
        copy on its own. Returns the failure as media_failure gives it."""
        with self._damage_lock:
            if self.__dict__.get("_media_failure") is None:
                self._media_status = Status.UNRECOVERED_READ_ERROR
                self._media_failure = reason
                self.counters.checksum_failures += 1
                log.error("namespace %s: media error: %s; refusing steps until remounted", self.name, reason)
                sink = self.__dict__.get("media_error_sink")  # the device's error log
                if sink is not None:
                    sink()
            return str(self._media_failure)

    @property
    def media_failure(self) -> str | None:
        """Why the namespace stopped (a failed fsync, a damaged state copy), or None.

        Reading it also collects the bus errors the guard contained in either copy's mapping
        (kernels/guard.py): a step whose kernels read or wrote a page cut from under them
        reads zeros there, and the commit, which checks this first, refuses it.
        """
        failure: str | None = self.__dict__.get("_media_failure")
        if failure is None:
            for state in self.__dict__.get("_copies", ()):
                if state.faults():
                    return self._media_damaged(state.damage() or f"{state.path.name}: its mapping faulted")
        return failure

    @media_failure.setter
    def media_failure(self, value: str | None) -> None:
        self._media_failure = value

    def _write_superblock(self, superblock: Superblock, sync: bool) -> None:
        slot = self._slots[superblock.slot]
        encoded = superblock.encode()
        slot.write(encoded)
        self.counters.media_bytes_written += len(encoded)
        self.timing.add(media_write=len(encoded))
        if sync:
            self._sync(slot)
            self._durable_seq = superblock.seq
            self._durable_step = superblock.committed_step
        self._sb = superblock
        self.changed_ns = time.time_ns()

    @modeled_command("flush")
    def flush(self) -> int:
        """Make the committed step durable; returns the durable step."""
        with self._lock:
            superblock = self._sb
        self._flush_to(superblock)
        return self._durable_step

    @property
    def flush_pending(self) -> bool:
        return self._durable_seq < self._sb.seq

    def _flush_to(self, superblock: Superblock) -> None:
        """Sync the copy and the superblock slot of `superblock` (data first, then the record)."""
        with self._flush_lock:
            if self._durable_seq >= superblock.seq:
                return
            started = time.perf_counter_ns()
            self._sync(self._copies[superblock.committed_copy])
            self._sync(self._slots[superblock.slot])
            self._durable_seq = superblock.seq
            self._durable_step = superblock.committed_step
            self.counters.flushes += 1
            self.counters.flush_ns += time.perf_counter_ns() - started
            self.timing.add(flushes=1)

    def scrub(self) -> list[tuple[str, int]]:
        """Verify every block checksum of the committed copy; returns the bad blocks."""
        return self.scrub_blocks()[1]

    def scrub_blocks(self) -> tuple[int, list[tuple[str, int]]]:
        """(blocks verified, bad blocks) of the committed copy. A namespace still loading has
        no checksums yet, so nothing is verified."""
        with self._lock:
            self._await_verified_locked()
            if self.loading:
                return 0, []
            bad = self._verify_copy(self._sb)
            self.counters.checksum_failures += len(bad)
            return self.total_blocks, bad

    def corrupt_block(self, tensor_name: str, block: int) -> dict[str, Any]:
        """Fault injection (INJECT_ERROR): change one byte of `block` of `tensor_name` in the
        committed copy on the media, as a media error would, so that scrub and recovery find
        the block's checksum wrong. Returns where the byte was."""
        tensor = self._tensor(tensor_name)
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < tensor.block_count:
            raise DeviceError(
                Status.INVALID_FIELD,
                f"{tensor.name} has blocks 0..{tensor.block_count - 1}, not {block!r}",
            )
        with self._lock:
            self._await_verified_locked()
            if self.loading:
                raise DeviceError(
                    Status.INVALID_FIELD,
                    f"namespace {self.name!r} is still loading: there are no checksums to fail",
                )
            copy = self._sb.committed_copy
            start, _ = tensor.block_range(block)
            offset = tensor.master_offset + start * 4  # the block's first master byte
            state = self._copies[copy]
            # +1 rather than a bit flip, so that corrupting the same block twice does not undo it.
            state.write_at(offset, np.array([(int(state.bytes[offset]) + 1) & 0xFF], dtype=np.uint8))
        return {"tensor": tensor.name, "block": block, "lba": tensor.first_block + block,
                "copy": copy.name, "offset": offset}
