"""The shared-step forms of BEGIN_STEP, COMMIT_STEP and ABORT_STEP (a JSON payload naming the job): payload checks and completions."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from ..protocol.entries import Command, Completion
from ..protocol.hyperparameters import GROUP_FIELDS
from ..protocol.status import DeviceError, Status
from .namespace import Namespace

# The most ranks one shared step may have (a job's data-parallel world size).
MAX_RANKS = 65536
# A job id is any 63-bit number; every rank of one job sends the same one.
MAX_JOB = (1 << 63) - 1
MAX_REASON = 512

_BEGIN_KEYS = {"job", "seq", "ranks", "rank", "groups", "grad_scales"}
_COMMIT_KEYS = {"job", "seq", "ranks", "rank", "step"}
_ABORT_KEYS = {"job", "seq", "ranks", "rank", "step", "reason"}
_IDENTITY = {"job", "seq", "ranks", "rank"}


def _int(payload: dict[str, Any], key: str, low: int, high: int) -> int:
    value = payload.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise DeviceError(Status.INVALID_FIELD, f"{key} must be an integer in {low}..{high}, got {value!r}")
    return value


def _fields(command: Command, keys: set[str], required: set[str]) -> dict[str, Any]:
    payload = command.json
    if not isinstance(payload, dict):
        raise DeviceError(Status.INVALID_FIELD, "a shared step's payload must be a JSON object")
    unknown = sorted(set(payload) - keys)
    if unknown:
        raise DeviceError(Status.INVALID_FIELD, f"unknown key(s) {', '.join(map(repr, unknown))[:200]}; "
                          f"this form takes {', '.join(sorted(keys))}")
    absent = sorted(required - set(payload))
    if absent:
        raise DeviceError(Status.INVALID_FIELD, f"a shared step's payload needs {', '.join(absent)}")
    ranks = _int(payload, "ranks", 1, MAX_RANKS)
    return {"job": _int(payload, "job", 0, MAX_JOB), "seq": _int(payload, "seq", 1, MAX_JOB), "ranks": ranks,
            "rank": _int(payload, "rank", 0, ranks - 1)} | {
        key: payload[key] for key in keys - _IDENTITY if key in payload}


def _groups(value: Any) -> list[dict[str, Any]] | None:
    """The groups' hyperparameters: a list of objects of GROUP_FIELDS (numbers checked by
    the namespace, which refuses any value it would refuse from SET_HYPERPARAMETERS)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(group, dict) for group in value):
        raise DeviceError(Status.INVALID_FIELD, "groups must be a list of objects, one per group")
    for group in value:
        unknown = sorted(set(group) - set(GROUP_FIELDS))
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"groups: unknown hyperparameter(s) "
                              f"{', '.join(map(repr, unknown))[:200]}; a group takes {', '.join(GROUP_FIELDS)}")
        for key, number in group.items():
            if not isinstance(number, (int, float)) or isinstance(number, bool):
                raise DeviceError(Status.INVALID_FIELD, f"groups: {key} must be a number, got {number!r}")
    return value


def begin(namespace: Namespace, command: Command, step: int, grad_scale: float) -> Completion:
    """BEGIN_STEP with {"job", "seq", "ranks", "rank", "groups"?, "grad_scales"?}: open the job's
    step or join it; grad_scales, the FP8 scales of the slices this rank sends (checked by the
    namespace: emulator/namespace/grad_scales.py)."""
    fields = _fields(command, _BEGIN_KEYS, _IDENTITY)
    if not step:
        raise DeviceError(Status.INVALID_FIELD, "a shared step names its step number (cdw10-11)", 40)
    scales = fields.get("grad_scales")
    if scales is not None and not isinstance(scales, dict):
        raise DeviceError(Status.INVALID_FIELD, "grad_scales must be a JSON object {tensor: scale or slice}")
    opened = namespace.begin_shared_step(step, grad_scale, fields["job"], fields["seq"], fields["ranks"],
                                         fields["rank"], _groups(fields.get("groups")), scales)
    return Completion(command.cid, Status.SUCCESS, result=opened["step"] & 0xFFFFFFFF,
                      data=json.dumps(opened, sort_keys=True).encode())


def commit(namespace: Namespace, command: Command) -> Completion:
    """COMMIT_STEP with {"job", "seq", "ranks", "rank", "step"}: the step's one result, or while
    ranks or gradients are still missing SUCCESS with {"step", "waiting": what for}."""
    fields = _fields(command, _COMMIT_KEYS, _COMMIT_KEYS)
    step = _int(fields, "step", 1, (1 << 53) - 1)
    result = namespace.commit_shared_step(step, fields["job"], fields["seq"], fields["rank"])
    if isinstance(result, str):
        committed = step - 1
        return Completion(command.cid, Status.SUCCESS, result=committed & 0xFFFFFFFF,
                          data=json.dumps({"step": step, "waiting": result}).encode())
    status = Status.STEP_SKIPPED_NONFINITE if result.skipped else Status.SUCCESS
    return Completion(command.cid, status, result=result.committed_step & 0xFFFFFFFF,
                      data=json.dumps(dataclasses.asdict(result), sort_keys=True).encode())


def abort(namespace: Namespace, command: Command) -> Completion:
    """ABORT_STEP with {"job", "seq", "ranks", "rank", "step", "reason"?}: abort the job's step."""
    fields = _fields(command, _ABORT_KEYS, _IDENTITY | {"step"})
    step = _int(fields, "step", 1, (1 << 53) - 1)
    reason = fields.get("reason", "no reason given")
    if not isinstance(reason, str):
        raise DeviceError(Status.INVALID_FIELD, f"reason must be a string, got {reason!r}"[:200])
    aborted = namespace.abort_shared_step(step, fields["job"], fields["seq"], fields["rank"], reason[:MAX_REASON])
    return Completion(command.cid, Status.SUCCESS, result=aborted & 0xFFFFFFFF,
                      data=json.dumps({"aborted_step": aborted}).encode())
