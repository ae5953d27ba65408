"""The device's one I/O entry (DeviceIO): every front-end's reads and writes of tensor files
and NVM data, its batched gradient writes and its admin submissions.

The three front-ends hand their decoded requests here: the FUSE mount (fs/operations.py,
fs/datapath.py) file by file, the network server (server/connection.py, server/writes.py) file
by file and in batches, and the controller memory buffer (CMB_WRITE, CMB_READ:
emulator/commands/cmb.py) in batches. A front-end resolves what a client names (a file, a
path, an nsid) to a namespace and a file (tensor and role, or None and "data" for an NVM
namespace) and calls these. What every request meets lives here, once:

- the injected data-path failures (INJECT_ERROR, queue "io"), consulted once per request
  (`checked=True`: this request consulted them already, through admit() or a *_nowait call;
  a CMB transfer is an admin command, which met its injections at Controller.execute);
- the dispatch by namespace kind, through the kind itself: each kind (emulator/namespace/core.py's
  Namespace, emulator/nvm.py's NvmNamespace and the computational kinds built on it) has the
  same io_* methods, so no front-end tells the kinds apart;
- the choice between the calls that never block and those that do, and the flush hints.

Errors are DeviceError with the status a completion would carry; each front-end completes the
request once from what these return or raise (errno for FUSE, a completion on the wire or in
the CMB command's).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Sequence

from ..protocol.entries import Completion, IoOpcode
from .device import Device
from .injection import Injector
from .kinds import AnyNamespace
from .namespace import CommitResult, Namespace
from .namespace.writes import GradPieces
from .transaction import StepTransaction

# The file an NVM namespace has: its data, addressed by byte offset (LBA x 4096).
DATA_ROLE = "data"


def committed_version(namespace: Namespace) -> tuple[int, bool]:
    """(superblock seq, still loading) of an optimizer namespace: the seq grows with every
    change of the committed state (commit, rollback, seal), so a front-end's copy of the
    committed params (server/param_cache.py) is valid while this pair is unchanged and the
    namespace is not loading (initial state is written in place, under one seq)."""
    return namespace._sb.seq, namespace.loading


@dataclasses.dataclass(frozen=True)
class Staged:
    """A gradient write taken without blocking: its length, and the implicit step it
    completed (None: none), which DeviceIO.finish must commit before the write is
    acknowledged."""

    written: int
    implicit: StepTransaction | None


class DeviceIO:
    """Tensor and NVM data I/O and admin commands of one device, through its controller.

    The controller holds it (Controller.io) and hands it its parts: the device, the armed
    injections and its own submit (this module does not import the controller, which imports
    it)."""

    def __init__(self, device: Device, injector: Injector,
                 submit: Callable[[bytes], Completion]) -> None:
        self.device = device
        self._injector = injector
        self._submit = submit

    # ------------------------------------------------------------------ commands

    def submit(self, submission: bytes) -> Completion:
        """One 64-byte submission (and its payload, as the controller takes it) -> completion."""
        return self._submit(submission)

    # ------------------------------------------------------------------ injections

    def admit(self, opcode: IoOpcode, namespace: AnyNamespace) -> None:
        """Consult the data path's armed injections for one request (READ or WRITE) of
        `namespace`: an armed failure raises here, logged, and the request must not run. A
        front-end calls this itself only where something of its own comes between the
        request's arrival and the device taking it (the server's lease handover); then it
        passes checked=True to the call that follows."""
        self._injector.check_io(opcode, namespace.nsid)

    # ------------------------------------------------------------------ reads

    def read(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int, size: int,
             *, checked: bool = False) -> bytes:
        """Bytes of a committed state array or of NVM data, copied (blocking). `checked`: a
        read_nowait of this same request returned None, having consulted the injections
        already (a request meets an armed failure once)."""
        if not checked:
            self.admit(IoOpcode.READ, namespace)
        return namespace.io_read(tensor, role, offset, size)

    def read_nowait(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                    size: int) -> memoryview | bytes | None:
        """A read that never blocks (for an event loop): a view valid until the caller yields,
        or None where it would block; then call read(..., checked=True) on a thread. An
        injected failure raises here as in read()."""
        self.admit(IoOpcode.READ, namespace)
        return namespace.io_read_nowait(tensor, role, offset, size)

    @contextlib.contextmanager
    def read_view(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                  size: int) -> Iterator[bytes | memoryview]:
        """The bytes of a read without a copy where the kind allows: a view of the committed
        copy that no commit or rollback moves until the block exits (blocking)."""
        self.admit(IoOpcode.READ, namespace)
        with namespace.io_read_view(tensor, role, offset, size) as view:
            yield view

    @contextlib.contextmanager
    def read_many(self, namespace: AnyNamespace, reads: Sequence[tuple[str | None, str, int, int]],
                  *, checked: bool = False) -> Iterator[Sequence[bytes | memoryview]]:
        """Several (tensor, role, offset, size) ranges of one namespace as one request, without
        a copy where the kind allows: of an optimizer namespace all of one committed step,
        views that no commit or rollback moves until the block exits (blocking)."""
        if not checked:
            self.admit(IoOpcode.READ, namespace)
        with namespace.io_read_many(reads) as views:
            yield views

    # ------------------------------------------------------------------ writes

    def write(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
              data: bytes | memoryview, *, checked: bool = False) -> int:
        """A write of NVM data, gradients (the write that completes an implicit step returns
        once it is committed or skipped) or initial state (blocking). `data` must not
        change later: a gradient block may still be read from it after this returns.
        `checked`: as for read()."""
        if not checked:
            self.admit(IoOpcode.WRITE, namespace)
        return namespace.io_write(tensor, role, offset, data)

    def write_nowait(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                     data: bytes) -> Staged | None:
        """A gradient write that never blocks (for an event loop), or None where it would
        (and for every other write): then call write(..., checked=True) on a thread. An
        injected failure raises here as in write()."""
        self.admit(IoOpcode.WRITE, namespace)
        staged = namespace.io_write_nowait(tensor, role, offset, data)
        return None if staged is None else Staged(*staged)

    def finish(self, namespace: AnyNamespace, staged: Staged) -> None:
        """Commit (or skip) the implicit step a write_nowait completed (blocking)."""
        if staged.implicit is not None:
            namespace.io_finish(staged.implicit)

    def write_grads(self, namespace: AnyNamespace, pieces: GradPieces, *,
                    checked: bool = False) -> CommitResult | None:
        """Gradients of several ranges as one request, from memory the caller lends until this
        returns (the CMB, a network receive buffer: no copy by the front-end); the commit's
        result where they completed an implicit step. NAMESPACE_KIND_MISMATCH for a kind
        without gradients. `checked`: as for read()."""
        if not checked:
            self.admit(IoOpcode.WRITE, namespace)
        return namespace.io_write_grads(pieces)

    # ------------------------------------------------------------------ durability hints

    def flush_wanted(self, namespace: AnyNamespace) -> bool:
        """Whether the front-end should have `namespace` flushed in the background now: the
        device runs in power-loss-protected mode (commits are not synced inline) and the
        namespace has a committed step that is not durable yet."""
        return not self.device.config.sync and bool(namespace.flush_pending)
