"""The optimizer namespace: the Namespace class (core.py), the parts it is composed of, and its snapshot store.

core.py builds Namespace from one NamespaceCore (state.py: the state every part shares) and
one part per job, each owning its own state: media.py (NamespaceMedia: durability, damaged
copies), verify.py (CopyVerifier: checksums, lazy verification of a reopened copy, scrub),
shared.py (SharedSteps: a step the ranks of a job share; outcomes.py what it carries and how it ended), steps.py (StepEngine: begin,
commit, abort, hyperparameters, snapshot flips), reads.py (Reads) and writes.py
(GradientWrites: initial state, the gradient path); open.py creates, opens and recovers the
files; common.py holds roles, counters and CommitResult, snapshots.py each namespace's
snapshot store (SnapshotStore). They import cossd.protocol, cossd.kernels and the device's
lower modules beside this package (layout, media, spec, superblock, transaction,
accounting, workers), never the controller, the command modules or the device that hold them.

The names below are imported when first used: the mount daemon's light modules import
verify.py's constants before numpy, and a part imported first must not pull in core.py,
which imports every part.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

if TYPE_CHECKING:  # `X as X`: an explicit re-export, so ruff and mypy see what __all__ lists
    from ..spec import NamespaceSpec as NamespaceSpec, TensorSpec as TensorSpec
    from .common import (
        LOADABLE_ROLES as LOADABLE_ROLES,
        ROLES as ROLES,
        CommitResult as CommitResult,
        NamespaceCounters as NamespaceCounters,
    )
    from .core import Namespace as Namespace

# Each exported name, and the module (relative to this package) that defines it.
_EXPORTS = {
    "CommitResult": ".common",
    "LOADABLE_ROLES": ".common",
    "Namespace": ".core",
    "NamespaceCounters": ".common",
    "NamespaceSpec": "..spec",
    "ROLES": ".common",
    "TensorSpec": "..spec",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
