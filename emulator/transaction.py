"""One step transaction: reassembles gradient blocks by offset and tracks what has arrived."""
from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..protocol.status import DeviceError, Status
from .layout import BLOCK_ELEMS, TensorLayout

if TYPE_CHECKING:
    from ..kernels import AdamScalars


class BlockState(enum.IntEnum):
    EMPTY = 0
    PARTIAL = 1
    RUNNING = 2  # every byte arrived; the kernel is (about to be) running on it
    DONE = 3


@dataclasses.dataclass
class PartialBlock:
    """Staging for a block that arrived in pieces; `mask` marks the elements received."""

    grad: np.ndarray  # private: the pieces are copied in, so the host cannot change them
    mask: np.ndarray
    received: int = 0


@dataclasses.dataclass
class ReadyBlock:
    """A block whose gradient is complete and may be handed to the kernel."""

    tensor: TensorLayout
    local_block: int
    grad: np.ndarray
    # True where `grad` lies in memory the host lends and may change at any time (the CMB):
    # its worker reads it once, into private memory, and counts and steps that copy.
    shared: bool
    # Where the host also wants this block's new params (CMB_WRITE's param_cmb_offset), if
    # anywhere: the kernel stores them there in the same pass.
    param_copy: np.ndarray | None = None


def first_overlap(ranges: Sequence[tuple[int, int, object]]) -> tuple[int, object, object] | None:
    """The first overlap among ranges [start, end) (each with a label): (where it starts, the
    two labels), or None. Sorted by start, any overlap shows between neighbours."""
    ordered = sorted(ranges, key=lambda span: (span[0], span[1]))
    for (_, end, first), (start, _, second) in zip(ordered, ordered[1:]):
        if start < end:
            return start, first, second
    return None


def block_range_of(first_elem: int, end_elem: int) -> range:
    """The blocks elements first_elem..end_elem-1 of a tensor touch (end_elem > first_elem)."""
    return range(first_elem // BLOCK_ELEMS, (end_elem - 1) // BLOCK_ELEMS + 1)


class StepTransaction:
    """Bookkeeping of a step in flight. Not thread-safe: the namespace lock guards it."""

    def __init__(
        self, step: int, grad_scale: float, scalars: list[AdamScalars], explicit: bool, total_blocks: int
    ) -> None:
        self.step = step
        self.grad_scale = grad_scale
        self.scalars = scalars
        self.explicit = explicit
        self.total_blocks = total_blocks
        self.block_crcs = np.zeros(total_blocks, dtype=np.uint32)
        self.param_crcs = np.zeros(total_blocks, dtype=np.uint32)  # each block's params alone
        # One BlockState per block of each tensor; a bytearray, whose items read as plain
        # ints (numpy scalars compare several times slower on this per-request path).
        self.states: dict[str, bytearray] = {}
        self.partial: dict[tuple[str, int], PartialBlock] = {}
        self.received_blocks = 0
        self.done_blocks = 0
        self.inflight = 0
        self.nonfinite = 0
        self.error: BaseException | None = None
        # The host's param copies: (tensor, first element, uint16 array) per lent piece that
        # asked for one, and the blocks whose kernel already stored into them.
        self.param_copies: list[tuple[TensorLayout, int, np.ndarray]] = []
        self.copied: set[tuple[str, int]] = set()
        # Per tensor of an FP8 namespace whose codes carry scales: (first block, end block,
        # scalars) per scaled slice (the group's with 1/scale folded into grad_scale;
        # namespace/grad_scales.py). Other blocks use `scalars`.
        self.tensor_scalars: dict[str, list[tuple[int, int, AdamScalars]]] = {}
        # A step the ranks of a job share (namespace.outcomes.SharedStep), or None.
        self.shared: Any = None

    def scalars_of(self, tensor: str, group: int, block: int = 0) -> AdamScalars:
        """The scalars that step block `block` of `tensor` (of param group `group`): its
        slice's where its FP8 codes carry a scale, else its group's."""
        for first, end, scalars in self.tensor_scalars.get(tensor, ()):
            if first <= block < end:
                return scalars
        return self.scalars[group]

    def _states_of(self, tensor: TensorLayout) -> bytearray:
        states = self.states.get(tensor.name)
        if states is None:
            states = bytearray(tensor.block_count)  # all EMPTY
            self.states[tensor.name] = states
        return states

    @property
    def all_received(self) -> bool:
        return self.received_blocks == self.total_blocks

    @property
    def all_done(self) -> bool:
        return self.done_blocks == self.total_blocks

    def check_free(self, tensor: TensorLayout, first_elem: int, end_elem: int) -> None:
        """Refuse (GRADIENT_DUPLICATE) elements first_elem..end_elem-1 of `tensor` if any of
        them already arrived in this step."""
        if end_elem <= first_elem:
            return
        states = self._states_of(tensor)
        for block in block_range_of(first_elem, end_elem):
            start, stop = tensor.block_range(block)
            lo, hi = max(first_elem, start), min(end_elem, stop)
            state = states[block]
            if state >= BlockState.RUNNING or (
                state == BlockState.PARTIAL
                and self.partial[(tensor.name, block)].mask[lo - start : hi - start].any()
            ):
                raise DeviceError(
                    Status.GRADIENT_DUPLICATE,
                    f"tensor {tensor.name!r}: gradient elements {lo}..{hi - 1} already "
                    f"received in step {self.step}",
                )

    def receive(self, tensor: TensorLayout, first_elem: int, grad: np.ndarray, shared: bool,
                param_copy: np.ndarray | None = None) -> list[ReadyBlock]:
        """Take a piece of gradient; returns the blocks it completed. `shared`: `grad` lies
        in memory the host may change (see ReadyBlock). A whole block is handed on in place;
        parts of blocks are copied into private staging, read there once, so an assembled
        block is private. Its worker counts every block's inf/NaN elements. `param_copy`
        (as long as `grad`) is where the host wants the new params of these elements.

        Validates the whole piece before changing anything, so a write that overlaps an
        already received range is refused as a whole.
        """
        end_elem = first_elem + len(grad)
        self.check_free(tensor, first_elem, end_elem)
        states = self._states_of(tensor)
        touched = block_range_of(first_elem, end_elem)
        ready = []
        if param_copy is not None:
            self.param_copies.append((tensor, first_elem, param_copy))
        for block in touched:
            start, stop = tensor.block_range(block)
            lo, hi = max(first_elem, start), min(end_elem, stop)
            piece = grad[lo - first_elem : hi - first_elem]
            if states[block] == BlockState.EMPTY and lo == start and hi == stop:
                # The common case: the write covers the block, so it skips the staging (a
                # shared one is copied once by its worker, a file write's bytes not at all).
                states[block] = BlockState.RUNNING
                copy = None if param_copy is None else param_copy[lo - first_elem : hi - first_elem]
                ready.append(ReadyBlock(tensor, block, piece, shared, copy))
                self.received_blocks += 1
                continue
            key = (tensor.name, block)
            staged = self.partial.get(key)
            if staged is None:
                staged = PartialBlock(
                    grad=np.empty(stop - start, dtype=grad.dtype),
                    mask=np.zeros(stop - start, dtype=bool),
                )
                self.partial[key] = staged
                states[block] = BlockState.PARTIAL
            staged.grad[lo - start : hi - start] = piece
            staged.mask[lo - start : hi - start] = True
            staged.received += hi - lo
            if staged.received == stop - start:
                del self.partial[key]
                states[block] = BlockState.RUNNING
                ready.append(ReadyBlock(tensor, block, staged.grad, shared=False))
                self.received_blocks += 1
        return ready

    def finish(self, ready: ReadyBlock, crc: int, nonfinite: int, copied: bool = False,
               param_crc: int = 0) -> None:
        if copied:
            self.copied.add((ready.tensor.name, ready.local_block))
        self.states[ready.tensor.name][ready.local_block] = BlockState.DONE
        self.block_crcs[ready.tensor.first_block + ready.local_block] = crc
        self.param_crcs[ready.tensor.first_block + ready.local_block] = param_crc
        self.nonfinite += nonfinite
        self.done_blocks += 1

    def unreceived(self, tensors: list[TensorLayout], limit: int = 5) -> list[str]:
        """Names of (some) tensors with gradient elements that have not arrived yet (blocks
        still running their kernel do not count: their gradients are in)."""
        names = []
        for tensor in tensors:
            states = self.states.get(tensor.name)
            if states is None or states.count(BlockState.EMPTY) or states.count(BlockState.PARTIAL):
                names.append(tensor.name)
                if len(names) == limit:
                    break
        return names

    def missing(self, tensors: list[TensorLayout], limit: int = 5) -> list[str]:
        """Names of (some) tensors whose gradient is not complete yet, for error messages."""
        names = []
        for tensor in tensors:
            states = self.states.get(tensor.name)
            if states is None or states.count(BlockState.DONE) != len(states):
                names.append(tensor.name)
                if len(names) == limit:
                    break
        return names

