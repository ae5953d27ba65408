"""An optimizer namespace's media: fsyncs and superblock writes, the durable step, and damaged copies."""
from __future__ import annotations

import logging
import threading
import time

from ...protocol.status import DeviceError, Status
from ..media import SlotFile, StateFile
from ..superblock import Superblock
from .state import NamespaceCore

log = logging.getLogger("cossd.emulator.namespace")


class NamespaceMedia:
    """Durability and media health: fsyncs, superblock writes, the durable step, damaged copies.

    Owns what says how far the media can be trusted: the step known durable, and why the
    namespace stopped (a failed fsync, a damaged copy), after which every step is refused
    until the device is opened again.
    """

    def __init__(self, core: NamespaceCore) -> None:
        self.core = core
        # Taken only to record a damaged state copy once (damaged()).
        self._damage_lock = threading.Lock()
        # Serializes flushes, so that two never sync the same superblock twice.
        self._flush_lock = threading.Lock()
        self.durable_seq = core.sb.seq
        self.durable_step = core.sb.committed_step
        # Set when an fsync failed: Linux reports such an error once and may have dropped
        # the dirty pages, so a retry could "succeed" over lost data. Like PostgreSQL, the
        # namespace then refuses further steps until the device is opened again. Or set when
        # a state copy was found damaged (status UNRECOVERED_READ_ERROR then).
        self._failure: str | None = None
        self._failure_status = Status.WRITE_FAULT

    def sync(self, media: StateFile | SlotFile) -> None:
        """fsync one file; a failure stops the namespace (see failure)."""
        try:
            media.sync()
        except DeviceError as exc:
            self._failure = exc.message
            log.error("namespace %s: %s; refusing further steps until reopened", self.core.name, exc.message)
            raise

    def check(self) -> None:
        """Refuse to go on once the media failed: a failed fsync (WRITE_FAULT), or a state copy
        damaged under the namespace (UNRECOVERED_READ_ERROR), which every call checks for
        first (a few system calls: both copies' size, link count and identity, and the
        guard's fault counts)."""
        if self._failure is None:
            self._check_copies()
        failure = self.failure
        if failure is not None:
            raise DeviceError(
                self._failure_status,
                f"namespace {self.core.name!r} stopped ({failure}); "
                "remount the device to recover the last durable step",
            )

    def _check_copies(self) -> None:
        """Stop the namespace if either state copy is damaged (see StateFile.damage)."""
        for state in self.core.copies:
            reason = state.damage()
            if reason is not None:
                self.damaged(reason)
                return

    def damaged(self, reason: str) -> str:
        """Record a damaged state copy: a media error (SMART, statistics), logged, and the
        namespace refuses steps until the device is opened again, when recovery judges each
        copy on its own. Returns the failure as `failure` gives it."""
        with self._damage_lock:
            if self._failure is None:
                self._failure_status = Status.UNRECOVERED_READ_ERROR
                self._failure = reason
                self.core.counters.checksum_failures += 1
                log.error("namespace %s: media error: %s; refusing steps until remounted", self.core.name, reason)
                sink = self.core.media_error_sink  # the device's error log
                if sink is not None:
                    sink()
            return str(self._failure)

    @property
    def failure(self) -> str | None:
        """Why the namespace stopped (a failed fsync, a damaged state copy), or None.

        Reading it also collects the bus errors the guard contained in either copy's mapping
        (kernels/guard.py): a step whose kernels read or wrote a page cut from under them
        reads zeros there, and the commit, which checks this first, refuses it.
        """
        failure = self._failure
        if failure is None:
            for state in self.core.copies:
                if state.faults():
                    return self.damaged(state.damage() or f"{state.path.name}: its mapping faulted")
        return failure

    def refuse_damaged(self, state: StateFile) -> None:
        """UNRECOVERED_READ_ERROR where `state` can no longer be trusted (StateFile.damage:
        a few system calls, next to a read of up to 1 MiB): what a read would give may be
        zeros standing in for the state."""
        reason = state.damage()
        if reason is not None:
            self.damaged(reason)
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"namespace {self.core.name!r}: {reason}")

    # ------------------------------------------------------------------ superblocks and flushes

    def write_superblock(self, superblock: Superblock, sync: bool) -> None:
        """Write `superblock` into its slot (durably with `sync`): it is then the one in force."""
        core = self.core
        slot = core.slots[superblock.slot]
        encoded = superblock.encode()
        slot.write(encoded)
        core.counters.media_bytes_written += len(encoded)
        core.timing.add(media_write=len(encoded))
        if sync:
            self.sync(slot)
            self.mark_durable(superblock)
        core.sb = superblock
        core.changed_ns = time.time_ns()

    def mark_durable(self, superblock: Superblock) -> None:
        """Record `superblock` (and its copy) as on the media for good."""
        self.durable_seq = superblock.seq
        self.durable_step = superblock.committed_step

    def flush(self) -> int:
        """Make the committed step durable; returns the durable step."""
        with self.core.lock:
            superblock = self.core.sb
        self.flush_to(superblock)
        return self.durable_step

    @property
    def flush_pending(self) -> bool:
        return self.durable_seq < self.core.sb.seq

    def flush_to(self, superblock: Superblock) -> None:
        """Sync the copy and the superblock slot of `superblock` (data first, then the record)."""
        with self._flush_lock:
            if self.durable_seq >= superblock.seq:
                return
            started = time.perf_counter_ns()
            self.sync(self.core.copies[superblock.committed_copy])
            self.sync(self.core.slots[superblock.slot])
            self.mark_durable(superblock)
            counters = self.core.counters
            counters.flushes += 1
            counters.flush_ns += time.perf_counter_ns() - started
            self.core.timing.add(flushes=1)
