"""A namespace's block checksums (a copy verified whole, scrub, injected corruption), and its committed step verified lazily after a reopen: each param block before it is first served, the whole copy in the background."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np

from ... import kernels
from ...protocol.status import DeviceError, Status
from ..layout import BLOCK_ELEMS, SUPERBLOCK_HEADER, Copy, TensorLayout
from .common import WouldBlock, block_slice
from ..superblock import Superblock
from .media import NamespaceMedia
from .state import NamespaceCore

log = logging.getLogger("cossd.emulator.namespace")

# How the committed copy is verified when a namespace is opened (DeviceConfig.verify):
VERIFY_OPEN = "open"  # every block's checksum before anything is served (slow at scale)
VERIFY_BACKGROUND = "background"  # params as first served, everything else in a thread
VERIFY_MODES = (VERIFY_OPEN, VERIFY_BACKGROUND)

# The background pass gives way to the host: while params were read this recently, it waits
# (a restart's first job is to hand the trainer its params; the pass competes for the disk),
# but never while a command waits for the pass, and at most this long before each block, so
# that a reader that never pauses cannot hold it off for ever.
HOST_READ_QUIET_NS = 20_000_000
YIELD_SLEEP_S = 0.005
MAX_YIELD_PER_BLOCK_S = 0.1
# Param blocks checked in one kernel call by the pass's first part: 128 MiB of FP16 params,
# short enough that a close stops the pass at once.
PARAM_BATCH_BLOCKS = 256


class CopyVerifier:
    """The state copies' block checksums, and deferred verification of the committed copy after
    an open (see VERIFY_BACKGROUND).

    While it runs (`verifying`), nothing may read or step on bytes not yet checked:
    - a param read checks each block it touches against the block's param checksum (the
      superblock's `param_crcs`) the first time, before serving it;
    - every other use of the committed copy (a begin, master or moment reads, snapshots,
      export, scrub, revert, injected corruption) waits until the whole copy has passed.
    A block that fails either check stops the namespace: the read that found it and every
    later command fail (UNRECOVERED_READ_ERROR), and the failed step's superblock is wiped,
    so that a remount recovers the newest older step whose copy passes, as recovery at open
    would have. The step is never switched under a client that has read part of it, and
    nothing unverified is ever served as good.

    It also owns the block checksums themselves: a whole copy verified (at open, before a
    rollback or revert flips to it, by a scrub) and the corruption injected for them to find.
    """

    def __init__(self, core: NamespaceCore, media: NamespaceMedia) -> None:
        self.core = core
        self.media = media
        self.verifying = False  # the committed copy is served before it has been verified whole
        self._param_checked = np.zeros(0, dtype=bool)  # per block: its params checked
        self._verify_stop = False
        self._unservable: str | None = None  # why nothing may be served any more
        self._verify_thread: threading.Thread | None = None
        self._last_host_read_ns = 0
        self._verify_waiters = 0  # commands waiting for the pass: it then stops giving way
        # Seconds the background pass took, once it is over (None before; statistics).
        self.verified_in_s: float | None = None

    # ------------------------------------------------------------------ checksums

    def block_crcs(self, copy: Copy, tensor: TensorLayout, local_block: int) -> tuple[int, int]:
        """(block checksum, param checksum) of one block in `copy`: each role's CRC32C on its
        own, combined in the block checksum's order (master, moments, param)."""
        start, stop = tensor.block_range(local_block)
        block = 0
        part = 0
        for index, role in enumerate(self.core.block_roles):
            view = self.core.view(copy, tensor, role)[block_slice(role, start, stop)]
            part = kernels.crc32c(view)
            block = part if index == 0 else kernels.crc32c_combine(block, part, view.nbytes)
        return block, part  # the block roles end with the param

    def _block_fails(self, superblock: Superblock, tensor: TensorLayout, local_block: int) -> bool:
        crc, param_crc = self.block_crcs(superblock.committed_copy, tensor, local_block)
        index = tensor.first_block + local_block
        return crc != int(superblock.block_crcs[index]) or (
            superblock.param_crcs is not None and param_crc != int(superblock.param_crcs[index]))

    def _param_block_passes(self, superblock: Superblock, tensor: TensorLayout, local_block: int) -> bool:
        """Whether one block's params in the committed copy match their own checksum."""
        assert superblock.param_crcs is not None  # only such a step is verified lazily
        start, stop = tensor.block_range(local_block)
        crc = kernels.crc32c(self.core.view(superblock.committed_copy, tensor, "param")[start:stop])
        return crc == int(superblock.param_crcs[tensor.first_block + local_block])

    def verify_copy(self, superblock: Superblock) -> list[tuple[str, int]]:
        """Blocks of the copy `superblock` names whose checksum (or param checksum, where
        the superblock has them) does not match. Its wall time adds to
        counters.copy_verify_ns (the bench's restore takes an open apart)."""
        started = time.perf_counter_ns()
        try:
            return [(tensor.name, block) for tensor in self.core.layouts for block in range(tensor.block_count)
                    if self._block_fails(superblock, tensor, block)]
        finally:
            self.core.counters.copy_verify_ns += time.perf_counter_ns() - started

    def scrub_blocks(self) -> tuple[int, list[tuple[str, int]]]:
        """(blocks verified, bad blocks) of the committed copy. A namespace still loading has
        no checksums yet, so nothing is verified."""
        core = self.core
        with core.lock:
            self.await_verified_locked()
            if core.loading:
                return 0, []
            bad = self.verify_copy(core.sb)
            core.counters.checksum_failures += len(bad)
            return core.total_blocks, bad

    def corrupt_block(self, tensor_name: str, block: int) -> dict[str, Any]:
        """Fault injection (INJECT_ERROR): change one byte of `block` of `tensor_name` in the
        committed copy on the media, as a media error would, so that scrub and recovery find
        the block's checksum wrong. Returns where the byte was."""
        core = self.core
        tensor = core.tensor(tensor_name)
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < tensor.block_count:
            raise DeviceError(
                Status.INVALID_FIELD,
                f"{tensor.name} has blocks 0..{tensor.block_count - 1}, not {block!r}",
            )
        with core.lock:
            self.await_verified_locked()
            if core.loading:
                raise DeviceError(
                    Status.INVALID_FIELD,
                    f"namespace {core.name!r} is still loading: there are no checksums to fail",
                )
            copy = core.sb.committed_copy
            start, _ = tensor.block_range(block)
            offset = tensor.master_offset + start * 4  # the block's first master byte
            state = core.copies[copy]
            # +1 rather than a bit flip, so that corrupting the same block twice does not undo it.
            state.write_at(offset, np.array([(int(state.bytes[offset]) + 1) & 0xFF], dtype=np.uint8))
        return {"tensor": tensor.name, "block": block, "lba": tensor.first_block + block,
                "copy": copy.name, "offset": offset}

    # ------------------------------------------------------------------ starting and ending

    def defer(self, chosen: Superblock) -> None:
        """Serve `chosen` now and verify it lazily (chosen.param_crcs must be present)."""
        self.verifying = True
        self._param_checked = np.zeros(self.core.total_blocks, dtype=bool)
        self._verify_thread = threading.Thread(target=self._verify_in_background, args=(chosen,),
                                               name=f"cossd-verify-{self.core.name}", daemon=True)
        self._verify_thread.start()

    def stop(self) -> None:
        """Stop the background pass (the namespace is closing); what it did not check stays
        unchecked, and the next open starts over."""
        self._verify_stop = True
        thread = self._verify_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Block until the background pass is over (passed, or stopped the namespace); False
        on timeout."""
        with self.core.cond:
            return self._wait_for_pass_locked(timeout)

    def await_verified_locked(self, wait: bool = True) -> None:
        """Wait (the caller holds the lock, which the wait releases) until the committed copy
        is verified whole; WouldBlock instead where the caller must not block."""
        if self.verifying and not wait:
            raise WouldBlock
        self._wait_for_pass_locked(None)

    def _wait_for_pass_locked(self, timeout: float | None) -> bool:
        """The wait itself, counted as a waiter (the pass then stops giving way to reads)."""
        if not self.verifying:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._verify_waiters += 1
        try:
            while self.verifying:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.core.cond.wait(left)
        finally:
            self._verify_waiters -= 1
        return True

    def _verify_in_background(self, chosen: Superblock) -> None:
        """The params first, as a trainer's first reads want them (a restart reads them ahead
        of time: prefetch.py), so that those reads mostly find their blocks checked; then
        every block whole, giving way to the host's reads."""
        started = time.perf_counter()
        bad: list[tuple[str, int]] = []
        failure: str | None = None
        try:
            bad = self._verify_params_first(chosen)
            for tensor in self.core.layouts if not bad else ():
                for block in range(tensor.block_count):
                    if self._verify_stop:
                        return
                    self._give_way_to_host_reads()
                    if self._block_fails(chosen, tensor, block):
                        bad.append((tensor.name, block))
        except BaseException as exc:  # a copy cut from under its mapping, an I/O error
            failure = f"verifying step {chosen.committed_step}: {exc}"
            log.exception("namespace %s: %s", self.core.name, failure)
        with self.core.cond:
            if self.verifying:
                if (bad or failure is not None) and self.core.sb is chosen:
                    self._discard_failed_step_locked(chosen, bad, failure)
                self.verified_in_s = time.perf_counter() - started
                self._end_verification_locked()
        if not bad and failure is None:
            log.info("namespace %s: step %d verified in the background in %.2f s", self.core.name,
                     chosen.committed_step, self.verified_in_s or 0.0)

    def _verify_params_first(self, chosen: Superblock) -> list[tuple[str, int]]:
        """Every param block against its param checksum, without giving way (it is the work
        the host's reads would do), PARAM_BATCH_BLOCKS blocks to a kernel call that releases
        the GIL: the daemon opens the device before its last imports (fs/mount_main.py) and
        this runs beside them. Returns the first block that fails, if any."""
        assert chosen.param_crcs is not None  # only such a step is verified lazily
        checked = self._param_checked
        for tensor in self.core.layouts:
            params = self.core.view(chosen.committed_copy, tensor, "param")
            at = tensor.first_block
            for first in range(0, tensor.block_count, PARAM_BATCH_BLOCKS):
                if self._verify_stop:
                    return []
                last = min(tensor.block_count, first + PARAM_BATCH_BLOCKS)
                if checked[at + first:at + last].all():
                    continue
                crcs = kernels.crc32c_blocks(params[first * BLOCK_ELEMS:last * BLOCK_ELEMS], 2 * BLOCK_ELEMS)
                failed = np.flatnonzero(crcs != chosen.param_crcs[at + first:at + last])
                if failed.size:
                    return [(tensor.name, first + int(failed[0]))]
                checked[at + first:at + last] = True
        return []

    def _give_way_to_host_reads(self) -> None:
        until = time.monotonic() + MAX_YIELD_PER_BLOCK_S
        while (not self._verify_stop and not self._verify_waiters and time.monotonic() < until
               and time.monotonic_ns() - self._last_host_read_ns < HOST_READ_QUIET_NS):
            time.sleep(YIELD_SLEEP_S)

    def _end_verification_locked(self) -> None:
        self.verifying = False
        self._param_checked = np.zeros(0, dtype=bool)
        self.core.cond.notify_all()

    # ------------------------------------------------------------------ the read path

    def check_params_before_serving(self, tensor: TensorLayout, offset: int, size: int, wait: bool) -> None:
        """Verify the param blocks that bytes [offset, offset + size) touch, each once, before
        they are served; a failure falls back and refuses this read. Runs without the lock:
        while the namespace verifies, its committed copy cannot change (no begin can run)."""
        self._last_host_read_ns = time.monotonic_ns()
        end = min(offset + size, tensor.numel * 2)
        if end <= offset:
            return
        first, last = offset // 2 // BLOCK_ELEMS, (end - 1) // 2 // BLOCK_ELEMS
        superblock = self.core.sb
        checked = self._param_checked
        todo = [block for block in range(first, last + 1)
                if self.verifying and not checked[tensor.first_block + block]]
        if not todo:
            return
        if not wait:
            raise WouldBlock  # reading cold media: not on the event loop
        for block in todo:
            if self._param_block_passes(superblock, tensor, block):
                checked[tensor.first_block + block] = True
                continue
            with self.core.cond:
                if self.verifying and self.core.sb is superblock:
                    self._discard_failed_step_locked(superblock, [(tensor.name, block)], None)
                    self._end_verification_locked()
            self.refuse_unservable()
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"namespace {self.core.name!r}: {tensor.name} block {block} fails its param checksum")

    # ------------------------------------------------------------------ a step that fails

    def _discard_failed_step_locked(self, failed: Superblock, bad: list[tuple[str, int]],
                                    failure: str | None) -> None:
        """`failed`, the step being served, has `bad` blocks (or could not be read: `failure`):
        stop the namespace (every read, step and snapshot refused) rather than switch the
        step under clients that may have read some of its params already. Where checksums
        failed, its superblock slot is also wiped, durably, so that the next open recovers
        the newest older step whose copy passes, as recovery at open would have chosen."""
        self.core.counters.checksum_failures += len(bad)
        errors = [(name, block, self.core.tensors[name].first_block + block) for name, block in bad]
        self.core.recovery_errors.extend(errors)
        sink = self.core.recovery_error_sink  # the device's error log
        if sink is not None:
            for error in errors:
                sink(error)
        what = failure or f"{len(bad)} block checksum(s) (first: {bad[0][0]} block {bad[0][1]})"
        if bad:
            try:
                self.core.slots[failed.slot].write(bytes(SUPERBLOCK_HEADER.itemsize))
                self.core.slots[failed.slot].sync()
                then = "it is discarded; remount the device to recover the newest older step that passes"
            except DeviceError as exc:
                then = f"it could not be discarded ({exc.message}); remounting will find it again"
        else:
            then = "remount the device to verify it again"
        reason = f"step {failed.committed_step} fails {what} found after the device was opened; {then}"
        self._unservable = reason
        self.media.damaged(reason)

    def refuse_unservable(self) -> None:
        reason = self._unservable
        if reason is not None:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"namespace {self.core.name!r}: {reason}")

    def verification_state(self) -> dict[str, Any]:
        """For statistics: whether the committed copy is still being verified."""
        checked = self._param_checked
        return {"verifying": self.verifying, "verified_in_s": self.verified_in_s,
                "param_blocks_checked": int(checked.sum()) if self.verifying else None}
