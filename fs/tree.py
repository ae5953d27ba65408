"""The file tree a mount shows: stable inode numbers for paths, and what each path is."""
from __future__ import annotations

import errno
import stat

import pyfuse3

from ..emulator.face import LOADABLE_ROLES, AnyNamespace, Device, DeviceError, Namespace

from .nodes import SNAPSHOT_KINDS, Kind, Node, fuse_error
from .snapshot_tree import SnapshotTree

ADMIN_NAME = ".admin"
TEXT_FILES = ("config.json", "step", "stats.json")
NVM_TEXT_FILES = ("config.json", "stats.json")
NVM_DATA_NAME = "data"


def optimizer_of(namespace: AnyNamespace) -> Namespace:
    """`namespace` as the optimizer kind. ENOENT for another kind: nsids are never reused, so
    only a node that was never this namespace's asks."""
    optimizer = namespace.as_optimizer()
    if optimizer is None:
        raise fuse_error(errno.ENOENT)
    return optimizer


class Tree:
    """Resolves nodes against the device's current namespaces; allocates inodes lazily."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._inodes: dict[Node, int] = {
            Node(Kind.ROOT): pyfuse3.ROOT_INODE,
            Node(Kind.ADMIN): pyfuse3.ROOT_INODE + 1,
            Node(Kind.NS_ROOT): pyfuse3.ROOT_INODE + 2,
        }
        self._nodes: dict[int, Node] = {inode: node for node, inode in self._inodes.items()}
        self._next_inode = pyfuse3.ROOT_INODE + 3
        self.snapshots = SnapshotTree(self.namespace)

    def inode(self, node: Node) -> int:
        inode = self._inodes.get(node)
        if inode is None:
            inode = self._next_inode
            self._next_inode += 1
            self._inodes[node] = inode
            self._nodes[inode] = node
        return inode

    def node(self, inode: int) -> Node:
        node = self._nodes.get(inode)
        if node is None:
            raise fuse_error(errno.ENOENT)
        self.check_exists(node)
        return node

    def namespace(self, node: Node) -> AnyNamespace:
        """The live namespace of any kind a node belongs to (ENOENT if it was deleted)."""
        try:
            namespace = self.device.namespace_by_id(node.nsid)
        except DeviceError:
            raise fuse_error(errno.ENOENT) from None
        return namespace

    def optimizer_namespace(self, node: Node) -> Namespace:
        """The optimizer namespace of a node only that kind has (tensors, arrays, step): ENOENT
        if its namespace is gone or of another kind."""
        return optimizer_of(self.namespace(node))

    def check_exists(self, node: Node) -> None:
        """ENOENT for nodes of namespaces that were deleted since the inode was handed out."""
        if node.kind in (Kind.ROOT, Kind.ADMIN, Kind.NS_ROOT):
            return
        self.namespace(node)  # ENOENT if it is gone
        if node.kind in SNAPSHOT_KINDS:
            self.snapshots.check_exists(node)
        if node.kind in (Kind.TENSOR, Kind.ARRAY) and node.name not in self.optimizer_namespace(node).tensors:
            raise fuse_error(errno.ENOENT)

    def children(self, node: Node) -> list[tuple[str, Node]]:
        if node.kind == Kind.ROOT:
            return [(ADMIN_NAME, Node(Kind.ADMIN)), ("ns", Node(Kind.NS_ROOT))]
        if node.kind == Kind.NS_ROOT:
            return [
                (ns.name, Node(Kind.NAMESPACE, ns.nsid))
                for ns in sorted(self.device.namespaces.values(), key=lambda n: n.nsid)
            ]
        if node.kind == Kind.NAMESPACE and self.namespace(node).as_nvm() is not None:
            return [(name, Node(Kind.TEXT, node.nsid, name)) for name in NVM_TEXT_FILES] + [
                (NVM_DATA_NAME, Node(Kind.DATA, node.nsid))]
        if node.kind == Kind.NAMESPACE:
            entries = [(name, Node(Kind.TEXT, node.nsid, name)) for name in TEXT_FILES]
            return entries + [("tensors", Node(Kind.TENSORS, node.nsid)),
                              ("snapshots", Node(Kind.SNAPSHOTS, node.nsid))]
        if node.kind in SNAPSHOT_KINDS:
            return self.snapshots.children(node)
        if node.kind == Kind.TENSORS:
            namespace = self.optimizer_namespace(node)
            return [(t.name, Node(Kind.TENSOR, node.nsid, t.name)) for t in namespace.layouts]
        if node.kind == Kind.TENSOR:
            # ROLES, and param_fp8 where the namespace sends FP8 params (Namespace.roles).
            roles = self.optimizer_namespace(node).roles
            return [(role, Node(Kind.ARRAY, node.nsid, node.name, role)) for role in roles]
        raise fuse_error(errno.ENOTDIR)

    def lookup(self, parent: Node, name: str) -> Node:
        if parent.kind == Kind.NS_ROOT:
            namespace = self.device.namespaces.get(name)
            if namespace is None:
                raise fuse_error(errno.ENOENT)
            return Node(Kind.NAMESPACE, namespace.nsid)
        if parent.kind == Kind.TENSORS:
            if name not in self.optimizer_namespace(parent).tensors:
                raise fuse_error(errno.ENOENT)
            return Node(Kind.TENSOR, parent.nsid, name)
        if parent.kind in SNAPSHOT_KINDS:
            return self.snapshots.lookup(parent, name)
        for child_name, child in self.children(parent):
            if child_name == name:
                return child
        raise fuse_error(errno.ENOENT)

    def mode(self, node: Node) -> int:
        """File type and permission bits; what default_permissions enforces for non-root."""
        if node.kind in SNAPSHOT_KINDS:
            return self.snapshots.mode(node)
        if node.kind in (Kind.ROOT, Kind.NS_ROOT, Kind.NAMESPACE, Kind.TENSORS, Kind.TENSOR):
            return stat.S_IFDIR | 0o755
        if node.kind == Kind.ADMIN:
            return stat.S_IFREG | 0o600
        if node.kind == Kind.TEXT:
            return stat.S_IFREG | 0o444
        if node.kind == Kind.DATA:
            return stat.S_IFREG | 0o644
        if node.role == "grad":
            return stat.S_IFREG | 0o200
        if node.role in LOADABLE_ROLES and self.namespace(node).loading:
            return stat.S_IFREG | 0o644
        return stat.S_IFREG | 0o444
