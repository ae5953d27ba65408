"""A compute namespace's programs and memory range sets, and the built-in adamw_step.

adamw_step is no second Adam: it turns its ranges into the gradient pieces of a CMB_WRITE
(Namespace.write_grads_lent: the same checks, kernel, implicit step and A/B commit), so the
free checkpoint and every crash guarantee of the vendor path hold here as they are.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from ...protocol.computational import (ACT_BIT, ADAMW_HYPERPARAMETERS, ADAMW_PROGRAM_ID, ADAMW_PROGRAM_INDEX,
                                       ADAMW_PROGRAM_NAME, ADAMW_ROLES, ALL_GROUPS, MAX_RANGE_SETS,
                                       PEOCC_DEVICE_DEFINED, PROGRAM_DESCRIPTOR, PROGRAM_TYPE_DEVICE_DEFINED)
from ...protocol.hyperparameters import GROUP_FIELDS
from ...protocol.status import DeviceError, Status
from ..namespace import Namespace
from .ranges import MemoryRange

# The programs a compute namespace holds: index 0 only, built in.
PROGRAM_SLOTS = 1


@dataclasses.dataclass
class ComputeState:
    """Controller state of one compute namespace: whether adamw_step is active, the range sets
    (ID -> their descriptors, as created). Lost with the controller, as on a reset."""

    active: bool = False
    range_sets: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def check_program(self, index: int) -> None:
        """INVALID_PROGRAM_INDEX past the table, PROGRAM_NOT_ACTIVATED before activation."""
        if index >= PROGRAM_SLOTS:
            raise DeviceError(Status.INVALID_PROGRAM_INDEX, f"program index {index}: this namespace holds "
                              f"{PROGRAM_SLOTS} program (index 0, {ADAMW_PROGRAM_NAME})")
        if not self.active:
            raise DeviceError(Status.PROGRAM_NOT_ACTIVATED,
                              f"program {index} ({ADAMW_PROGRAM_NAME}) is not activated (Program Activation "
                              "Management, 88h)")

    def add_range_set(self, table: np.ndarray) -> int:
        with self.lock:
            if len(self.range_sets) >= MAX_RANGE_SETS:
                raise DeviceError(Status.MAX_MEMORY_RANGE_SET_EXCEEDED, f"{MAX_RANGE_SETS} range sets exist already")
            rsid = next(i for i in range(1, MAX_RANGE_SETS + 2) if i not in self.range_sets)
            self.range_sets[rsid] = table
            return rsid

    def range_set(self, rsid: int) -> np.ndarray:
        table = self.range_sets.get(rsid)
        if table is None:
            raise DeviceError(Status.INVALID_MEMORY_RANGE_SET_ID, f"no memory range set {rsid}")
        return table

    def delete_range_set(self, rsid: int) -> None:
        with self.lock:
            self.range_set(rsid)
            del self.range_sets[rsid]

    def descriptors(self) -> bytes:
        """The program table: one 64-byte descriptor per index."""
        table = np.zeros(PROGRAM_SLOTS, dtype=PROGRAM_DESCRIPTOR)
        table[ADAMW_PROGRAM_INDEX]["flags"] = PEOCC_DEVICE_DEFINED | (ACT_BIT if self.active else 0)
        table[ADAMW_PROGRAM_INDEX]["ptype"] = PROGRAM_TYPE_DEVICE_DEFINED
        table[ADAMW_PROGRAM_INDEX]["pid"] = ADAMW_PROGRAM_ID
        return table.tobytes()


@dataclasses.dataclass(frozen=True)
class Piece:
    """One tensor's part of an element span: what write_grads_lent takes."""

    tensor: str
    grad_offset: int
    grad: np.ndarray
    params: np.ndarray


def _state_span(namespace: Namespace, state: MemoryRange, role: str, first: int, count: int) -> None:
    """A state range must name `count` elements of `role` from element `first`, of the same
    optimizer namespace as the group's others: INVALID_FIELD otherwise."""
    itemsize = namespace.itemsize(role)
    if state.namespace is not namespace:
        raise DeviceError(Status.INVALID_FIELD, f"{state.what} ({role}) names another namespace than the group's")
    if state.sb % itemsize or state.sb // itemsize != first or state.length != count * itemsize:
        raise DeviceError(Status.INVALID_FIELD,
                          f"{state.what} ({role}): bytes {state.sb}+{state.length} are not elements "
                          f"{first}..{first + count} of {role} ({itemsize} bytes each), the group's gradient span")


def adamw_pieces(ranges: list[MemoryRange]) -> tuple[Namespace, list[Piece]]:
    """adamw_step's ranges, in groups of five (grad, master, exp_avg, exp_avg_sq, param_out),
    as gradient pieces of one optimizer namespace. A group is a span of the namespace's
    elements in table order (tensors one after another): grad and param_out in memory
    namespaces, the three state ranges naming the same elements of the optimizer namespace
    (byte offsets into each role's array laid end to end)."""
    if len(ranges) % len(ADAMW_ROLES):
        raise DeviceError(Status.INVALID_FIELD, f"{ADAMW_PROGRAM_NAME} takes ranges in groups of "
                          f"{len(ADAMW_ROLES)} ({', '.join(ADAMW_ROLES)}), got {len(ranges)}")
    namespace: Namespace | None = None
    pieces: list[Piece] = []
    for at in range(0, len(ranges), len(ADAMW_ROLES)):
        grad, master, exp_avg, exp_avg_sq, params = ranges[at : at + len(ADAMW_ROLES)]
        for memory, role in ((grad, "grad"), (params, "param_out")):
            if memory.view is None:
                raise DeviceError(Status.INVALID_MEMORY_NAMESPACE, f"{memory.what} ({role}) must be in a memory namespace")
        for state, role in ((master, "master"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            if state.namespace.as_optimizer() is None:
                raise DeviceError(Status.INVALID_FIELD, f"{state.what} ({role}) must name an optimizer namespace's state")
        if namespace is None:
            namespace = master.namespace.as_optimizer()
        grad_size = namespace.itemsize("grad")
        if grad.length % grad_size or params.length != grad.length // grad_size * namespace.itemsize("param"):
            raise DeviceError(Status.INVALID_FIELD, f"{grad.what} and {params.what}: gradient and param lengths "
                              "must be whole elements of the same span")
        count = grad.length // grad_size
        first = master.sb // namespace.itemsize("master")
        for state, role in ((master, "master"), (exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
            _state_span(namespace, state, role, first, count)
        pieces.extend(_split(namespace, first, count, grad, params, at // len(ADAMW_ROLES)))
    assert namespace is not None
    return namespace, pieces


def _split(namespace: Namespace, first: int, count: int, grad: MemoryRange, params: MemoryRange,
           group: int) -> list[Piece]:
    """Elements first..first+count of the namespace, tensor by tensor."""
    total = sum(t.numel for t in namespace.layouts)
    if first + count > total:
        raise DeviceError(Status.INVALID_MEMORY_RANGE_SET,
                          f"group {group}: elements {first}..{first + count} pass the end of namespace "
                          f"{namespace.name!r} ({total} elements)")
    grad_size, param_size = namespace.itemsize("grad"), namespace.itemsize("param")
    pieces, start = [], 0
    for tensor in namespace.layouts:
        lo, hi = max(first, start), min(first + count, start + tensor.numel)
        if lo < hi:
            g0, p0 = (lo - first) * grad_size, (lo - first) * param_size
            pieces.append(Piece(tensor.name, (lo - start) * grad_size, grad.view[g0 : g0 + (hi - lo) * grad_size],  # type: ignore[index]
                                params.view[p0 : p0 + (hi - lo) * param_size]))  # type: ignore[index]
        start += tensor.numel
    return pieces


def hyperparameter_changes(block: bytes) -> tuple[int | None, dict[str, float]]:
    """The optional hyperparameter block: (group or None for all, {field: value})."""
    value = np.frombuffer(block, dtype=ADAMW_HYPERPARAMETERS, count=1)[0]
    group = int(value["group"])
    fields = ADAMW_HYPERPARAMETERS.names or ()  # a structured dtype: its names are never None
    return (None if group == ALL_GROUPS else group), {name: float(value[name]) for name in GROUP_FIELDS
                                                       if name in fields}


def run_adamw(namespace: Namespace, pieces: list[Piece], step: int, grad_scale: float | None,
              hypers: tuple[int | None, dict[str, float]] | None) -> dict[str, Any]:
    """Take the pieces as one CMB_WRITE would, in step `step` (0: the open step, or an
    implicit one, as CMB_WRITE) and commit it once its gradients are complete where this
    Execute named the step. A gradient scale with step 0 and no step open opens an implicit
    step carrying it, which commits when complete as any implicit step does.

    Everything that can be refused for what the Execute asks is checked before anything
    changes: opening a step seals a loading namespace, which no abort undoes. A failure after
    the step was opened here (the media) aborts it and puts the hyperparameters back."""
    lent = [(p.tensor, p.grad_offset, p.grad, p.params) for p in pieces]
    namespace.check_grads_lent(lent)  # ranges, and no element twice (nor one the open step has)
    open_tx = namespace._tx
    open_step = None if open_tx is None else open_tx.step
    if open_tx is not None and step and step != open_tx.step:
        raise DeviceError(Status.STEP_NUMBER_MISMATCH, f"step {open_tx.step} is open, not {step}")
    if hypers is not None and open_tx is not None:
        raise DeviceError(Status.INVALID_FIELD, "hyperparameters go with the Execute that opens a step; "
                          f"step {open_tx.step} is open")
    if open_tx is not None and grad_scale is not None and grad_scale != open_tx.grad_scale:
        # The open step's kernel scalars were fixed with its scale at its begin: taking these
        # gradients at another scale would silently step them at the wrong one.
        raise DeviceError(Status.INVALID_FIELD, f"step {open_tx.step} is open with grad scale "
                          f"{open_tx.grad_scale!r}; an Execute that adds to it gives that scale or 0 "
                          f"(CPARAM2), not {grad_scale!r}")
    old_hypers = namespace.config()["groups"] if hypers is not None else None
    opened: int | None = None
    try:
        if hypers is not None:
            namespace.set_hyperparameters(hypers[0], **hypers[1])
        if open_step is None and step:
            opened = namespace.begin_step(step, grad_scale if grad_scale is not None else 1.0)
        elif open_step is None and grad_scale is not None:
            opened = namespace.begin_implicit_step(grad_scale)
        result = namespace.write_grads_lent(lent)
    except DeviceError:
        if opened is not None and namespace.step_open == opened:
            try:
                namespace.abort_step()
            except DeviceError:
                pass  # ended meanwhile (its commit failed): the first error is the one to report
        if old_hypers is not None:
            for index, group in enumerate(old_hypers):
                namespace.set_hyperparameters(index, **{name: group[name] for name in GROUP_FIELDS})
        raise
    if result is None and step and namespace.step_open == step:
        try:
            result = namespace.commit_step()
        except DeviceError as exc:
            if exc.status != Status.GRADIENT_INCOMPLETE:
                raise
    report: dict[str, Any] = {"committed_step": namespace.committed_step, "step_open": namespace.step_open,
                              "bytes": sum(len(p.grad) for p in pieces)}
    if result is not None:
        report["commit"] = dataclasses.asdict(result)
    return report
