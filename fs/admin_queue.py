"""One open() of the control file as a bounded queue pair: submissions taken from a byte stream,
completions read back in order, and the daemon memory both may hold, per handle and in total.

Why bounded: a client that writes commands and never reads their completions, or that leaves
submissions half written on many handles, would otherwise grow the daemon without limit
(measured: 48 MB to 1.2 GB in 8 s with one handle; +850 MB with 48 half-written 16 MiB
payloads). The limits and the errnos are documented in docs/command-set.md (transport) and
docs/errno.md (the control file).
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import threading
from typing import Callable

import pyfuse3

from ..protocol.entries import SUBMISSION, Completion, SubmissionError, submission_length

log = logging.getLogger(__name__)

HEADER = SUBMISSION.itemsize

# Unread completions one queue pair may hold before a write that would run another command is
# refused with EAGAIN (an NVMe completion queue is full at its depth too): by count, and by
# bytes (a completion carries up to a log page of data).
QUEUE_DEPTH = 1024
QUEUE_BYTES = 8 << 20
# Unread completion bytes of all queue pairs together; past it every queue pair that holds an
# unread completion is full. A queue pair with none may always run one command, so a client
# that reads each completion is never refused because of other clients.
TOTAL_QUEUED_BYTES = 64 << 20
# Bytes of partly written submissions (a payload that arrives over several writes) held for all
# queue pairs together. One queue pair holds at most one submission: 64 + 16 MiB. A write whose
# unfinished tail would pass the total is refused with ENOMEM.
TOTAL_PENDING_BYTES = 64 << 20
# What a queued completion is charged beyond its bytes: the objects that hold it.
COMPLETION_OVERHEAD = 96


class Budget:
    """Bytes that all queue pairs of a daemon hold together: unread completions and partly
    written submissions. Data path threads share it, hence the lock."""

    def __init__(self, pending_limit: int = TOTAL_PENDING_BYTES, queued_limit: int = TOTAL_QUEUED_BYTES) -> None:
        self.pending_limit = pending_limit
        self.queued_limit = queued_limit
        self.pending = 0
        self.queued = 0
        self._lock = threading.Lock()

    def reserve_pending(self, size: int) -> bool:
        with self._lock:
            if self.pending + size > self.pending_limit:
                return False
            self.pending += size
            return True

    def release_pending(self, size: int) -> None:
        with self._lock:
            self.pending -= size

    def add_queued(self, size: int) -> None:
        with self._lock:
            self.queued += size

    def release_queued(self, size: int) -> None:
        with self._lock:
            self.queued -= size

    @property
    def queue_full(self) -> bool:
        return self.queued >= self.queued_limit


# One budget per daemon process (a daemon serves one device).
BUDGET = Budget()


def _refuse(code: int, why: str) -> pyfuse3.FUSEError:
    # Debug only: a client retrying in a loop must not fill the daemon log.
    log.debug("control file write refused (%s): %s", errno.errorcode[code], why)
    return pyfuse3.FUSEError(code)


@dataclasses.dataclass
class AdminHandle:
    """One open() of the control file: a queue pair. Completions are read back in order."""

    budget: Budget = dataclasses.field(default_factory=lambda: BUDGET)
    # The submission being received: its header bytes, then payload pieces (charged to the
    # budget) and its total length once the header is whole.
    head: bytearray = dataclasses.field(default_factory=bytearray)
    pieces: list[bytes] = dataclasses.field(default_factory=list)
    held: int = 0
    needed: int = 0
    completions: collections.deque[bytes] = dataclasses.field(default_factory=collections.deque)
    queued_bytes: int = 0  # charged for the completions and the unread rest
    unread: bytes = b""
    # Writes run one at a time per queue pair (the data path's threads may take two requests of
    # one open() at once); the queue has its own lock, so a read never waits for a command.
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    queue_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    # ------------------------------------------------------------------ submissions

    def _room(self) -> bool:
        """Whether one more completion may be queued."""
        with self.queue_lock:
            if not self.completions and not self.unread:
                return True
            return (len(self.completions) + bool(self.unread) < QUEUE_DEPTH and self.queued_bytes < QUEUE_BYTES
                    and not self.budget.queue_full)

    def _drop_pending(self) -> None:
        self.budget.release_pending(self.held)
        self.head.clear()
        self.pieces.clear()
        self.held = self.needed = 0

    def take(self, buf: bytes | memoryview, submit: Callable[[bytes], Completion]) -> int:
        """Take `buf` from the stream: run each submission it completes (submit), in order, and
        hold an unfinished tail. Returns the bytes taken: fewer than given (a short write) where
        the completion queue filled or the pending budget ran out part way; where it could take
        nothing, raises EAGAIN (queue full: read completions, then write the rest again) or
        ENOMEM (the daemon holds all the partly written submissions it may). A data_len past
        16 MiB is EINVAL and discards this handle's unfinished input (a short write first, where
        submissions before it in the same write ran)."""
        view = memoryview(buf).cast("B")
        pos = 0
        while pos < len(view):
            # The header first: looked at, not taken, until it is known what happens to the
            # submission, so that a refused write takes nothing of the one it stops at.
            head = view[pos : pos + HEADER - len(self.head)]
            if len(self.head) + len(head) < HEADER:
                self.head += head  # at most 64 bytes a handle: not charged
                return len(view)
            if len(self.head) < HEADER:
                try:
                    needed = submission_length(bytes(self.head) + bytes(head)) - HEADER
                except SubmissionError as exc:
                    self._drop_pending()
                    log.info("rejected submission: %s", exc)
                    if pos:
                        # Submissions before it in this write have run: say so with a short
                        # write (a retry of the rest meets the bad header alone: EINVAL),
                        # rather than an error that a client would answer by running them again.
                        return pos
                    raise pyfuse3.FUSEError(errno.EINVAL) from None
            else:
                needed = self.needed
            body = pos + len(head)
            missing, available = needed - self.held, len(view) - body
            if available < missing:  # the tail stays held until the rest arrives
                if not self.budget.reserve_pending(available):
                    if pos:
                        return pos
                    raise _refuse(errno.ENOMEM, f"partly written submissions hold {self.budget.pending} bytes "
                                                f"(at most {self.budget.pending_limit})")
                self.head += head
                self.needed = needed
                if available:
                    self.pieces.append(bytes(view[body:]))
                    self.held += available
                return len(view)
            if not self._room():
                if pos:
                    return pos
                raise _refuse(errno.EAGAIN, f"{len(self.completions) + bool(self.unread)} completions unread")
            raw = b"".join([self.head, head, *self.pieces, view[body : body + missing]])
            pos = body + missing
            self._drop_pending()
            self._queue(submit(raw).encode())
        return pos

    # ------------------------------------------------------------------ completions

    def _queue(self, completion: bytes) -> None:
        charge = len(completion) + COMPLETION_OVERHEAD
        with self.queue_lock:
            self.completions.append(completion)
            self.queued_bytes += charge
        self.budget.add_queued(charge)

    def read(self, size: int) -> bytes:
        """Completions read as a stream: entry then data; a short read leaves the rest."""
        with self.queue_lock:
            if not self.unread:
                if not self.completions:
                    return b""
                self.unread = self.completions.popleft()
            chunk, self.unread = self.unread[:size], self.unread[size:]
            freed = len(chunk) + (0 if self.unread else COMPLETION_OVERHEAD)
            self.queued_bytes -= freed
        self.budget.release_queued(freed)
        return chunk

    def close(self) -> None:
        """At release: give back what this handle held."""
        with self.lock:
            self._drop_pending()
        with self.queue_lock:
            freed, self.queued_bytes = self.queued_bytes, 0
            self.completions.clear()
            self.unread = b""
        self.budget.release_queued(freed)
