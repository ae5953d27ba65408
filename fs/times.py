"""The times a mount shows for each node: when the step, write or change it shows last happened."""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..emulator.face import Device, Namespace

from .nodes import Kind, Node
from .tree import Tree, optimizer_of

# The device registry: rewritten whole (atomically) whenever a namespace is created or deleted.
_REGISTRY_FILE = "superblock.json"


def _mtime_ns(path: Path, fallback: int) -> int:
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return fallback


class NodeTimes:
    """mtime (= ctime) of every node, so that rsync, backups and `find -newer` see changes.

    - state files (param, master, moments) and `step`: the last commit, rollback or
      initial-state write (Namespace.changed_ns); `grad` too, as the step that took it;
    - `config.json`: the last hyperparameter change; `stats.json`: now (its counters are live);
    - a plain NVM namespace's `data`: its media file's mtime, which every write moves;
    - snapshots: when they were taken; `ns/` and the root: the last create or delete;
    - `.admin`: the mount's start.
    """

    def __init__(self, device: Device, tree: Tree, started_ns: int) -> None:
        self.device = device
        self.tree = tree
        self.started_ns = started_ns

    def of(self, node: Node) -> int:
        kind = node.kind
        if kind == Kind.ADMIN:
            return self.started_ns
        if kind in (Kind.ROOT, Kind.NS_ROOT):
            return _mtime_ns(self.device.path / _REGISTRY_FILE, self.started_ns)
        any_kind = self.tree.namespace(node)
        nvm = any_kind.as_nvm()
        if nvm is not None:  # a plain NVM namespace
            if kind == Kind.DATA or (kind == Kind.TEXT and node.name == "stats.json"):
                return _mtime_ns(nvm.path, self.started_ns)
            return _mtime_ns(nvm.directory / "meta.json", self.started_ns)
        namespace = optimizer_of(any_kind)
        if kind == Kind.TEXT:
            if node.name == "stats.json":
                return time.time_ns()
            if node.name == "config.json":
                return namespace.config_changed_ns
            return namespace.changed_ns
        if kind == Kind.ARRAY:
            return namespace.changed_ns
        if kind == Kind.SNAPSHOTS:
            return max([self._snapshot_time(namespace, tag) for tag in namespace.snapshots.tags()]
                       + [_mtime_ns(namespace.directory / "meta.json", self.started_ns)])
        if node.tag:  # a snapshot's node: when it was taken
            return self._snapshot_time(namespace, node.tag)
        # The namespace's own directories: when it was created.
        return _mtime_ns(namespace.directory / "meta.json", self.started_ns)

    def _snapshot_time(self, namespace: Namespace, tag: str) -> int:
        found = namespace.snapshots.find(tag)
        if found is None:
            return self.started_ns
        return _mtime_ns(found.state_path, _mtime_ns(found.directory, self.started_ns))
