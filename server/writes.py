"""The wire's WRITE command on one connection: its bulk data received under the server's shared
receive memory (server/recv_memory.py), whole then taken (the atomic way), or gradients staged
in bounded pieces as they arrive; the buffer given back when the connection goes idle. Every
range goes to the device through its one I/O entry (DeviceIO, emulator/io.py): gradients of an
optimizer namespace as one lent batch (write_grads), the rest range by range (write)."""
from __future__ import annotations

import json
import logging
import mmap
import queue
import threading
from typing import Any, Protocol, cast

import numpy as np

from ..emulator.face import AnyNamespace, CommitResult, DeviceError, DeviceIO, Namespace, Status
from ..protocol import wire
from ..protocol.entries import Completion
from ..protocol.wire import FatalError, PduType, WireError

from .paths import OpenFile
from .recv_memory import RecvMemory

log = logging.getLogger(__name__)

# A WRITE of gradients at least this large goes to the device as its PDUs arrive (smaller
# ones are received whole first: nothing to overlap).
STREAM_MIN_BYTES = 4 << 20
# A streamed WRITE is received into two slots, each one H2CData PDU's data (at most the
# MAXH2CDATA the server grants) plus the bytes of an element cut by the PDU before (at most
# 3: an FP32 gradient's): the next PDU is received into one slot while the device takes the
# other's gradients, so a WRITE of any size holds at most 2 x (16 MiB + 3) bytes (one slot
# where the budget is smaller).
MAX_CARRY = 3
SLOT_BYTES = wire.MAX_DATA_BYTES + MAX_CARRY
# Refused bulk data leaves the stream through a scratch buffer this large.
SKIP_BYTES = 1 << 16

Piece = tuple[str, int, memoryview, None]


class Writer(Protocol):
    """What a WRITE needs of its connection (server/connection.py's Connection), declared
    here so that this module does not import that one."""

    peer: str
    io: DeviceIO
    reader: wire.PduReader
    digests: wire.Digest
    steps: dict[int, int]

    def files(self, table: np.ndarray, writing: bool) -> list[tuple[OpenFile, AnyNamespace]]: ...

    def forget_step(self, nsid: int) -> None: ...

    def write_one(self, opened: OpenFile, namespace: AnyNamespace, offset: int, view: memoryview) -> None: ...

    def admit(self, namespace: AnyNamespace) -> None: ...

    def adopt(self, namespace: Namespace) -> None: ...


class Writes:
    """A connection's WRITEs and its receive buffer, taken from `memory` as a WRITE needs it
    and given back (release) when the connection is idle or closes."""

    def __init__(self, connection: Writer, memory: RecvMemory) -> None:
        self.connection = connection
        self.memory = memory
        # An anonymous mapping, not a bytearray: dropped, it goes back to the system at once
        # (munmap), where malloc would keep a freed 24 MiB block in this thread's arena for
        # the next allocation of any thread of it, and the process would grow past the budget.
        self._buffer: mmap.mmap | None = None
        self._held = 0  # bytes of `memory` this connection holds: the buffer's size

    @property
    def held(self) -> int:
        return self._held

    def release(self) -> int:
        """Give the buffer back to the server's budget and the system; the bytes given back.
        (A view of it still alive elsewhere keeps the mapping until that view goes.)"""
        freed, self._held = self._held, 0
        if self._buffer is not None:
            try:
                self._buffer.close()
            except BufferError:
                pass  # unmapped when the last view is dropped
            self._buffer = None
        self.memory.release(freed)
        return freed

    def _take(self, nbytes: int, what: str) -> memoryview:
        """A buffer of at least `nbytes`, within the budget: the one held if large enough,
        else it is given back first (so a waiting connection holds nothing) and a new one
        taken, waiting up to the budget's bound; DeviceError (nothing taken) where it is not."""
        if self._held < nbytes or self._buffer is None:
            self.release()
            self.memory.acquire(nbytes, what)
            try:
                self._buffer = mmap.mmap(-1, max(1, nbytes))
            except OSError as exc:
                self.memory.release(nbytes)
                raise DeviceError(Status.COMMAND_INTERRUPTED, f"{what}: the server cannot map "
                                                              f"{nbytes} bytes ({exc.strerror})") from None
            self._held = nbytes
        return memoryview(self._buffer)

    # ------------------------------------------------------------------ WRITE

    def write(self, cid: int, data: memoryview) -> Completion:
        table = wire.decode_transfers(data)
        lengths = [int(length) for length in table["length"]]
        total = sum(lengths)
        if total > wire.MAX_BATCH_BYTES:
            raise WireError(FatalError.DATA_TRANSFER_LIMIT_EXCEEDED,
                            f"a WRITE of {total} bytes, more than {wire.MAX_BATCH_BYTES}")
        streamed = self._streamable(table, lengths, total)
        if streamed is not None:
            return self._write_streamed(cid, table, lengths, total, *streamed)
        try:
            buffer = self._take(total, f"a WRITE of {total} bytes")
        except DeviceError:
            self._skip_bulk(cid, total)  # the host sent it after the capsule: out of the stream
            raise
        bulk, failed = self._receive_whole(cid, buffer[:total])
        if failed is not None:
            raise failed
        files = self.connection.files(table, writing=True)
        pieces: dict[int, list[Piece]] = {}
        optimizers: dict[int, Namespace] = {}  # the namespace of each nsid that has pieces
        position = 0
        singles = []
        for (opened, namespace), offset, length in zip(files, table["offset"], lengths):
            view = bulk[position : position + length]
            position += length
            optimizer = namespace.as_optimizer()
            if optimizer is not None and opened.role == "grad":
                # A grad file is a tensor's: resolve_open leaves the tensor None only for NVM data.
                tensor = cast(str, opened.tensor)
                pieces.setdefault(opened.nsid, []).append((tensor, int(offset), view, None))
                optimizers[opened.nsid] = optimizer
            else:
                singles.append((opened, namespace, int(offset), view))
        # All or nothing: every range is checked, and every namespace's injections consulted,
        # before the first is taken, so a refused WRITE changes nothing (a client told it
        # failed may send it again without feeding a step twice).
        _check_singles(singles)
        _check_grads(pieces, optimizers)
        for namespace in {id(namespace): namespace for _, namespace in files}.values():
            self.connection.admit(namespace)
        report: dict[str, Any] = {"bytes": total, "transfers": len(lengths)}
        status = Status.SUCCESS
        for opened, namespace, offset, view in singles:
            self.connection.write_one(opened, namespace, offset, view)
        for nsid, batch in pieces.items():
            optimizer = optimizers[nsid]
            # The device's gradient path for memory lent until the call returns (as CMB_WRITE
            # lends the CMB): the receive buffer itself, no copy by this front-end. The
            # injections were consulted above; adopt hands a lease held on the step over.
            self.connection.adopt(optimizer)
            result = self.connection.io.write_grads(optimizer, batch, checked=True)
            status = self._after(optimizer, result, report, status)
        return Completion(cid, status, result=total & 0xFFFF_FFFF, data=json.dumps(report).encode())

    def drop_bulk(self, cid: int, suspect_table: memoryview) -> None:
        """A WRITE refused before it ran because its table failed its data digest: the bulk
        the host sent after the capsule leaves the stream, as much as the table says (its
        ranges are still whole entries; a damaged length makes the next PDU's checks end the
        connection, as any framing error does). A table that does not decode is left alone:
        the next capsule's read then finds H2CData and ends the connection."""
        try:
            table = wire.decode_transfers(suspect_table)
        except DeviceError:
            return
        total = sum(int(length) for length in table["length"])
        if 0 < total <= wire.MAX_BATCH_BYTES:
            self._skip_bulk(cid, total)

    def _after(self, namespace: Namespace, result: CommitResult | None, report: dict[str, Any],
               status: Status) -> Status:
        if namespace.step_open is not None:
            self.connection.steps[namespace.nsid] = namespace.step_open
        if result is None:
            return status
        report["commit"] = {"step": result.step, "committed_step": result.committed_step, "skipped": result.skipped}
        self.connection.forget_step(namespace.nsid)
        return Status.STEP_SKIPPED_NONFINITE if result.skipped else status

    def _next_data(self, cid: int, received: int, total: int) -> int:
        """The next H2CData PDU's head, checked to carry command `cid`'s bytes from `received`
        in order; its data length (the data itself is the caller's to read)."""
        head = self.connection.reader.read_head(self.connection.digests)
        if head.type != PduType.H2C_DATA:
            raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected H2CData, got {head.type.name}")
        cccid, _ttag, datao, datal = head.data_header()
        if cccid != cid or datao != received or datal != head.data_len or received + datal > total:
            raise WireError(FatalError.DATA_OUT_OF_RANGE,
                            f"H2CData of command {cccid} at {datao}+{datal}; expected {cid} at {received}, "
                            f"{total - received} bytes left")
        return datal

    def _receive_whole(self, cid: int, bulk: memoryview) -> tuple[memoryview, DeviceError | None]:
        """The H2CData PDUs of a WRITE, received in order straight into `bulk`; a data digest
        that failed is reported once the whole transfer is in."""
        received, failed, total = 0, None, len(bulk)
        while received < total:
            datal = self._next_data(cid, received, total)
            try:
                self.connection.reader.read_data(bulk[received : received + datal])
            except DeviceError as exc:
                failed = failed or exc
            received += datal
        return bulk, failed

    def _skip_bulk(self, cid: int, total: int) -> None:
        """Receive and drop a refused WRITE's bulk, so the next capsule is where it should be."""
        scratch = memoryview(bytearray(SKIP_BYTES))
        received = 0
        while received < total:
            datal = self._next_data(cid, received, total)
            self.connection.reader.skip_data(scratch)
            received += datal

    # ------------------------------------------------------------------ streamed WRITE

    def _streamable(self, table: np.ndarray, lengths: list[int], total: int,
                    ) -> tuple[Namespace, list[OpenFile]] | None:
        """Where a WRITE's gradients may go to the device as they arrive: at least
        STREAM_MIN_BYTES, every range a whole-element range of one optimizer namespace's grad
        files, inside them and apart from each other (what write_grads_lent checks first).
        None sends the WRITE the atomic way (received whole, then checked and taken)."""
        if total < STREAM_MIN_BYTES:
            return None
        try:
            files = self.connection.files(table, writing=True)
        except DeviceError:
            return None
        namespace = files[0][1].as_optimizer()
        if namespace is None or any(
                opened.role != "grad" or opened.nsid != namespace.nsid for opened, _ in files):
            return None
        spans: dict[str | None, list[tuple[int, int]]] = {}
        itemsize = namespace.itemsize("grad")
        for (opened, _), offset, length in zip(files, table["offset"], lengths):
            start = int(offset)
            if start % itemsize or length % itemsize or start + length > opened.size:
                return None
            spans.setdefault(opened.tensor, []).append((start, start + length))
        for ranges in spans.values():
            ranges.sort()
            if any(end > start for (_, end), (start, _) in zip(ranges, ranges[1:])):
                return None
        return namespace, [opened for opened, _ in files]

    def _write_streamed(self, cid: int, table: np.ndarray, lengths: list[int], total: int,
                        namespace: Namespace, files: list[OpenFile]) -> Completion:
        """A WRITE of gradients staged as its PDUs arrive, in bounded memory: each PDU is
        received into one of two slots while a thread hands the other's whole elements to
        write_grads_lent (which returns once it no longer reads them), so the kernels run
        under the transfer (one slot, no overlap, where the budget is under two). The ranges
        were checked against each other first; what the open step already has is checked per
        piece, so a duplicate refuses the WRITE from that piece on (GRADIENT_DUPLICATE), the
        pieces before it taken, as file writes are."""
        slot_bytes = min(total, SLOT_BYTES - MAX_CARRY) + MAX_CARRY
        itemsize = namespace.itemsize("grad")
        # Two slots where the budget has room for them (receipt overlaps the kernels), else one.
        count = 2 if 2 * slot_bytes <= self.memory.capacity else 1
        try:
            window = self._take(count * slot_bytes, f"a streamed WRITE of {total} bytes")
            self.connection.admit(namespace)  # the data-path injections, once for the WRITE
            self.connection.adopt(namespace)
        except DeviceError:
            self._skip_bulk(cid, total)
            raise
        self.memory.count("streamed_writes")
        slots = [window[slot * slot_bytes : (slot + 1) * slot_bytes] for slot in range(count)]
        free = [threading.Semaphore(1) for _ in range(count)]
        ranges: list[tuple[str, int, int, int]] = []
        position = 0
        for opened, offset, length in zip(files, table["offset"], lengths):
            # _streamable let through only grad files of an optimizer namespace: each a tensor's.
            ranges.append((cast(str, opened.tensor), int(offset), position, length))
            position += length
        pending: queue.SimpleQueue[tuple[list[Piece], int] | None] = queue.SimpleQueue()
        errors: list[BaseException] = []
        results: list[CommitResult] = []

        def stage() -> None:
            while (item := pending.get()) is not None:
                batch, slot = item
                try:
                    if not errors:  # refused already: the rest is received and dropped
                        # adopt consulted the injections once for the whole WRITE.
                        result = self.connection.io.write_grads(namespace, batch, checked=True)
                        if result is not None:
                            results.append(result)
                except BaseException as exc:  # noqa: BLE001 - reported in the completion
                    errors.append(exc)
                finally:
                    free[slot].release()

        stager = threading.Thread(target=stage, name="cossd-stage", daemon=True)
        stager.start()
        cursor = {"range": 0, "handed": 0}  # the first bulk byte not handed to the device yet
        # previous: the bulk offset of the first byte the last PDU's slot holds
        received, failed, index, previous = 0, None, 0, 0
        try:
            while received < total:
                datal = self._next_data(cid, received, total)
                slot = index % count
                free[slot].acquire()  # the device is done with what this slot held
                handing = failed is None and not errors
                # The bytes of an element the previous PDU cut go first (at most MAX_CARRY:
                # whole elements are handed, ranges are whole elements).
                carry = received - cursor["handed"] if handing else 0
                if carry:
                    last = slots[(index - 1) % count]
                    slots[slot][:carry] = bytes(last[received - carry - previous : received - previous])
                base = received - carry
                try:
                    self.connection.reader.read_data(slots[slot][carry : carry + datal])
                except DeviceError as exc:
                    failed = failed or exc
                received += datal
                batch = (self._hand(ranges, cursor, slots[slot], base, received, itemsize)
                         if handing and not failed else [])
                if batch:
                    pending.put((batch, slot))
                else:
                    free[slot].release()
                previous = base
                index += 1
        finally:
            pending.put(None)
            stager.join()
        if namespace.step_open is not None:
            self.connection.steps[namespace.nsid] = namespace.step_open
        if errors:
            if isinstance(errors[0], DeviceError):
                raise errors[0]
            log.error("%s: staging gradients failed", self.connection.peer, exc_info=errors[0])
            raise DeviceError(Status.INTERNAL_ERROR, f"internal error: {errors[0]}")
        if failed is not None:
            raise failed
        report: dict[str, Any] = {"bytes": total, "transfers": len(lengths)}
        status = Status.SUCCESS
        for result in results:
            status = self._after(namespace, result, report, status)
        return Completion(cid, status, result=total & 0xFFFF_FFFF, data=json.dumps(report).encode())

    @staticmethod
    def _hand(ranges: list[tuple[str, int, int, int]], cursor: dict[str, int], window: memoryview,
              base: int, end: int, itemsize: int) -> list[Piece]:
        """The whole elements of bulk bytes [cursor, end) as pieces of their ranges, viewed in
        `window` (which holds bulk bytes from `base` on); advances the cursor past them."""
        batch: list[Piece] = []
        while cursor["range"] < len(ranges):
            tensor, offset, start, length = ranges[cursor["range"]]
            stop = min(start + length, end)
            stop -= (stop - start) % itemsize  # whole elements only
            if stop > cursor["handed"]:
                batch.append((tensor, offset + cursor["handed"] - start,
                              window[cursor["handed"] - base : stop - base], None))
                cursor["handed"] = stop
            if cursor["handed"] < start + length:
                break
            cursor["range"] += 1
            if cursor["range"] < len(ranges):
                cursor["handed"] = ranges[cursor["range"]][2]
        return batch


def _check_singles(singles: list[tuple[OpenFile, AnyNamespace, int, memoryview]]) -> None:
    """Refuse, before any is written, a WRITE whose state or NVM data ranges a write would
    refuse: past a file's end, misaligned, state after the first step, state values no step
    can start from (the receive buffer's bytes, which nothing changes meanwhile), more scale
    blocks held in part than a namespace holds, counting the WRITE's ranges together."""
    pending: dict[int, set[tuple[str, str, int]]] = {}  # by namespace: the blocks its ranges leave in part
    for opened, namespace, offset, view in singles:
        optimizer = namespace.as_optimizer()
        if optimizer is not None:
            optimizer.check_write(cast(str, opened.tensor), opened.role, offset, len(view), view,
                                  pending.setdefault(id(namespace), set()))
            continue
        nvm = namespace.as_nvm()
        capacity = nvm.capacity_bytes if nvm is not None else 0
        if offset < 0 or offset + len(view) > capacity:
            raise DeviceError(Status.LBA_OUT_OF_RANGE, f"{opened.path}: write of {len(view)} bytes at {offset} "
                                                       f"passes the end ({capacity} bytes)")


def _check_grads(pieces: dict[int, list[Piece]], optimizers: dict[int, Namespace]) -> None:
    """Refuse, before any namespace takes its gradients, a WRITE one of whose namespaces
    would refuse its pieces: each namespace's own first checks (its ranges, bytes named twice,
    bytes its open step already has), made for all of them here, since each namespace's call
    is atomic but not the WRITE across several."""
    for nsid, batch in pieces.items():
        optimizers[nsid].check_grads_lent(batch)
