"""The storage server's parameter cache: each optimizer namespace's committed FP16/BF16
params in server memory, keyed by the superblock that committed them, so that param reads
by many clients are served without touching the media."""
from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Sequence

from ..emulator.face import Namespace, committed_version


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One namespace's params as one committed superblock (seq) named them."""

    namespace: weakref.ref[Namespace]
    seq: int
    params: dict[str, bytes]
    nbytes: int


class ParamCache:
    """Whole-namespace param copies, least recently used out first, at most `capacity` bytes.

    An entry is valid only while its namespace object is the device's and its superblock seq
    is the committed one: every change of the committed state (commit, rollback/restore, seal)
    writes a superblock with a higher seq, and a delete makes a new namespace object, so a
    stale entry is never served (it is dropped when next seen). A skipped or aborted step
    writes no superblock and changes no param: the entry stays valid. Namespaces still loading
    (params written in place, no new superblock) are never cached.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self.counters = {"hits": 0, "misses": 0, "fills": 0, "too_large": 0, "invalidated": 0,
                         "evicted": 0, "hit_bytes": 0, "fill_bytes": 0}

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def read(self, namespace: Namespace, reads: Sequence[tuple[str, str, int, int]]) -> list[memoryview] | None:
        """Views of the (tensor, "param", offset, size) ranges, all of one committed step, from
        the cache (filled from the media on a miss); None: not cacheable (the caller reads the
        media), counted as a miss and, where the params do not fit, as too_large."""
        if not self.enabled or not reads or any(role != "param" for _, role, _, _ in reads):
            return None
        entry = self._lookup(namespace)
        if entry is None:
            entry = self._fill(namespace)
            if entry is None:
                return None
        else:
            with self._lock:
                self.counters["hits"] += 1
        views = []
        for tensor, _, offset, size in reads:
            data = memoryview(entry.params[tensor])
            views.append(data[offset : offset + size] if size > 0 and offset < len(data) else memoryview(b""))
        with self._lock:
            self.counters["hit_bytes"] += sum(len(view) for view in views)
        return views

    def _lookup(self, namespace: Namespace) -> _Entry | None:
        seq, loading = committed_version(namespace)
        with self._lock:
            entry = self._entries.get(namespace.nsid)
            if entry is None:
                return None
            if entry.namespace() is not namespace or entry.seq != seq or loading:
                self._drop_locked(namespace.nsid)
                self.counters["invalidated"] += 1
                return None
            self._entries.move_to_end(namespace.nsid)
            return entry

    def _fill(self, namespace: Namespace) -> _Entry | None:
        with self._lock:
            self.counters["misses"] += 1
        nbytes = sum(tensor.numel * namespace.itemsize("param") for tensor in namespace.layouts)
        if nbytes > self.capacity:
            with self._lock:
                self.counters["too_large"] += 1
            return None
        seq, loading = committed_version(namespace)
        if loading:
            return None
        whole = [(tensor.name, "param", 0, tensor.numel * namespace.itemsize("param")) for tensor in namespace.layouts]
        # One pin: every tensor of the same committed copy; a seq unchanged from before the
        # pin to after the copy says no superblock was written meanwhile (seq only grows).
        with namespace.read_pinned_many(whole) as views:
            params = {name: bytes(view) for (name, _, _, _), view in zip(whole, views)}
        if committed_version(namespace) != (seq, False):
            return None  # committed meanwhile: this read goes to the media
        entry = _Entry(weakref.ref(namespace), seq, params, nbytes)
        with self._lock:
            self._drop_locked(namespace.nsid)
            while self._entries and self._bytes + nbytes > self.capacity:
                oldest = next(iter(self._entries))
                self._drop_locked(oldest)
                self.counters["evicted"] += 1
            self._entries[namespace.nsid] = entry
            self._bytes += nbytes
            self.counters["fills"] += 1
            self.counters["fill_bytes"] += nbytes
        return entry

    def drop_stale(self, current: dict[int, Namespace | object]) -> None:
        """Drop entries whose namespace was deleted or whose step is no longer committed
        (after an admin command: memory back at once, not at the next read)."""
        with self._lock:
            for nsid, entry in list(self._entries.items()):
                namespace = entry.namespace()
                if (namespace is None or current.get(nsid) is not namespace
                        or committed_version(namespace) != (entry.seq, False)):
                    self._drop_locked(nsid)
                    self.counters["invalidated"] += 1

    def _drop_locked(self, nsid: int) -> None:
        entry = self._entries.pop(nsid, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters) | {"capacity": self.capacity, "bytes": self._bytes,
                                          "namespaces": len(self._entries)}
