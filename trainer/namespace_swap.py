"""Replace an optimizer namespace's state atomically: load a staging namespace, then switch."""
from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any, Callable

from ..protocol.status import DeviceError, Status
from ..client import snapshots as snapshot_calls

if TYPE_CHECKING:
    from .namespace_files import NamespaceFiles

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


def replace(files: NamespaceFiles, description: dict[str, Any], fill: Callable[[], None],
            hook: Callable[[str], None] = lambda stage: None) -> None:
    """Make namespace `files.name` hold new state, atomically: a kill -9 (of this process or
    of the daemon) at any instant leaves either the old run or the new one, whole.

    The state is loaded (`fill`, which writes through `files`) into a fresh staging
    namespace, which is then sealed (its loading phase ended, durably) and snapshotted. Only
    then is the old namespace deleted and the snapshot cloned under its name; the staging
    namespace goes last. resolve_interrupted() finishes or undoes a replace cut short. On
    an error before the old namespace is deleted, the staging namespace is dropped and the
    old run is untouched. `files` ends up on the new namespace."""
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
    files.delete()
    hook("old_deleted")
    try:
        new_nsid = _switch(files, staging_nsid, hook)
    except BaseException as exc:
        raise RuntimeError(
            f"the new state of {name!r} is loaded and sealed in {staging!r}, but switching it in "
            f"failed ({exc}); the next optimizer created on {name!r} finishes the switch") from exc
    files.retarget(name, new_nsid)
    hook("done")
