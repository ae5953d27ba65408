"""The device: identity, the namespace registry and its superblock, open/format/close."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .backing import IN_USE_FILE, SUPERBLOCK_FILE, BackingDirectory
from ..protocol.status import DeviceError, Status
from .health import Health
from .lifetime import LifetimeCounters
from . import kinds
from .layout import FORMAT_VERSION
from .media import atomic_write_json, fsync_dir, read_json
from .names import MAX_NAMESPACES
from .namespace.verify import VERIFY_MODES, VERIFY_OPEN
from .workers import KernelWorkers
from .accounting import NamespaceTiming
from ..model.profiles import DEFAULT_PROFILE
from ..model.timing import TimingModel

log = logging.getLogger(__name__)

MODEL = "cossd computational SSD emulator"
FIRMWARE_REVISION = "0.1.0"
VENDOR_ID = 0x1D1D  # not a PCI-SIG assignment: the emulator's own
# In a clean close's superblock.json: the namespaces that open could not open (failed_namespaces),
# which that close therefore never flushed (Device.close).
UNFLUSHED_KEY = "unflushed_namespaces"


@dataclasses.dataclass(frozen=True)
class DeviceConfig:
    """How a device is opened (not stored on the media)."""

    # True: every commit is flushed before it is acknowledged. False (default): the device
    # acts like a drive with power-loss protection; a commit is acknowledged once it would
    # survive a daemon crash and reaches the media in the background (lag: one step).
    sync: bool = False
    # The timing model's device profile: a built-in name or a JSON file (model/profiles.py).
    profile: str = DEFAULT_PROFILE
    # True: file I/O and step commands complete no earlier than their modeled device time.
    timed: bool = False
    # When an opened namespace's committed step is verified (namespace.verify.VERIFY_MODES):
    # "open", every block's checksum before the device serves anything; "background", params
    # as they are first served and the rest in a thread, so that a restart serves params at
    # once whatever the state's size (what `cossd mount` does unless told --verify open).
    verify: str = VERIFY_OPEN


class Device:
    """A formatted backing directory, opened exclusively by one process."""

    def __init__(self, path: Path, superblock: dict[str, Any], config: DeviceConfig,
                 backing: BackingDirectory) -> None:
        self.path = path
        self.config = config
        self._superblock = superblock
        self._backing = backing  # held (flocked) until close
        self._lock = threading.Lock()
        self.namespaces: dict[str, kinds.AnyNamespace] = {}
        self.failed_namespaces: dict[str, str] = {}
        self.opened_at = time.time()
        self.health = Health(superblock.get("health"))
        self._marked_in_use = False  # mark_in_use() done
        self._in_use_file = False  # the in-use file is (or may be) there: a clean close removes it
        self._marking: threading.Thread | None = None  # mark_in_use(durable_now=False)'s fsyncs
        # Recovery ran over every registered namespace (Device.open got to the end): only then
        # can a close vouch for the state it leaves (see close).
        self._recovered = False
        self.timing_model = TimingModel.named(config.profile)
        # The threads every optimizer namespace of this device steps its blocks on.
        self.workers = KernelWorkers()

    # ------------------------------------------------------------------ format, open

    @staticmethod
    def format(
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int | None = None,
        serial: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """Create an empty device in directory `path`; returns its identity.

        Refused (NAMESPACE_NOT_READY) while a process has the device open, --force or not:
        the lock is held from the check to the end, so no daemon can open it meanwhile."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        try:
            backing = BackingDirectory.lock(root)
        except DeviceError as exc:
            if exc.status != Status.NAMESPACE_NOT_READY:
                raise
            raise DeviceError(
                Status.NAMESPACE_NOT_READY,
                f"{root} is in use: the device is mounted (or opened by another process); "
                "unmount it before formatting",
            ) from None
        try:
            return Device._format_locked(root, capacity_bytes, serial, force)
        finally:
            backing.close()

    @staticmethod
    def _format_locked(root: Path, capacity_bytes: int | None, serial: str | None,
                       force: bool) -> dict[str, Any]:
        if os.path.lexists(root / SUPERBLOCK_FILE) and not force:
            raise DeviceError(
                Status.INVALID_FIELD, f"{root} already holds a cossd device (use --force to erase it)"
            )
        if force:
            for child in root.iterdir():
                # A link is removed, never followed (rmtree refuses one anyway).
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        if capacity_bytes is None:
            filesystem = os.statvfs(root)
            capacity_bytes = filesystem.f_bavail * filesystem.f_frsize
        if capacity_bytes <= 0:
            raise DeviceError(Status.INVALID_FIELD, "capacity must be positive")
        # A new device starts clean, whatever an old one's daemon left; anything but a file of
        # that name is the user's, and refused before anything is written.
        in_use = root / IN_USE_FILE
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(in_use.lstat().st_mode):
                raise DeviceError(Status.INVALID_FIELD, f"refusing {in_use}: it is not a regular file, and a "
                                  "device formatted here writes a file of that name (remove it)")
            in_use.unlink()
        (root / "ns").mkdir(exist_ok=True)
        identity: dict[str, Any] = {
            "vid": VENDOR_ID,
            "serial": serial or secrets.token_hex(10).upper(),
            "model": MODEL,
            "firmware_revision": FIRMWARE_REVISION,
            "capacity_bytes": int(capacity_bytes),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        superblock = {
            "format_version": FORMAT_VERSION,
            "identity": identity,
            "namespaces": {},
            "next_nsid": 1,
            "health": dataclasses.asdict(LifetimeCounters()) | {"clean": True},
        }
        fsync_dir(root)
        atomic_write_json(root / SUPERBLOCK_FILE, superblock)
        return identity

    @staticmethod
    def _read_superblock(root: Path) -> dict[str, Any]:
        try:
            superblock = read_json(root / SUPERBLOCK_FILE)
        except FileNotFoundError:
            raise DeviceError(
                Status.INVALID_FIELD, f"{root} is not a cossd device (run `cossd format {root}`)"
            ) from None
        if superblock.get("format_version") != FORMAT_VERSION:
            raise DeviceError(
                Status.INVALID_FIELD,
                f"{root}: media format {superblock.get('format_version')} is not supported "
                f"(this build reads format {FORMAT_VERSION})",
            )
        return superblock

    @classmethod
    def open(cls, path: str | os.PathLike[str], config: DeviceConfig = DeviceConfig(), *,
             mark_in_use: bool = True) -> "Device":
        """Open the device at `path`: its lock, the power cycle counted, the in-use mark made
        durable, every namespace recovered.

        mark_in_use=False leaves the mark to the caller's `mark_in_use()`, which it must call
        before it serves anything (the mount daemon opens the device early, while the disk is
        busy reading params ahead, and makes the mark just before it mounts, without waiting
        for its fsyncs). Nothing the open itself writes needs it first: what recovery writes
        (a wiped slot, a re-created copy) is fsynced on its own."""
        root = Path(path)
        cls._read_superblock(root)  # a clear error before taking the lock
        TimingModel.named(config.profile)  # likewise for an unknown profile
        if config.verify not in VERIFY_MODES:
            raise DeviceError(Status.INVALID_FIELD,
                              f"verify must be one of {', '.join(VERIFY_MODES)}, not {config.verify!r}")
        backing = BackingDirectory.lock(root)
        try:
            # Read again under the lock: a previous owner may have closed (and saved) since.
            superblock = cls._read_superblock(root)
            # Before anything is written or deleted: no link or foreign file where the
            # device writes (emulator/backing.py).
            backing.check()
        except BaseException:
            backing.close()
            raise
        device = cls(root, superblock, config, backing)
        # Only a close that recorded itself counts (a device formatted before the flag
        # existed has none): its namespaces were flushed whole, so recovery need not fsync.
        # The in-use file says a daemon served since, whatever superblock.json says (its own
        # mark may not have been written yet: mark_in_use).
        device._in_use_file = backing.in_use_file_exists()
        closed_cleanly = superblock.get("health", {}).get("clean") is True and not device._in_use_file
        # Namespaces that clean close could not open, so never flushed: what an earlier crash
        # left of them may still be in the page cache only, and their recovery must fsync it.
        unflushed = frozenset(superblock.get(UNFLUSHED_KEY, ())) if closed_cleanly else frozenset()
        if device._in_use_file:
            device.health.previous_open_was_clean = False
        try:
            device.health.power_on()
            if mark_in_use:
                device.mark_in_use()
            device._open_namespaces(durable=closed_cleanly, unflushed=unflushed)
        except BaseException:
            device.close()
            raise
        device._recovered = True
        return device

    def mark_in_use(self, *, durable_now: bool = True) -> None:
        """Mark the device in use before serving anything (once; Device.open does it unless
        told not to): an open that finds the mark still set knows the previous one never
        closed cleanly, counts an unsafe shutdown, and has recovery fsync what it keeps.

        durable_now=False (the mount daemon, at a restart) leaves the mark's fsyncs to a
        thread, since they wait behind whatever the disk has queued (the params being read
        ahead, the background verification). Before anything is served, the mark need only be
        *visible* to the next open: a daemon killed while serving leaves its writes in the
        page cache, and that open must fsync them, so it must see the mark; a power cut takes
        the page cache, the mark with it, and leaves that open nothing to fsync. So an empty
        in-use file is created at once, and the thread then records clean: false in
        superblock.json durably, as the mark always was, so that an unsafe shutdown is counted
        after a power cut too (except a cut within those fsyncs, the one window where it goes
        uncounted, and which lasts until the thread is done: seconds where the disk is busy). A
        clean close waits for the thread, then removes the file."""
        if self._marked_in_use:
            return
        self._marked_in_use = True
        if durable_now:
            self._record_in_use()
            return
        try:
            self._backing.create_in_use_file()
            self._in_use_file = True
        except (OSError, DeviceError) as exc:
            # Then the mark waits for its fsyncs, as it always did.
            log.error("could not create %s (%s): marking the device in use durably first",
                      self.path / IN_USE_FILE, exc.strerror if isinstance(exc, OSError) else exc.message)
            self._record_in_use()
            return
        self._marking = threading.Thread(target=self._record_in_use, name="cossd-in-use-mark", daemon=True)
        self._marking.start()

    def _record_in_use(self) -> None:
        with self._lock:
            try:
                self._store(dict(self._superblock), clean=False)
            except Exception as exc:  # on the mark's thread too, where nothing else would say it
                # A full backing store must not stop a device whose state is preallocated from
                # serving; only a crash during this open would then go uncounted.
                log.error("could not mark the device in use: %s",
                          exc.message if isinstance(exc, DeviceError) else exc)

    def _open_namespaces(self, durable: bool = False, unflushed: frozenset[str] = frozenset()) -> None:
        registered = self._superblock["namespaces"]
        for name, nsid in registered.items():
            try:
                namespace = kinds.open_namespace(self._ns_dir(name), self.config.sync, self.config.verify,
                                                 durable=durable and name not in unflushed)
            except (DeviceError, OSError, ValueError, KeyError) as exc:
                self.failed_namespaces[name] = str(exc)
                log.error("namespace %s (nsid %d) cannot be served: %s", name, nsid, exc)
                continue
            self._attach(namespace)
            self.namespaces[name] = namespace
            # Blocks recovery found bad are media errors (counted by the namespace) and, like
            # those scrub finds, error log entries; no command caused them.
            for _tensor, _block, index in namespace.recovery_errors:
                self.health.log_error(Status.UNRECOVERED_READ_ERROR, sqid=0xFFFF, lba=index,
                                      nsid=namespace.nsid)
            # A state copy recovery found missing or short (and re-created): one entry each.
            for _reason in getattr(namespace, "damaged_copies", ()):
                self.health.log_error(Status.UNRECOVERED_READ_ERROR, sqid=0xFFFF, nsid=namespace.nsid)
        # Directories not in the registry are leftovers of a create or delete that crashed
        # before (create) or after (delete) its commit point.
        for child in (self.path / "ns").iterdir():
            if child.name not in registered:
                log.warning("removing incomplete namespace directory %s", child)
                shutil.rmtree(child, ignore_errors=True)

    def _remove_in_use_file(self) -> None:
        """After the clean record: the in-use file gone, durably (a power cut that brought it
        back would count an unsafe shutdown that never happened)."""
        if not self._in_use_file:
            return
        try:
            if self._backing.remove_in_use_file():
                fsync_dir(self.path)
        except (OSError, DeviceError) as exc:
            # The next open then counts an unsafe shutdown and fsyncs what recovery keeps:
            # wrong by one count, never unsafe.
            log.error("could not remove %s: %s", self.path / IN_USE_FILE, exc)

    def _ns_dir(self, name: str) -> Path:
        return self.path / "ns" / name

    def close(self) -> None:
        """Flush every namespace, save the health figures as a clean shutdown, release the
        backing directory.

        The clean record says recovery may skip its fsyncs next time, so it is written only
        where this open recovered every namespace and flushed every one it opened; those it
        could not open are named in it (UNFLUSHED_KEY), for their next recovery to fsync. An
        open that failed part-way leaves the device as it found it (the next open counts an
        unsafe shutdown)."""
        try:
            # First: the mark's thread reads the namespaces' counters, which the close below
            # folds and clears, and its clean: false must not land after the clean record.
            if self._marking is not None:
                self._marking.join()
            flushed = True
            try:
                for namespace in list(self.namespaces.values()):
                    # One namespace whose media failed (a file deleted under it) must not keep
                    # the others from flushing and releasing their files.
                    try:
                        namespace.close()
                    except DeviceError as exc:
                        flushed = False
                        log.error("namespace %s could not be flushed at close: %s", namespace.name, exc.message)
            finally:
                for namespace in list(self.namespaces.values()):
                    self.health.fold(namespace.counters)
                self.namespaces.clear()
            if self._backing.held and flushed and self._recovered:
                with self._lock:
                    try:
                        self._store(dict(self._superblock) | {UNFLUSHED_KEY: sorted(self.failed_namespaces)},
                                    clean=True)
                    except DeviceError as exc:
                        # The mark stays set: the next open counts an unsafe shutdown.
                        log.error("could not record a clean shutdown: %s", exc.message)
                    else:
                        self._remove_in_use_file()
        finally:
            self.workers.shutdown()
            self._backing.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ identity

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self._superblock["identity"])

    @property
    def capacity_bytes(self) -> int:
        return int(self._superblock["identity"]["capacity_bytes"])

    @property
    def allocated_bytes(self) -> int:
        namespaces = list(self.namespaces.values())  # created/deleted from other threads
        return sum(ns.allocated_bytes for ns in namespaces)

    def _attach(self, namespace: kinds.AnyNamespace) -> None:
        """Give a namespace the device's parts: optimizer namespaces account their commands on
        the device's timing model and step their blocks on the device's kernel workers; every
        namespace reports damaged media to the device's error log."""
        optimizer = namespace.as_optimizer()
        if optimizer is not None:
            optimizer.timing = NamespaceTiming(self.timing_model, timed=self.config.timed)
            optimizer.workers = self.workers
        self._attach_error_log(namespace)

    def _attach_error_log(self, namespace: kinds.AnyNamespace) -> None:
        """A state copy found damaged while serving is an Error Information entry (a media
        error no command caused), as the blocks recovery and scrub find bad are."""
        nsid = namespace.nsid

        def log_media_error() -> None:
            self.health.log_error(Status.UNRECOVERED_READ_ERROR, sqid=0xFFFF, nsid=nsid)

        def log_block_error(error: tuple[str, int, int]) -> None:
            # A block the background verification found bad, as recovery's at open.
            self.health.log_error(Status.UNRECOVERED_READ_ERROR, sqid=0xFFFF, lba=error[2], nsid=nsid)

        optimizer = namespace.as_optimizer()
        if optimizer is not None:  # only an optimizer namespace keeps checksummed state copies
            optimizer.media_error_sink = log_media_error
            optimizer.recovery_error_sink = log_block_error

    def describe(self) -> dict[str, Any]:
        """Identity, capacity and namespaces, as the vendor identify command returns them."""
        return {
            "identity": self.identity,
            "format_version": self._superblock["format_version"],
            "backing": str(self.path),
            "pid": os.getpid(),
            "durability": "sync" if self.config.sync else "plp",
            "timing": {"profile": self.timing_model.profile.name, "timed": self.config.timed},
            "capacity_bytes": self.capacity_bytes,
            "allocated_bytes": self.allocated_bytes,
            "namespaces": [
                {"name": ns.name, "nsid": ns.nsid, "kind": ns.kind, "committed_step": ns.committed_step,
                 "durable_step": ns.durable_step, "loading": ns.loading}
                for ns in sorted(self.namespaces.values(), key=lambda n: n.nsid)
            ],
            "failed_namespaces": dict(self.failed_namespaces),
        }

    # ------------------------------------------------------------------ namespaces

    def namespace(self, name: str) -> kinds.AnyNamespace:
        namespace = self.namespaces.get(name)
        if namespace is None:
            if name in self.failed_namespaces:
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"namespace {name!r} failed recovery: {self.failed_namespaces[name]}",
                )
            raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace named {name!r}")
        return namespace

    def name_of(self, nsid: int) -> str:
        """The registered name of `nsid`, also for a namespace that failed recovery."""
        for name, registered in self._superblock["namespaces"].items():
            if registered == nsid:
                return str(name)
        raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace with nsid {nsid}")

    def namespace_by_id(self, nsid: int) -> kinds.AnyNamespace:
        for namespace in self.namespaces.values():
            if namespace.nsid == nsid:
                return namespace
        raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace with nsid {nsid}")

    def optimizer_namespace(self, nsid: int, needs: str) -> kinds.Namespace:
        """Optimizer namespace `nsid`, for a command or transfer (`needs`, as the error names
        it) that only that kind serves: NAMESPACE_KIND_MISMATCH for a namespace of another
        kind, which has no steps, state or snapshots to offer."""
        namespace = self.namespace_by_id(nsid)
        optimizer = namespace.as_optimizer()
        if optimizer is None:
            raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                              f"namespace {namespace.name!r} is a plain {namespace.kind} namespace: "
                              f"{needs} needs an optimizer namespace")
        return optimizer

    def create_namespace(self, spec: kinds.AnySpec) -> kinds.AnyNamespace:
        """Allocate a namespace of either kind; the registry update in the device superblock
        commits it."""
        spec.validate()
        return self.adopt_namespace(
            spec.name, kinds.allocation_bytes(spec),
            lambda directory, nsid: kinds.create(directory, nsid, spec, self.config.sync))

    def delete_namespace(self, name: str) -> None:
        with self._lock:
            if name not in self._superblock["namespaces"]:
                raise DeviceError(Status.INVALID_NAMESPACE, f"no namespace named {name!r}")
            namespace = self.namespaces.get(name)
            if namespace is not None and namespace.step_open is not None:
                raise DeviceError(
                    Status.STEP_ALREADY_OPEN,
                    f"namespace {name!r} has step {namespace.step_open} open; abort it first",
                )
            updated = dict(self._superblock)
            updated["namespaces"] = {
                k: v for k, v in self._superblock["namespaces"].items() if k != name
            }
            self._store(updated, clean=False)
            self.namespaces.pop(name, None)
            self.failed_namespaces.pop(name, None)
            if namespace is not None:
                namespace.close()
                # What it counted stays in the device's lifetime figures.
                self.health.fold(namespace.counters)
            shutil.rmtree(self._ns_dir(name), ignore_errors=True)

    def _check_capacity(self, needed_bytes: int, what: str) -> None:
        free = self.capacity_bytes - self.allocated_bytes
        if needed_bytes > free:
            raise DeviceError(
                Status.NAMESPACE_INSUFFICIENT_CAPACITY,
                f"{what} needs {needed_bytes} bytes; {max(0, free)} of {self.capacity_bytes} free",
            )

    @contextlib.contextmanager
    def reserve(self, needed_bytes: int, what: str) -> Iterator[None]:
        """Hold the device's capacity while `what` (a snapshot) allocates `needed_bytes`:
        no namespace create or other reservation can take the same bytes meanwhile."""
        with self._lock:
            self._check_capacity(needed_bytes, what)
            yield

    def adopt_namespace(self, name: str, needed_bytes: int,
                        build: Callable[[Path, int], kinds.AnyNamespace]) -> kinds.AnyNamespace:
        """Register a namespace whose files `build(directory, nsid)` lays down and opens (a
        clone of a snapshot). As for a create, the registry update commits it, and a crash
        before it leaves a directory that the next open removes."""
        with self._lock:
            if name in self._superblock["namespaces"] or name in self.failed_namespaces:
                raise DeviceError(Status.NAMESPACE_EXISTS, f"namespace {name!r} already exists")
            if len(self._superblock["namespaces"]) >= MAX_NAMESPACES:
                raise DeviceError(Status.NAMESPACE_ID_UNAVAILABLE, f"at most {MAX_NAMESPACES} namespaces")
            self._check_capacity(needed_bytes, f"namespace {name!r}")
            nsid = int(self._superblock["next_nsid"])
            directory = self._ns_dir(name)
            if directory.exists():
                shutil.rmtree(directory)
            namespace = build(directory, nsid)
            updated = dict(self._superblock)
            updated["namespaces"] = dict(self._superblock["namespaces"]) | {name: nsid}
            updated["next_nsid"] = nsid + 1
            try:
                self._store(updated, clean=False)
            except BaseException:
                namespace.close()
                shutil.rmtree(directory, ignore_errors=True)
                raise
            self._attach(namespace)
            self.namespaces[name] = namespace
            return namespace

    # ------------------------------------------------------------------ health

    def _store(self, updated: dict[str, Any], *, clean: bool) -> None:
        """Write superblock.json (caller holds the lock) with the health figures as of now."""
        live = [ns.counters for ns in self.namespaces.values()]
        updated["health"] = self.health.record(live, clean=clean)
        atomic_write_json(self.path / SUPERBLOCK_FILE, updated)
        self._superblock = updated

    def save_health(self) -> None:
        """Persist the health figures (the daemon does so periodically, and close does)."""
        with self._lock:
            if self._backing.held:
                self._store(dict(self._superblock), clean=False)

    @property
    def saved_features(self) -> dict[str, Any]:
        """Feature values saved by Set Features with SV, by feature (emulator/features.py)."""
        return dict(self._superblock.get("features", {}))

    def save_features(self, saved: dict[str, Any]) -> None:
        """Durably replace the saved feature values in superblock.json (they survive remounts)."""
        with self._lock:
            self._store(dict(self._superblock) | {"features": saved}, clean=False)

    def smart(self) -> dict[str, int]:
        """SMART / Health Information figures (see emulator/health.py for each definition)."""
        namespaces = list(self.namespaces.values())
        degraded = bool(self.failed_namespaces) or any(ns.media_failure for ns in namespaces)
        return self.health.smart([ns.counters for ns in namespaces], self.capacity_bytes, degraded)

    def statistics(self) -> dict[str, Any]:
        return {
            "namespaces": {name: ns.statistics() for name, ns in self.namespaces.items()},
            "uptime_s": time.time() - self.opened_at,
        }
