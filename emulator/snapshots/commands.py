"""Snapshot, rollback, clone and export commands (CBh-CFh) and their log pages (C1h, C2h)."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .. import controller as controller_module
from . import export
from ...protocol.status import DeviceError, Status
from ..jobs import JobTable
from ...protocol.logpages import LBCC, NIC, LogId
from . import clone as snapshot_clone
from ..namespace import Namespace
from ...protocol.entries import NSID_ALL, Command, Completion, Opcode

# What the Commands Supported and Effects page (LID 05h) announces beyond CSUPP.
EFFECTS: dict[int, int] = {
    Opcode.SNAPSHOT_ROLLBACK: LBCC,  # the state a namespace serves changes
    Opcode.SNAPSHOT_CLONE: NIC,  # a namespace appears
}


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _payload(command: Command, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The payload as a JSON object with exactly the keys a command knows."""
    try:
        value = json.loads(command.payload.decode()) if command.payload else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeviceError(Status.INVALID_FIELD, f"payload is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise DeviceError(Status.INVALID_FIELD, "payload must be a JSON object")
    unknown = set(value) - set(required) - set(optional)
    if unknown:
        raise DeviceError(Status.INVALID_FIELD, f"unknown key(s): {', '.join(sorted(unknown))}")
    missing = [key for key in required if key not in value]
    if missing:
        raise DeviceError(Status.INVALID_FIELD, f"payload needs {', '.join(missing)}")
    return value


class SnapshotCommands:
    """The handlers; one instance per controller (its job table lives as long as the daemon)."""

    def __init__(self, controller: controller_module.Controller) -> None:
        self.device = controller.device
        self.jobs = JobTable()
        # Only in a real directory: through a link, the cleaning would remove the '.'-entries
        # of wherever it points (the device's open refuses such a link first).
        exports = self.device.path / export.EXPORTS_DIR
        if not exports.is_symlink():
            export.clean_staging(self.device.path)

    def _namespace(self, command: Command) -> Namespace:
        return self.device.optimizer_namespace(command.nsid, "a snapshot command")

    def create(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        tag = _payload(command, ("tag",))["tag"]
        snapshot = namespace.snapshots.create(tag, self.device.reserve)
        return Completion(command.cid, Status.SUCCESS, result=snapshot.step & 0xFFFFFFFF,
                          data=_json(snapshot.describe() | {"namespace": namespace.name}))

    def delete(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        tag = _payload(command, ("tag",))["tag"]
        namespace.snapshots.delete(tag)
        return Completion(command.cid, Status.SUCCESS,
                          data=_json({"namespace": namespace.name, "deleted": tag}))

    def rollback(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        tag = _payload(command, ("tag",))["tag"]
        snapshot, previous = namespace.snapshots.rollback(tag)
        return Completion(command.cid, Status.SUCCESS, result=snapshot.step & 0xFFFFFFFF,
                          data=_json({"namespace": namespace.name, "tag": snapshot.tag,
                                      "step": snapshot.step, "previous_step": previous}))

    def clone(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        request = _payload(command, ("tag", "name"))
        clone = snapshot_clone.clone(namespace.snapshots, request["tag"], request["name"], self.device)
        return Completion(command.cid, Status.SUCCESS, result=clone.nsid,
                          data=_json(clone.config() | {"committed_step": clone.committed_step,
                                                       "source": namespace.name,
                                                       "tag": request["tag"]}))

    def export(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        try:
            payload = json.loads(command.payload.decode()) if command.payload else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DeviceError(Status.INVALID_FIELD, f"payload is not valid JSON: {exc}") from None
        job = export.start(self.device, self.jobs, namespace, payload)
        return Completion(command.cid, Status.SUCCESS, result=job.job_id,
                          data=_json(job.describe()))

    # ------------------------------------------------------------------ log pages

    def _scope(self, command: Command) -> list[Namespace]:
        """The optimizer namespaces a page covers: one, or all (nsid 0 or FFFFFFFFh)."""
        if command.nsid in (0, NSID_ALL):
            optimizers = (ns.as_optimizer() for ns in self.device.namespaces.values())
            return sorted((ns for ns in optimizers if ns is not None), key=lambda ns: ns.nsid)
        return [self._namespace(command)]

    def snapshots_page(self, command: Command) -> bytes:
        return _json({ns.name: ns.snapshots.list() for ns in self._scope(command)})

    def jobs_page(self, command: Command) -> bytes:
        nsid = None if command.nsid in (0, NSID_ALL) else self._namespace(command).nsid
        return _json({"jobs": self.jobs.jobs(nsid)})


def handlers(controller: controller_module.Controller) -> dict[int, Callable[[Command], Completion]]:
    commands = SnapshotCommands(controller)
    controller.log_pages[LogId.SNAPSHOTS] = commands.snapshots_page
    controller.log_pages[LogId.JOBS] = commands.jobs_page
    controller_module.COMMAND_EFFECTS.update(EFFECTS)
    return {
        Opcode.SNAPSHOT_CREATE: commands.create,
        Opcode.SNAPSHOT_DELETE: commands.delete,
        Opcode.SNAPSHOT_ROLLBACK: commands.rollback,
        Opcode.SNAPSHOT_CLONE: commands.clone,
        Opcode.EXPORT: commands.export,
    }
