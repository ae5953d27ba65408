"""The mount daemon: opens the device, serves the FUSE session, unmounts and flushes on exit."""
from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from pathlib import Path

import pyfuse3
import trio

from .. import settings
from ..emulator import Device
from ..emulator.media import libc_function

from .datapath import DEFAULT_THREADS, DataPath, fuse_device_fds
from .device_start import open_device
from .fault_hooks import FaultHooks
from .fuse_limits import raised_max_pages_limit
from .fuse_signals import stop_on_signal
# The daemon's process lifecycle, in a light module of its own (the command line imports it
# alone); named here too, where its callers have always found it.
from .launch import READY_MESSAGE, start_background, stop_background, wait_for_exit  # noqa: F401
from .mount_options import MountOptions
from .operations import Operations

log = logging.getLogger(__name__)

# glibc mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_REQUEST_HEAP_BYTES = 64 << 20


def keep_request_buffers_on_heap() -> None:
    """Serve each 1 MiB request buffer (pyfuse3's bytes of a write) from the heap.

    By default glibc maps a fresh zeroed region for each such allocation and unmaps it when
    freed: measured as a tenth of the daemon's CPU (page faults and page clearing) on the
    gradient path. Where libc has no mallopt (not glibc) this does nothing.
    """
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return
    mallopt(_M_MMAP_THRESHOLD, _REQUEST_HEAP_BYTES)
    mallopt(_M_TRIM_THRESHOLD, 2 * _REQUEST_HEAP_BYTES)


def mount_options(backing: Path, allow_other: bool, debug: bool) -> set[str]:
    # fsname/subtype make `mount` show "cossd on MOUNTPOINT type fuse.cossd".
    options = set(pyfuse3.default_options) | {
        f"fsname=cossd:{backing}",
        "subtype=cossd",
        "default_permissions",
        "nosuid",
        "nodev",
    }
    if allow_other:
        options.add("allow_other")
    if debug:
        options.add("debug")
    return options


def io_threads_from_env() -> int:
    """The data path's threads (fs/datapath.py) where the mount names none: $COSSD_IO_THREADS,
    else one per core and at least 2; 0 leaves every request to pyfuse3 alone."""
    threads = settings.IO_THREADS.read()
    return DEFAULT_THREADS if threads is None else threads


def _log_startup(startup: dict[str, float]) -> None:
    """One line for the daemon's log: where its start-up went, from its entry to ready
    (imports: all but Device.open and the mount); and the cyclic garbage collector back on,
    if the entry held it off for the imports (mount_main.py), with what start-up made frozen
    out of its passes."""
    ready = time.monotonic()
    if not gc.isenabled():
        gc.freeze()
        gc.enable()
    total, mount = ready - startup["entered"], ready - startup["mount_from"]
    log.info("ready %.3f s after the daemon's entry: imports %.3f s, device open %.3f s, mount %.3f s",
             total, total - startup["open_seconds"] - mount, startup["open_seconds"], mount)


async def _serve(operations: Operations, ready_fd: int | None, session_fd: int | None,
                 io_threads: int, request_pages: int, data_paths: list[DataPath],
                 startup: dict[str, float], hooks: FaultHooks) -> None:
    async with trio.open_nursery() as nursery:
        operations.nursery = nursery
        nursery.start_soon(stop_on_signal)
        nursery.start_soon(operations.save_health_periodically)
        # Before pyfuse3.main() first waits on its descriptor, which this swaps.
        data_path = DataPath.attach(operations, session_fd, io_threads, request_pages)
        if data_path is not None:
            data_paths.append(data_path)
            operations.data_path = data_path
        if hooks.hang_before_ready:  # tests only (fs/fault_hooks.py): a daemon hung once mounted
            log.warning("fault injection: hanging before saying ready")
            time.sleep(3600)
        if ready_fd is not None:
            os.write(ready_fd, READY_MESSAGE)
            os.close(ready_fd)
        _log_startup(startup)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def serve(
    options: MountOptions,
    *,
    ready_fd: int | None = None,
    entered: float | None = None,
    device: Device | None = None,
    open_seconds: float | None = None,
) -> None:
    """Serve the device at `options.mountpoint` until unmounted or signalled (foreground).

    `ready_fd`: a pipe to write READY_MESSAGE to once the mount serves (the launcher's).

    `entered`: time.monotonic() when the daemon's process entered its own code (before its
    imports); the log's ready line then says where the start-up went.

    `device`: already opened by `device_start.open_device` (the daemon's entry does so before
    it imports this module; `open_seconds` it took), never with a metrics port; this then
    serves it and closes it at the end. None: this opens it.

    Of the options: `verify` (DeviceConfig.verify): "background" serves params at once after
    a restart and verifies the rest in a thread; "open" verifies every block before the mount
    is ready. `io_threads` (None: COSSD_IO_THREADS, else one per core, at least 2) serve
    tensor reads and writes in front of pyfuse3 (fs/datapath.py); 0 leaves them to pyfuse3.
    `cmb_bytes` sizes the controller memory buffer (emulator/cmb.py; 0: none).
    """
    startup = {"entered": time.monotonic() if entered is None else entered, "open_seconds": open_seconds or 0.0}
    try:  # the knobs first: one set to nonsense (SettingError) fails the mount before it starts
        io_threads = io_threads_from_env() if options.io_threads is None else options.io_threads
        wanted_pages = settings.FUSE_REQUEST_PAGES.read() if io_threads > 0 else 0
        hooks = FaultHooks.from_environment()
    except BaseException:
        if device is not None:
            device.close()
        raise
    backing_path = Path(options.backing).resolve()
    metrics = None
    if device is None:
        # Bound before the device opens: a busy port fails the mount before anything has
        # started (no power cycle counted, nothing mounted).
        if options.metrics_port is not None:
            # Imported only when asked for: prometheus_client is a restart's cost otherwise.
            from .metrics import DEFAULT_METRICS_ADDR, MetricsEndpoint

            metrics = MetricsEndpoint.bind(options.metrics_port, options.metrics_addr or DEFAULT_METRICS_ADDR,
                                           options.metrics_token_file)
        try:
            opening = time.monotonic()
            device = open_device(options)
            startup["open_seconds"] = time.monotonic() - opening
        except BaseException:
            if metrics is not None:
                metrics.close()
            raise
    elif options.metrics_port is not None:
        device.close()
        raise ValueError("a device opened before serve() cannot have a metrics port (it must be bound first)")
    startup["mount_from"] = time.monotonic()
    operations = None
    try:
        keep_request_buffers_on_heap()
        operations = Operations(device, cmb_bytes=options.cmb_bytes)
        operations.fault_hook = hooks.handler_fault()
        if metrics is not None:
            from .metrics import DeviceCollector

            metrics.attach(DeviceCollector(operations))
        # Opened by the entry without the in-use mark: made now, before anything is served,
        # its fsyncs left to a thread (they would wait behind the params being read ahead and
        # the background verification: Device.mark_in_use says why that is safe).
        device.mark_in_use(durable_now=False)
        before = fuse_device_fds()
        # Larger requests only where the data path reads the device (libfuse's buffer holds
        # 1 MiB); the kernel takes the limit once, in the mount call.
        with raised_max_pages_limit(wanted_pages) as limit:
            pyfuse3.init(operations, options.mountpoint, mount_options(backing_path, options.allow_other, options.debug))
        request_pages = min(wanted_pages, limit)
        opened = fuse_device_fds() - before
        session_fd = opened.pop() if len(opened) == 1 else None
        data_paths: list[DataPath] = []
        try:
            trio.run(_serve, operations, ready_fd, session_fd, io_threads, request_pages, data_paths, startup, hooks)
        finally:
            for data_path in data_paths:
                data_path.stop()  # gives pyfuse3 its descriptor back for the unmount
            pyfuse3.close(unmount=True)
    finally:
        if metrics is not None:
            metrics.close()  # before the device closes: a scrape reads the device
        if operations is not None:
            operations.controller.close()
        device.close()
        log.info("device %s closed cleanly", backing_path)
