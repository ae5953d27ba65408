"""Replace an optimizer namespace's state atomically (on one device, or on every device of a group): load a staging namespace, then switch."""
from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Callable

from ...protocol.status import DeviceError, Status
from ...client import snapshots as snapshot_calls

if TYPE_CHECKING:
    from .files import NamespaceFiles

log = logging.getLogger(__name__)

# The staging namespace of namespace N is N + STAGING_SUFFIX: the name is reserved for it.
STAGING_SUFFIX = ".cossd-load"
# The snapshot of the sealed staging namespace that the switch clones under N's name.
SNAPSHOT_TAG = "cossd-load"
_MAX_NAME = 128

# The points of a replace, in order; `hook(stage)` is called after each (tests kill there).
STAGES = ("created", "filled", "began", "sealed", "snapshotted", "old_deleted", "cloned", "done")


def staging_name(name: str) -> str:
    """The staging namespace's name for `name` (shortened, with a digest, to fit 128 chars)."""
    if len(name) + len(STAGING_SUFFIX) <= _MAX_NAME:
        return name + STAGING_SUFFIX
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    return f"{name[: _MAX_NAME - len(STAGING_SUFFIX) - 9]}-{digest}{STAGING_SUFFIX}"


def _listing(files: NamespaceFiles) -> dict[str, dict[str, Any]]:
    return {entry["name"]: entry for entry in files.command(files.admin.describe)["namespaces"]}


def _delete(files: NamespaceFiles, nsid: int) -> None:
    """Delete a staging namespace, also one a killed job left with its sealing step open."""
    for attempt in range(2):
        try:
            files.command(files.admin.delete_namespace, nsid)
            return
        except DeviceError as exc:
            if exc.status == Status.INVALID_NAMESPACE:  # already gone is what was wanted
                return
            if exc.status != Status.STEP_ALREADY_OPEN or attempt:
                raise
        files.command(files.admin.abort_step, nsid)


def _switch(files: NamespaceFiles, staging_nsid: int, hook: Callable[[str], None]) -> int:
    """Clone the sealed staging namespace's snapshot under the target's name (the target is
    gone), then drop the staging namespace. Returns the new nsid."""
    listed = files.command(snapshot_calls.snapshots, files.admin, staging_nsid)
    state = {snapshot["tag"]: snapshot["state"] for snapshot in listed.get(staging_name(files.name), [])}
    if state.get(SNAPSHOT_TAG) != "ready":
        if SNAPSHOT_TAG in state:  # damaged: the sealed staging namespace itself is whole
            files.command(snapshot_calls.delete_snapshot, files.admin, staging_nsid, SNAPSHOT_TAG)
        files.command(snapshot_calls.create_snapshot, files.admin, staging_nsid, SNAPSHOT_TAG)
    try:
        nsid = int(files.command(snapshot_calls.clone, files.admin, staging_nsid, SNAPSHOT_TAG,
                                 files.name)["nsid"])
    except DeviceError as exc:
        # A clone a killed job had sent may have completed meanwhile: then it is the new run.
        if exc.status != Status.NAMESPACE_EXISTS:
            raise
        nsid = int(_listing(files)[files.name]["nsid"])
    hook("cloned")
    _delete(files, staging_nsid)
    return nsid


def resolve_interrupted(files: NamespaceFiles) -> str | None:
    """Finish or undo a replace that a killed job left half done, so that `files.name` holds
    one whole run (or, if neither it nor a staging namespace exists, none: a start).

    - The target still exists: it is the old run (the switch never began) or the new one
      (the switch ended); either way the staging namespace is done with and is deleted.
    - The target is gone: the switch had begun, and the staging namespace is sealed (the old
      run is deleted only after that), so the switch is finished: it becomes the target.

    Returns what was done, for the caller to log, or None if nothing was left over."""
    listing = _listing(files)
    staging = listing.get(staging_name(files.name))
    if staging is None:
        return None
    if files.name in listing:
        _delete(files, int(staging["nsid"]))
        return f"deleted the staging namespace of a load into {files.name!r} that did not finish"
    if staging["loading"]:
        raise RuntimeError(
            f"namespace {files.name!r} is missing and its staging namespace "
            f"{staging_name(files.name)!r} never finished loading: no whole run is left on the "
            "device. Delete the staging namespace with `cossd delete-ns` and load a checkpoint")
    _switch(files, int(staging["nsid"]), lambda stage: None)
    return f"finished a load into {files.name!r} that a killed job had sealed but not switched"


def _prepare(files: NamespaceFiles, description: dict[str, Any], fill: Callable[[], object],
             hook: Callable[[str], None]) -> int:
    """The first half of a replace: the new state loaded (`fill`) into a fresh staging
    namespace, sealed (its loading phase ended, durably) and snapshotted; the old run is
    untouched. Returns the staging namespace's nsid, `files` back on the old run. On an
    error the staging namespace is dropped and the error raised."""
    name, old_nsid = files.name, files.nsid
    assert old_nsid is not None
    staging = staging_name(name)
    leftover = _listing(files).get(staging)
    if leftover is not None:
        _delete(files, int(leftover["nsid"]))
    step = int(description.get("initial_step", 0))
    files.retarget(staging, None)
    try:
        files.create(description | {"name": staging})
        hook("created")
        fill()
        hook("filled")
        # A begin seals the loading phase (checksums, fsync, superblock) and the abort drops
        # the step it opened: the staging namespace now holds the new state, durable.
        files.command(files.admin.begin_step, files.nsid, step + 1, 1.0)
        hook("began")
        files.command(files.admin.abort_step, files.nsid)
        hook("sealed")
        files.command(snapshot_calls.create_snapshot, files.admin, files.nsid, SNAPSHOT_TAG)
        hook("snapshotted")
    except BaseException:
        staging_nsid = files.nsid
        files.retarget(name, old_nsid)
        if staging_nsid is not None:
            try:
                _delete(files, staging_nsid)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.warning("could not delete the staging namespace %s; the next optimizer on "
                            "%s deletes it", staging, name)
        raise
    staging_nsid = files.nsid
    assert staging_nsid is not None
    files.retarget(name, old_nsid)
    return staging_nsid


def replace(files: NamespaceFiles, description: dict[str, Any], fill: Callable[[], object],
            hook: Callable[[str], None] = lambda stage: None) -> None:
    """Make namespace `files.name` hold new state, atomically: a kill -9 (of this process or
    of the daemon) at any instant leaves either the old run or the new one, whole.

    The state is loaded (`fill`, which writes through `files`) into a fresh staging
    namespace, which is then sealed (its loading phase ended, durably) and snapshotted. Only
    then is the old namespace deleted and the snapshot cloned under its name; the staging
    namespace goes last. resolve_interrupted() finishes or undoes a replace cut short. On
    an error before the old namespace is deleted, the staging namespace is dropped and the
    old run is untouched. `files` ends up on the new namespace."""
    name = files.name
    staging_nsid = _prepare(files, description, fill, hook)
    files.delete()
    hook("old_deleted")
    try:
        new_nsid = _switch(files, staging_nsid, hook)
    except BaseException as exc:
        raise RuntimeError(
            f"the new state of {name!r} is loaded and sealed in {staging_name(name)!r}, but switching it in "
            f"failed ({exc}); the next optimizer created on {name!r} finishes the switch") from exc
    files.retarget(name, new_nsid)
    hook("done")


# ---------------------------------------------------------------------------------------------
# A group of devices (mount=[...]): one namespace of the same name on each, replaced together.
#
# The new state is prepared (staged, sealed, snapshotted) on every device in order, device 0
# first; only then is each device switched, in the same order. So while preparing, the
# staging namespaces lie on a prefix of the devices (an error drops them last device first,
# keeping it one) and every device still holds its old run; once switching has begun, device
# 0 has no staging namespace left, or has lost its old run, or holds the new one. The new run
# is a clone made after its staging namespace, so its nsid is the larger (a device never
# reuses an nsid, and hands them out in increasing order), where the old run's is smaller.
# That is enough for resolve_group to tell, from the devices alone, which half a killed
# replace was in: before the switch began every device goes back to its old run, after it
# every device goes on to the new one.


def replace_group(members: list[NamespaceFiles], descriptions: list[dict[str, Any]],
                  fills: list[Callable[[], object]],
                  hook: Callable[[str], None] = lambda stage: None) -> None:
    """Make the namespace on every device of `members` hold new state, atomically for the
    group: a kill -9 at any instant leaves the old run on every device or the new one on
    every device (resolve_group, at the next open, finishes or undoes it). `hook` gets each
    stage as "<stage>@<device index>", then "done". Each member's files end up on its new
    namespace."""
    prepared: list[tuple[NamespaceFiles, int]] = []
    try:
        for index, (files, description, fill) in enumerate(zip(members, descriptions, fills)):
            prepared.append((files, _prepare(files, description, fill, lambda stage: hook(f"{stage}@{index}"))))
    except BaseException:
        for files, staging_nsid in reversed(prepared):  # the last first: the rest stay a prefix
            try:
                _delete(files, staging_nsid)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                log.warning("could not delete the staging namespace of %s; the next optimizer on "
                            "it deletes it", files.name)
        raise
    for index, (files, staging_nsid) in enumerate(prepared):
        try:
            files.delete()
            hook(f"old_deleted@{index}")
            new_nsid = _switch(files, staging_nsid, lambda stage: hook(f"{stage}@{index}"))
        except BaseException as exc:
            raise RuntimeError(
                f"the new state of {files.name!r} is loaded and sealed on every device of the group, and "
                f"switching it in failed on device {index} ({exc}); the next optimizer created on the "
                "group finishes the switch on every device") from exc
        files.retarget(files.name, new_nsid)
        hook(f"switched@{index}")
    hook("done")


def resolve_group(members: list[NamespaceFiles]) -> str | None:
    """Finish or undo a replace_group that a killed job left half done (see above), so that
    every device holds the old run or every device the new one. Returns what was done, for
    the caller to log, or None if nothing was left over."""
    found = []
    for files in members:
        listing = _listing(files)
        found.append((files, listing.get(files.name), listing.get(staging_name(files.name))))
    if all(staging is None for _, _, staging in found):
        return None
    began = found[0][2] is None or any(
        staging is not None and (target is None or int(target["nsid"]) > int(staging["nsid"]))
        for _, target, staging in found)
    name = members[0].name
    if not began:
        for files, target, staging in reversed(found):
            if staging is not None:
                if target is None:
                    raise RuntimeError(f"namespace {files.name!r} is missing on one device of the group while "
                                       "a load into it had not begun switching: no whole run is left there")
                _delete(files, int(staging["nsid"]))
        return f"deleted the staging namespaces of a load into {name!r} that did not finish (every device keeps the old run)"
    for files, target, staging in found:
        if staging is None:
            continue  # switched already
        if staging["loading"]:
            raise RuntimeError(f"namespace {files.name!r}: its staging namespace never finished loading "
                               "although the group's switch had begun; delete it with `cossd delete-ns`")
        if target is not None and int(target["nsid"]) > int(staging["nsid"]):
            _delete(files, int(staging["nsid"]))  # switched, all but dropping the staging namespace
            continue
        if target is not None:
            files.command(files.admin.delete_namespace, int(target["nsid"]))  # the old run
        _switch(files, int(staging["nsid"]), lambda stage: None)
    return f"finished a load into {name!r} that a killed job had begun switching (every device holds the new run)"
