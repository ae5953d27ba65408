"""The nodes of a mount's tree: their kinds and identities, and the FUSE error helper."""
from __future__ import annotations

import dataclasses
import enum

import pyfuse3


class Kind(enum.Enum):
    ROOT = "root"
    ADMIN = "admin"
    NS_ROOT = "ns-root"
    NAMESPACE = "namespace"
    TEXT = "text"
    TENSORS = "tensors"
    TENSOR = "tensor"
    ARRAY = "array"
    DATA = "data"  # the data file of a plain NVM namespace
    # ns/<ns>/snapshots/ and below (fs/snapshot_tree.py), all read-only
    SNAPSHOTS = "snapshots"
    SNAPSHOT = "snapshot"
    SNAP_TEXT = "snapshot-text"
    SNAP_TENSORS = "snapshot-tensors"
    SNAP_TENSOR = "snapshot-tensor"
    SNAP_ARRAY = "snapshot-array"


SNAPSHOT_DIR_KINDS = frozenset({Kind.SNAPSHOTS, Kind.SNAPSHOT, Kind.SNAP_TENSORS, Kind.SNAP_TENSOR})
SNAPSHOT_KINDS = SNAPSHOT_DIR_KINDS | {Kind.SNAP_TEXT, Kind.SNAP_ARRAY}
# Nodes that are files (every other kind is a directory).
FILE_KINDS = frozenset({Kind.ADMIN, Kind.TEXT, Kind.ARRAY, Kind.DATA, Kind.SNAP_TEXT, Kind.SNAP_ARRAY})


@dataclasses.dataclass(frozen=True)
class Node:
    """A path of the tree. Namespaces are keyed by nsid so a re-created name is a new node."""

    kind: Kind
    nsid: int = 0
    name: str = ""  # text file name, tensor name
    role: str = ""  # array role (grad, param, master, exp_avg, exp_avg_sq)
    tag: str = ""  # snapshot tag, and its id (a tag taken again is a new snapshot)
    snapshot_id: int = 0


def fuse_error(code: int) -> pyfuse3.FUSEError:
    return pyfuse3.FUSEError(code)
