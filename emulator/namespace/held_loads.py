"""Initial state checks and the parts of block-scaled moments' scale blocks held while loading.

A block-scaled moment (state_dtype fp16, int8) keeps one float32 scale per SCALE_BLOCK (256)
elements, so a load can only be encoded a whole scale block at a time. A writer's one correct
write() of whole blocks may still reach the device cut mid-block: with direct_io the kernel
cuts a write into FUSE requests whose first ends at (largest request - the user buffer's offset
within its page), wherever that falls. So a request of whole elements that covers only part of
a scale block is held here, by namespace (each namespace has its own HeldLoads), tensor, role
and block: its FP32 values and which of the block's elements they are. The block is encoded
once the requests that follow (in any order) have covered every element of it; a later
request covering the whole block replaces what was held. Nothing held is ever read or stepped:
reads see the block as it was, and the first step's begin (which seals the loading) is refused
with MISALIGNED_ACCESS, changing nothing, while any block is held in part.

The held values live in the daemon's memory, but which blocks are held is also in the
namespace's folder (HELD_FILE, rewritten as the set changes): a daemon that stops with blocks
held in part (kill -9, an unmount) has lost their values, and the namespace reopens with those
blocks held with nothing written, so the first step is still refused until they are written
again, never started from a block half old.

check_values refuses initial state no step could start from: a non-finite master or moment, a
negative exp_avg_sq (a mean of squares).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable

import numpy as np

from ...protocol.status import DeviceError, Status
from ..layout import SCALE_BLOCK
from ..media import atomic_write_json, fsync_dir, media_error, read_json

log = logging.getLogger("cossd.emulator.namespace")

# The most partly written scale blocks one namespace holds at once (each 1 KiB of FP32 and
# its element mask): a writer's requests cut mid-block leave one each until the next arrives,
# so only requests far out of order, or a writer that never completes its blocks, come near.
MAX_HELD_BLOCKS = 4096
# In the namespace's folder while any block is held in part: [[tensor, role, block], ...].
# Replaced atomically and synced, before a request's part is held and after a block is whole
# again (best effort: a listing of more blocks only refuses more).
HELD_FILE = "held_loads.json"


@dataclasses.dataclass(slots=True)
class _Held:
    """One scale block written in part: its FP32 values so far, and which of them were written."""

    values: np.ndarray
    written: np.ndarray  # bool per element of the block


class HeldLoads:
    """The partly loaded scale blocks of one namespace's block-scaled moments, keyed by
    (tensor, role, block). The namespace's lock guards every call."""

    def __init__(self, max_blocks: int = MAX_HELD_BLOCKS, directory: Path | None = None,
                 numel_of: Callable[[str], int | None] | None = None) -> None:
        self.max_blocks = max_blocks
        self._held: dict[tuple[str, str, int], _Held] = {}
        self._path = directory / HELD_FILE if directory is not None else None
        self._saved: frozenset[tuple[str, str, int]] = frozenset()
        if self._path is not None and numel_of is not None:
            self._reopen(numel_of)

    def _reopen(self, numel_of: Callable[[str], int | None]) -> None:
        """The blocks a daemon before this one held in part (HELD_FILE), held again with
        nothing written: their values were lost with it."""
        assert self._path is not None
        try:
            listed = read_json(self._path)
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:  # written atomically and synced: damaged media
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{self._path} cannot be read: {exc}") from None
        for item in listed if isinstance(listed, list) else []:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
                    and isinstance(item[1], str) and isinstance(item[2], int)):
                continue
            tensor, role, block = item
            numel = numel_of(tensor)
            if numel is None or not 0 <= block * SCALE_BLOCK < numel:
                continue
            length = self._block_len(numel, block)
            self._held[(tensor, role, block)] = _Held(np.zeros(length, np.float32), np.zeros(length, bool))
        self._saved = frozenset(self._held)
        if self._held:
            log.warning("%s: %d scale block(s) of initial moments were loaded only in part when the daemon "
                        "before stopped; their values are lost: the first step is refused until they are "
                        "written again", self._path.parent, len(self._held))

    def _save(self, keys: frozenset[tuple[str, str, int]]) -> None:
        """HELD_FILE made to list `keys` (removed where there are none), synced: raises the
        media error where it could not be."""
        if self._path is None or keys == self._saved:
            return
        try:
            if keys:
                atomic_write_json(self._path, sorted([list(key) for key in keys]))
            else:
                self._path.unlink(missing_ok=True)
                fsync_dir(self._path.parent)
        except DeviceError:
            raise
        except OSError as exc:
            raise media_error(exc, f"writing {HELD_FILE}") from exc
        self._saved = keys

    def _forget_keys(self) -> None:
        """HELD_FILE brought down to the blocks held now, where blocks left: best effort, since
        a listing of more blocks than are held only refuses the first step after a restart
        until those blocks are written again (never the other way round)."""
        try:
            self._save(frozenset(self._held))
        except DeviceError as exc:
            log.warning("%s: %s (it still names blocks that are whole now)", HELD_FILE, exc.message)

    def __len__(self) -> int:
        return len(self._held)

    def split(self, numel: int, first: int, stop: int) -> tuple[tuple[int, int], list[tuple[int, int, int]]]:
        """Elements [first, stop) of a tensor of `numel` as (the whole scale blocks' range, the
        parts of blocks: (block, start, stop) each): the tensor's last block, shorter than
        SCALE_BLOCK, is whole when the range reaches the tensor's end."""
        lo = -(-first // SCALE_BLOCK) * SCALE_BLOCK
        hi = stop if stop == numel else stop // SCALE_BLOCK * SCALE_BLOCK
        parts = []
        if lo > hi:  # inside one block, touching neither of its ends
            return (first, first), [(first // SCALE_BLOCK, first, stop)]
        if first < lo:
            parts.append((first // SCALE_BLOCK, first, lo))
        if hi < stop:
            parts.append((hi // SCALE_BLOCK, hi, stop))
        return (lo, hi), parts

    def reserve(self, tensor: str, role: str, parts: list[tuple[int, int, int]]) -> None:
        """check_room, then HELD_FILE made to name the blocks these parts will hold, before any
        of the request is taken: where that fails the request is refused, nothing changed, and
        HELD_FILE always names at least the blocks held."""
        self.check_room(tensor, role, parts)
        new = {(tensor, role, block) for block, _, _ in parts} - set(self._held)
        if new:
            self._save(frozenset(self._held) | new)

    def check_room(self, tensor: str, role: str, parts: list[tuple[int, int, int]],
                   pending: set[tuple[str, str, int]] | None = None) -> None:
        """Refuse (MISALIGNED_ACCESS, changing nothing) parts of blocks that would hold more
        blocks than max_blocks. `pending`: the blocks that the requests before this one in
        the same batch (a CMB_WRITE's transfers, a server WRITE's ranges) will hold, checked
        before any of them is taken; this request's are added to it."""
        keys = {(tensor, role, block) for block, _, _ in parts} - self._held.keys()
        if pending is not None:
            pending |= keys
            keys = pending
        new = len(keys)
        if new and len(self._held) + new > self.max_blocks:
            raise DeviceError(
                Status.MISALIGNED_ACCESS,
                f"{tensor}/{role}: {len(self._held)} scale blocks of {SCALE_BLOCK} elements are loaded only in part "
                f"and this request{' with those before it in its batch' if pending is not None else ''} would hold "
                f"{new} more (at most {self.max_blocks} are held); complete them, or load in whole "
                f"{SCALE_BLOCK * 4}-byte blocks")

    @staticmethod
    def _block_len(numel: int, block: int) -> int:
        return min(SCALE_BLOCK, numel - block * SCALE_BLOCK)

    def drop(self, tensor: str, role: str, first_block: int, stop_block: int) -> None:
        """Forget what is held of blocks [first_block, stop_block): a request wrote them whole."""
        if not self._held:
            return
        for key in [key for key in self._held
                    if key[0] == tensor and key[1] == role and first_block <= key[2] < stop_block]:
            del self._held[key]
        self._forget_keys()

    def add(self, tensor: str, role: str, numel: int, block: int, start: int,
            values: np.ndarray) -> np.ndarray | None:
        """Hold FP32 `values` of elements [start, start + len(values)) of `block` (reserve()
        named it in HELD_FILE); the whole block's values once every element of it has been
        written, else None. A whole block stays held until the caller has encoded it
        (finished()), so a failure in between leaves it held, never lost."""
        key = (tensor, role, block)
        held = self._held.get(key)
        length = self._block_len(numel, block)
        if held is None:
            held = self._held[key] = _Held(np.zeros(length, np.float32), np.zeros(length, bool))
        base = block * SCALE_BLOCK
        held.values[start - base : start - base + len(values)] = values
        held.written[start - base : start - base + len(values)] = True
        return held.values if held.written.all() else None

    def finished(self, tensor: str, role: str, block: int) -> None:
        """Block `block`, whole, was encoded: no longer held."""
        if self._held.pop((tensor, role, block), None) is not None:
            self._forget_keys()

    def refuse_held(self, namespace: str) -> None:
        """Refuse (MISALIGNED_ACCESS, changing nothing) to end the loading while a scale block
        is loaded only in part: the step would start from moments never written."""
        if not self._held:
            return
        tensor, role, block = min(self._held)
        written = self._held[(tensor, role, block)].written
        base = block * SCALE_BLOCK
        missing = np.flatnonzero(~written)
        if not len(missing):  # written whole, its encoding failed (a media error): write it again
            missing = np.arange(len(written))
        raise DeviceError(
            Status.MISALIGNED_ACCESS,
            f"namespace {namespace!r}: {len(self._held)} scale block(s) of {SCALE_BLOCK} elements of initial "
            f"{'/'.join(sorted({f'{t}/{r}' for t, r, _ in self._held}))} were loaded only in part (first: "
            f"{tensor}/{role} elements {base}..{base + len(written) - 1}, element {base + int(missing[0])} and "
            f"{len(missing) - 1} more never written); write the rest of each block (or the whole block) "
            "before the first step")

    def forget(self, namespace: str) -> None:
        """At close: the held values are lost (a loading namespace reopens still loading, with
        HELD_FILE naming the blocks, which its first step refuses until they are written
        again); said in the log."""
        if self._held:
            log.warning("namespace %s closes with %d scale block(s) of initial moments loaded only in part; "
                        "those writes are lost (the namespace is still loading, and its first step is refused "
                        "until they are written again)", namespace, len(self._held))
            self._held.clear()


# check_values looks at this many elements at a time (its temporaries: a byte each).
_CHECK_CHUNK = 1 << 20


def check_values(tensor: str, role: str, first: int, values: np.ndarray) -> None:
    """Refuse (INVALID_FIELD) initial state no step can start from: a NaN or infinite master or
    moment, a negative exp_avg_sq (a mean of squares; -0.0 is zero). `values`: FP32, or BF16
    bits (uint16) for bf16 moments; `first`: the element the values start at."""
    for at in range(0, len(values), _CHECK_CHUNK):
        _check_chunk(tensor, role, first + at, values[at : at + _CHECK_CHUNK])


def _check_chunk(tensor: str, role: str, first: int, values: np.ndarray) -> None:
    if values.dtype == np.uint16:  # BF16 bits: exponent all ones is inf or NaN; the sign bit
        finite = (values & 0x7F80) != 0x7F80
        negative = (values > 0x8000) if role == "exp_avg_sq" else None  # 0x8000 is -0.0
    else:
        finite = np.isfinite(values)
        negative = (values < 0) if role == "exp_avg_sq" else None
    if not finite.all():
        index = int(np.flatnonzero(~finite)[0])
        raise DeviceError(
            Status.INVALID_FIELD,
            f"{tensor}/{role}: initial state must be finite; element {first + index} is "
            f"{_shown(values, index)}; nothing was written")
    if negative is not None and negative.any():
        index = int(np.flatnonzero(negative)[0])
        raise DeviceError(
            Status.INVALID_FIELD,
            f"{tensor}/{role}: exp_avg_sq is a mean of squares and never below zero; element "
            f"{first + index} is {_shown(values, index)}; nothing was written")


def _shown(values: np.ndarray, index: int) -> str:
    """Element `index` of FP32 values or BF16 bits, as a number."""
    if values.dtype == np.uint16:
        return repr(float(np.array([int(values[index]) << 16], np.uint32).view(np.float32)[0]))
    return repr(float(values[index]))
