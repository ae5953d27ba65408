"""DCP checkpoints by reference over several devices (mount=[...]): one snapshot tag on every device, and a rollback to it that is atomic for the group."""
from __future__ import annotations

import secrets
from typing import Any, Callable

from ...client import snapshots as snapshot_calls
from ..namespace.files import committed_steps

# A group rollback to snapshot T first marks every device with a snapshot named MARK + T of
# its current state, device 0 first; once every device holds the mark, the rollback is
# decided: each device is rolled back to T, then the marks are deleted, device 0 first. So a
# kill at any instant leaves the marks on a prefix of the devices (the rollback not decided:
# no device rolled back) or on a suffix (every device rolled back already), where deleting
# them finishes either, or on every device, where rolling every device back to T (again, for
# some: a rollback to a snapshot is idempotent while no step is taken) finishes it. The next
# open of the group does this (resolve) before any step.
MARK = "cossd-group-rollback."
STAGES = ("marked", "rolled_back", "unmarked")  # each "<stage>@<device index>", then "done"


def _listed(files: Any) -> dict[str, dict[str, Any]]:
    listed = files.command(snapshot_calls.snapshots, files.admin, files.nsid)
    return {snapshot["tag"]: snapshot for snapshot in listed.get(files.name, [])}


def _serial(files: Any) -> str:
    return str(files.command(files.admin.describe)["identity"]["serial"])


def pruned(listed: list[dict[str, Any]], prefix: str, keep: int, tag: str, step: int,
           templates: bool = True) -> list[str]:
    """The snapshots of `prefix` that retention (`dcp_keep`) drops now that snapshot `tag` of
    committed step `step` was taken (never `tag` itself), oldest first.

    Without load templates (DeepSpeed's saves, `templates=False`): all but the newest `keep`.
    With them (DCP): the snapshot a get_state_dict takes may be a load's template (the dict DCP
    loads a checkpoint into, which the documented resume makes with get_state_dict too), not a
    save, and the checkpoint about to be loaded names an earlier snapshot. So it does not
    count: the newest `keep` snapshots of earlier steps stay, and every one of its own step (a
    job killed right after a save resumes at the saved step; a template or a save of that step
    there, told apart by nothing but the checkpoint); older ones go. A resume from any of the
    last `keep` saves thus finds its snapshot, whatever templates were taken since, and at most
    `keep` + 1 saves (plus the templates of the newest step) are kept."""
    ours = sorted((s for s in listed if s["tag"].startswith(prefix) and s["tag"] != tag),
                  key=lambda s: (s.get("step", 0), s.get("created", "")))
    if not templates:
        return [s["tag"] for s in ours[: max(0, len(ours) + 1 - keep)]]
    earlier = [s for s in ours if s.get("step", 0) < step]
    return [s["tag"] for s in earlier[: max(0, len(earlier) - keep)]]


def take(members: list[Any], step: int, prefix: str, keep: int | None) -> dict[str, Any]:
    """Rank 0's part of a save: a snapshot of the committed step `step` under one tag on
    every device (members: each device's files), then each device's oldest snapshots of
    `prefix` beyond `keep` dropped (pruned(): a load's template does not count). Returns the reference (a few hundred bytes at most)."""
    # One tag must name one step's state on every device: a group step that some devices
    # committed and others did not (a save right after it failed) would make a snapshot mixing steps.
    steps = committed_steps(members)
    if any(found != step for found in steps):
        raise RuntimeError(
            f"namespace {members[0].name!r}: the devices are at committed steps "
            f"{', '.join(f'{found} ({files.mountpoint})' for found, files in zip(steps, members))}, not all at step "
            f"{step}: a snapshot of them would mix steps under one label, so none was taken. A group step failed "
            "between the devices' commits; make a new optimizer on the same mounts (restart the job): it brings "
            "every device to one committed step")
    tag = f"{prefix}{step}-{secrets.token_hex(4)}"
    for files in members:
        files.command(snapshot_calls.create_snapshot, files.admin, files.nsid, tag)
    if keep is not None:
        for files in members:
            for old in pruned(list(_listed(files).values()), prefix, keep, tag, step):
                files.command(snapshot_calls.delete_snapshot, files.admin, files.nsid, old)
    return {"cossd": 1, "namespace": members[0].name, "snapshot": tag, "step": step,
            "devices": [_serial(files) for files in members]}


def check(members: list[Any], reference: dict[str, Any], checkpoint: str) -> None:
    """That `reference` names these devices, in this order, and this namespace, and that its
    snapshot is whole on every one of them: a ValueError or RuntimeError naming what is not,
    before anything changes."""
    serials = [_serial(files) for files in members]
    if reference.get("devices") != serials or reference.get("namespace") != members[0].name:
        raise ValueError(
            f"{checkpoint}: its optimizer state is namespace {reference.get('namespace')!r} on the devices with "
            f"serials {reference.get('devices')}, not this optimizer's ({members[0].name!r} on {serials}); name "
            "the same devices in the same order")
    steps = []
    for files, serial in zip(members, serials):
        snapshot = _listed(files).get(reference["snapshot"])
        if snapshot is None or snapshot.get("state") != "ready":
            why = "is gone" if snapshot is None else f"is {snapshot.get('state')} ({snapshot.get('error')})"
            raise RuntimeError(
                f"{checkpoint}: its optimizer state, snapshot {reference['snapshot']!r} of namespace "
                f"{files.name!r} (step {reference['step']}), {why} on the device {serial} ({files.mountpoint}): "
                "this checkpoint cannot be resumed with its masters and moments. Resume from a later checkpoint, "
                "or from the devices' committed step without loading the optimizer's state")
        steps.append(snapshot.get("step"))
    if any(found is not None and found != reference.get("step") for found in steps):  # None: not listed
        # Taken while the devices were at different steps (a save after a group step that some
        # devices committed and others did not): rolling back to it would leave them apart.
        raise RuntimeError(
            f"{checkpoint}: its optimizer state, snapshot {reference['snapshot']!r} of namespace "
            f"{members[0].name!r}, holds step {', '.join(f'{found} on {serial}' for found, serial in zip(steps, serials))}"
            f" where the checkpoint says step {reference.get('step')}: it mixes steps across the devices and cannot "
            "be resumed. Nothing was changed; resume from another checkpoint, or from the devices' committed step "
            "without loading the optimizer's state")


def _roll_back_one(files: Any, tag: str) -> None:
    if files.statistics().get("step_open") is not None:  # a step a failed step() left open
        files.command(files.admin.abort_step, files.nsid)
    files.command(snapshot_calls.rollback, files.admin, files.nsid, tag)


def roll_back(members: list[Any], tag: str, hook: Callable[[str], None] = lambda stage: None) -> None:
    """Rank 0's part of a load (check() passed): every device back at snapshot `tag`,
    atomically for the group (see MARK)."""
    mark = MARK + tag
    for index, files in enumerate(members):
        if mark not in _listed(files):  # a killed earlier try may have left it
            files.command(snapshot_calls.create_snapshot, files.admin, files.nsid, mark)
        hook(f"marked@{index}")
    for index, files in enumerate(members):
        _roll_back_one(files, tag)
        hook(f"rolled_back@{index}")
    for index, files in enumerate(members):
        files.command(snapshot_calls.delete_snapshot, files.admin, files.nsid, mark)
        hook(f"unmarked@{index}")
    hook("done")


def resolve(members: list[Any]) -> str | None:
    """Finish or undo a group rollback that a killed job left half done (see MARK), before
    the group's devices are looked at alone. Members: each device's files, the namespace
    looked up (those where it does not exist are left out). What was done, or None."""
    marks = []
    for files in members:
        marks.append({tag[len(MARK):] for tag in _listed(files) if tag.startswith(MARK)})
    if not any(marks):
        return None
    name = members[0].name
    everywhere = set.intersection(*marks)
    if len(everywhere) == 1 and all(found == everywhere for found in marks):
        [tag] = everywhere
        for files in members:
            _roll_back_one(files, tag)
        for files in members:
            files.command(snapshot_calls.delete_snapshot, files.admin, files.nsid, MARK + tag)
        return (f"finished a rollback of {name!r} to snapshot {tag!r} on every device that a killed job had "
                "decided (every device holds the snapshot's state)")
    for files, found in zip(members, marks):
        for tag in found:
            files.command(snapshot_calls.delete_snapshot, files.admin, files.nsid, MARK + tag)
    return (f"deleted the marks of a rollback of {name!r} that a killed job left on some devices (each device "
            "holds the state the marks say: every one the old, or every one the snapshot's)")
