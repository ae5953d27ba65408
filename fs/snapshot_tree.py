"""The read-only `snapshots/` subtree of an optimizer namespace in the mount."""
from __future__ import annotations

import errno
import stat
from typing import Callable

from ..emulator.face import AnyNamespace, Namespace, Snapshot

from .nodes import SNAPSHOT_DIR_KINDS, Kind, Node, fuse_error

STEP_NAME = "step"
TENSORS_NAME = "tensors"
# A snapshot keeps the state a step left: no gradient.
SNAPSHOT_ROLES = ("param", "master", "exp_avg", "exp_avg_sq")


class SnapshotTree:
    """Paths under `ns/<ns>/snapshots/`: `<tag>/step` and `<tag>/tensors/<t>/<role>`.

    Nodes carry the snapshot's random id besides its tag, so a handle opened on a snapshot
    that was deleted (and perhaps taken again under the same tag) gets ENOENT, not the new
    one's bytes.
    """

    def __init__(self, namespace_of: Callable[[Node], AnyNamespace]) -> None:
        # The Tree's namespace lookup: the live namespace a node belongs to (ENOENT if gone).
        self.namespace_of = namespace_of

    def _namespace(self, node: Node) -> Namespace:
        namespace = self.namespace_of(node).as_optimizer()
        if namespace is None:
            raise fuse_error(errno.ENOENT)
        return namespace

    def snapshot(self, node: Node) -> Snapshot:
        found = self._namespace(node).snapshots.find(node.tag, node.snapshot_id)
        if found is None:
            raise fuse_error(errno.ENOENT)
        return found

    def check_exists(self, node: Node) -> None:
        if node.kind == Kind.SNAPSHOTS:
            self._namespace(node)
            return
        self.snapshot(node)
        if node.kind in (Kind.SNAP_TENSOR, Kind.SNAP_ARRAY) and node.name not in self._namespace(node).tensors:
            raise fuse_error(errno.ENOENT)

    def children(self, node: Node) -> list[tuple[str, Node]]:
        namespace = self._namespace(node)
        if node.kind == Kind.SNAPSHOTS:
            entries = []
            for tag in namespace.snapshots.tags():
                found = namespace.snapshots.find(tag)
                if found is not None:
                    entries.append((tag, Node(Kind.SNAPSHOT, node.nsid, tag=tag,
                                              snapshot_id=found.snapshot_id)))
            return entries
        tag, snapshot_id = node.tag, node.snapshot_id
        if node.kind == Kind.SNAPSHOT:
            return [(STEP_NAME, Node(Kind.SNAP_TEXT, node.nsid, STEP_NAME, tag=tag, snapshot_id=snapshot_id)),
                    (TENSORS_NAME, Node(Kind.SNAP_TENSORS, node.nsid, tag=tag, snapshot_id=snapshot_id))]
        if node.kind == Kind.SNAP_TENSORS:
            return [(t.name, Node(Kind.SNAP_TENSOR, node.nsid, t.name, tag=tag, snapshot_id=snapshot_id))
                    for t in namespace.layouts]
        if node.kind == Kind.SNAP_TENSOR:
            return [(role, Node(Kind.SNAP_ARRAY, node.nsid, node.name, role, tag=tag, snapshot_id=snapshot_id))
                    for role in SNAPSHOT_ROLES]
        raise fuse_error(errno.ENOTDIR)

    def lookup(self, parent: Node, name: str) -> Node:
        if parent.kind == Kind.SNAP_TENSORS:  # straight to the tensor: there may be thousands
            self.snapshot(parent)
            if name not in self._namespace(parent).tensors:
                raise fuse_error(errno.ENOENT)
            return Node(Kind.SNAP_TENSOR, parent.nsid, name, tag=parent.tag,
                        snapshot_id=parent.snapshot_id)
        if parent.kind == Kind.SNAPSHOTS:
            found = self._namespace(parent).snapshots.find(name)
            if found is None:
                raise fuse_error(errno.ENOENT)
            return Node(Kind.SNAPSHOT, parent.nsid, tag=name, snapshot_id=found.snapshot_id)
        for child_name, child in self.children(parent):
            if child_name == name:
                return child
        raise fuse_error(errno.ENOENT)

    @staticmethod
    def mode(node: Node) -> int:
        if node.kind in SNAPSHOT_DIR_KINDS:
            return stat.S_IFDIR | 0o555
        return stat.S_IFREG | 0o444

    def text(self, node: Node) -> bytes:
        return f"{self.snapshot(node).step}\n".encode()

    def size(self, node: Node) -> int:
        if node.kind == Kind.SNAP_TEXT:
            return len(self.text(node))
        return self._namespace(node).file_size(node.name, node.role)

    def read(self, node: Node, offset: int, size: int) -> bytes:
        """Runs on a worker thread: the first read of a block verifies its checksum."""
        return self._namespace(node).snapshots.read(node.tag, node.snapshot_id, node.name,
                                                    node.role, offset, size)
