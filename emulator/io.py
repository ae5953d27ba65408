"""The device's one I/O entry: reads and writes of tensor files and NVM data, and admin
submissions, for every front-end (the FUSE mount today; a network server beside it).

A front-end resolves what a client names (a file, a path, an nsid) to a namespace and a file
(tensor and role, or None and "data" for an NVM namespace) and calls these; the kind
dispatch, the injected data-path failures (INJECT_ERROR, queue "io"), the choice between the
calls that never block and those that do, and the flush hints live here, once. Errors are
DeviceError with the status a completion would carry; each front-end maps them (errno for
FUSE, a completion on the wire).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from ..protocol.entries import Completion, IoOpcode
from .controller import Controller
from .kinds import AnyNamespace
from .namespace import Namespace
from .nvm import NvmNamespace
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
    """Tensor and NVM data I/O and admin commands of one device, through its controller."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.device = controller.device

    # ------------------------------------------------------------------ commands

    def submit(self, submission: bytes | memoryview) -> Completion:
        """One 64-byte submission (and its payload, as the controller takes it) -> completion."""
        return self.controller.submit(submission)

    # ------------------------------------------------------------------ reads

    def read(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int, size: int,
             *, checked: bool = False) -> bytes:
        """Bytes of a committed state array or of NVM data, copied (blocking). `checked`: a
        read_nowait of this same request returned None, having consulted the injections
        already (a request meets an armed failure once)."""
        if not checked:
            self.controller.injector.check_io(IoOpcode.READ, namespace.nsid)
        if isinstance(namespace, NvmNamespace):
            return namespace.read(offset, size)
        assert tensor is not None
        return namespace.read(tensor, role, offset, size)

    def read_nowait(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                    size: int) -> memoryview | bytes | None:
        """A read that never blocks (for an event loop): a view valid until the caller yields,
        or None where it would block; then call read(..., checked=True) on a thread. An
        injected failure raises here as in read()."""
        self.controller.injector.check_io(IoOpcode.READ, namespace.nsid)
        if isinstance(namespace, NvmNamespace):
            return None
        assert tensor is not None
        return namespace.read_nowait(tensor, role, offset, size)

    @contextlib.contextmanager
    def read_view(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                  size: int) -> Iterator[bytes | memoryview]:
        """The bytes of a read without a copy where the kind allows: a view of the committed
        copy that no commit or rollback moves until the block exits (blocking)."""
        self.controller.injector.check_io(IoOpcode.READ, namespace.nsid)
        if isinstance(namespace, NvmNamespace):
            yield namespace.read(offset, size)
            return
        assert tensor is not None
        with namespace.read_pinned(tensor, role, offset, size) as view:
            yield view

    # ------------------------------------------------------------------ writes

    def write(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
              data: bytes | memoryview, *, checked: bool = False) -> int:
        """A write of NVM data, gradients (the write that completes an implicit step returns
        once it is committed or skipped) or initial state (blocking). `data` must not
        change later: a gradient block may still be read from it after this returns.
        `checked`: as for read()."""
        if not checked:
            self.controller.injector.check_io(IoOpcode.WRITE, namespace.nsid)
        if isinstance(namespace, NvmNamespace):
            return namespace.write(offset, data)
        assert tensor is not None
        if role == "grad":
            return namespace.write_grad(tensor, offset, data)
        return namespace.write_state(tensor, role, offset, data)

    def write_nowait(self, namespace: AnyNamespace, tensor: str | None, role: str, offset: int,
                     data: bytes) -> Staged | None:
        """A gradient write that never blocks (for an event loop), or None where it would
        (and for every other write): then call write(..., checked=True) on a thread. An
        injected failure raises here as in write()."""
        self.controller.injector.check_io(IoOpcode.WRITE, namespace.nsid)
        if not isinstance(namespace, Namespace) or role != "grad":
            return None
        assert tensor is not None
        staged = namespace.write_grad_nowait(tensor, offset, data)
        return None if staged is None else Staged(*staged)

    def finish(self, namespace: AnyNamespace, staged: Staged) -> None:
        """Commit (or skip) the implicit step a write_nowait completed (blocking)."""
        if staged.implicit is not None:
            assert isinstance(namespace, Namespace)
            namespace.finish_implicit_step(staged.implicit)

    # ------------------------------------------------------------------ durability hints

    def flush_wanted(self, namespace: AnyNamespace) -> bool:
        """Whether the front-end should have `namespace` flushed in the background now: the
        device runs in power-loss-protected mode (commits are not synced inline) and the
        namespace has a committed step that is not durable yet."""
        return not self.device.config.sync and bool(getattr(namespace, "flush_pending", False))
