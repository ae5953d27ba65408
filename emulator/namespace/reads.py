"""Reads of an optimizer namespace's committed state (copied, in place or pinned) and the range checks of every transfer."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

from ...protocol.status import DeviceError, Status
from ..layout import Copy
from . import param_fp8
from .held_loads import check_values
from .common import LOADABLE_ROLES, MOMENT_ROLES, ROLES, WouldBlock, decoded_moment_bytes
from .media import NamespaceMedia
from .state import NamespaceCore
from .verify import CopyVerifier


class Reads:
    """Reads of the committed state (copied, in place, pinned) and the range checks of reads and state loads.

    Owns nothing: a read pins core.pins and counts in core.counters; it waits on the
    verifier where the copy is not yet verified, and refuses a damaged copy (media part).
    """

    def __init__(self, core: NamespaceCore, media: NamespaceMedia, verifier: CopyVerifier) -> None:
        self.core = core
        self.media = media
        self.verifier = verifier
        # FP8 params out (param_wire_dtype): the param_fp8 files, made from the masters.
        self.param_fp8 = (param_fp8.ParamFp8(core, core.spec.param_wire_dtype) if core.spec.param_wire_dtype
                          else None)

    def read(self, tensor_name: str, role: str, offset: int, size: int) -> bytes:
        """Bytes of a committed state array (param, master or a moment)."""
        return self._read(tensor_name, role, offset, size, wait=True, copy=True)

    def read_nowait(self, tensor_name: str, role: str, offset: int, size: int) -> memoryview | None:
        """read() without the copy and without blocking, for the fs layer's event loop.

        A view of the committed copy: valid while the caller does not yield, because a later
        step can only write into this copy after a step that begins on a request this same
        loop has yet to take. None where it would block (timed mode, or the namespace lock is
        held, perhaps across a flush): call read() in a thread instead.
        """
        if self.core.timing.timed:
            return None
        try:
            with self.core.timing.command("read"):
                return self._read(tensor_name, role, offset, size, wait=False, copy=False)
        except WouldBlock:
            return None

    @contextlib.contextmanager
    def read_pinned(self, tensor_name: str, role: str, offset: int, size: int) -> Iterator[bytes | memoryview]:
        """read() without the copy, for a reply written from the committed copy itself (the
        fs data path's threads): a commit or rollback waits until the block exits, so the
        view cannot change under the reply. In timed mode the wait comes before the view."""
        with self.read_pinned_many([(tensor_name, role, offset, size)]) as views:
            yield views[0]

    @contextlib.contextmanager
    def read_pinned_many(self, reads: Sequence[tuple[str, str, int, int]]) -> Iterator[list[bytes | memoryview]]:
        """read_pinned of several (tensor, role, offset, size) ranges under one pin, so every
        view is of the same committed step."""
        if not reads:
            yield []
            return
        with self.core.timing.command("read"):
            pinned = self._read_copy_pinned(*reads[0])
        try:
            views = [pinned[1]]
            # Every other range from the same pinned copy: one step's bytes, whatever commits.
            for tensor_name, role, offset, size in reads[1:]:
                with self.core.timing.command("read"):
                    views.append(self._read(tensor_name, role, offset, size, wait=True, copy=False,
                                            copy_of=pinned[0]))
            yield views
        finally:
            self.core.unpin(pinned[0])

    def _read_copy_pinned(self, tensor_name: str, role: str, offset: int, size: int) -> tuple[Copy, Any]:
        """A view of the committed copy with that copy pinned: (the copy, the view); the
        caller unpins it."""
        holder: list[Copy] = []
        view = self._read(tensor_name, role, offset, size, wait=True, copy=False, pin=holder)
        return holder[0], view

    def _read(self, tensor_name: str, role: str, offset: int, size: int, *, wait: bool, copy: bool,
              pin: list[Copy] | None = None, copy_of: Copy | None = None) -> Any:
        """The bytes (copy=True: copied while no commit can move the committed copy) or a view.
        pin=[] pins the committed copy and appends it (see pinned_committed); the caller
        unpins. copy_of reads a copy this caller has pinned already (committed or not since)."""
        tensor = self.core.tensor(tensor_name)
        if role == "grad":
            raise DeviceError(Status.ACCESS_DENIED, "grad files are write-only")
        file_size = self.core.file_bytes(tensor, role)
        if self.verifier.verifying and role == "param":
            # Reopened and not yet verified whole: each param block is checked the first
            # time it is served (namespace/verify.py).
            self.verifier.check_params_before_serving(tensor, offset, size, wait)
        if not self.core.lock.acquire(blocking=wait):
            raise WouldBlock
        try:
            if self.verifier.verifying and role != "param":
                self.verifier.await_verified_locked(wait)  # master and moments: once all is verified
            self.verifier.refuse_unservable()
            source = self.core.sb.committed_copy if copy_of is None else copy_of
            state = self.core.copies[source]
            # A damaged copy (cut short, holes, replaced; a page the guard replaced with
            # zeros) is never served as the state: refused before the pin, so no unpin is owed.
            self.media.refuse_damaged(state)
            if pin is not None:
                self.core.pins[source] += 1  # first: nothing below raises, so the caller's unpin matches
                pin.append(source)
            # Every read request served counts, an empty one at the end of the file too.
            self.core.counters.read_commands += 1
            if offset >= file_size or size <= 0:
                return b""
            end = min(file_size, offset + size)
            if self.core.scaled and role in MOMENT_ROLES:
                # Block-scaled moments read as FP32: the blocks the range touches, decoded.
                view = decoded_moment_bytes(self.core.view(source, tensor, role),
                                            self.core.view(source, tensor, role + "_scale"),
                                            self.core.state_format, role, offset, end)
            elif role == param_fp8.ROLE:
                # Made from the committed masters on the first read after a step, then kept.
                assert self.param_fp8 is not None  # file_bytes refused it otherwise
                view = self.param_fp8.committed(tensor, source)[offset:end]
                if state.faults():  # the masters met a page cut from under the mapping
                    self.media.refuse_damaged(state)
            else:
                view = self.core.view(source, tensor, role).view(np.uint8)[offset:end]
            self.core.counters.bytes_read += len(view)
            if role in ("param", param_fp8.ROLE):
                self.core.counters.param_bytes_out += len(view)
            self.core.timing.add(host_out=len(view), media_read=len(view))
            if not copy:
                return view.data  # a memoryview of the copy's bytes
            data = view.tobytes()
            if state.faults():  # the copy itself met a page cut from under the mapping
                self.media.refuse_damaged(state)
            return data
        finally:
            self.core.lock.release()

    def check_write(self, tensor_name: str, role: str, offset: int, length: int,
                    data: bytes | memoryview | None = None,
                    pending: set[tuple[str, str, int]] | None = None) -> None:
        """Refuse, changing nothing, a write that write_state would refuse for its file,
        range or timing (state is writable only before the first step), and with `data`
        (its bytes) for its values (held_loads.check_values). `pending`: the scale blocks
        the batch's writes checked before this one will hold in part (check_scaled_load)."""
        tensor = self.core.tensor(tensor_name)
        if role not in LOADABLE_ROLES:
            raise DeviceError(Status.ACCESS_DENIED, f"{role} is not writable")
        self.core.check_range(tensor, role, offset, length)
        self.core.check_scaled_load(tensor, role, offset, length, pending)
        if data is not None and length:
            scaled = self.core.scaled and role in MOMENT_ROLES
            dtype = np.float32 if scaled else self.core.role_dtype(role)
            check_values(tensor.name, role, offset // self.core.itemsize(role), np.frombuffer(data, dtype=dtype))
        if not self.core.loading:
            raise DeviceError(
                Status.STATE_SEALED,
                f"{tensor.name}/{role} can only be written before the first step "
                f"(namespace is at step {self.core.sb.committed_step})",
            )

    def check_read(self, tensor_name: str, role: str, offset: int, length: int) -> None:
        """Refuse, changing nothing, a read of bytes [offset, offset + length) of a tensor file
        that is not wholly inside a readable file (a transfer whose size the reader fixed
        beforehand, as CMB_READ's, cannot end short the way a file read does)."""
        tensor = self.core.tensor(tensor_name)
        if role not in ROLES and role != param_fp8.ROLE:
            raise DeviceError(Status.INVALID_FIELD, f"{tensor_name}: no file {role!r} (one of {', '.join(ROLES)})")
        if role == "grad":
            raise DeviceError(Status.ACCESS_DENIED, "grad files are write-only")
        size = self.core.file_bytes(tensor, role)
        if offset < 0 or length < 0 or offset + length > size:
            raise DeviceError(
                Status.LBA_OUT_OF_RANGE,
                f"{tensor_name}/{role}: read of {length} bytes at {offset} passes the end ({size} bytes)",
            )
