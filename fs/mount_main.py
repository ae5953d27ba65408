"""The background mount daemon's entry point (`python -m cossd.fs.mount_main`): the MountOptions start_background passes as JSON, then serve.

Why not `cossd mount --foreground`: the command line imports every verb family (clients,
the wire protocol, the model tools) to build its parser, and a restart pays for each import
before the device can serve a param. This entry imports the daemon alone. `cossd mount
--foreground` stays the way to run the daemon by hand.
"""
from __future__ import annotations

import time

ENTERED = time.monotonic()  # before the imports: the daemon's log says where its start-up went

import gc  # noqa: E402 (after the clock)

# No cyclic collection while the daemon imports: its ~90 young-generation passes over the
# objects every import creates cost a tenth of the import time, and free next to nothing.
# fs/daemon.py enables it again once the mount is ready (gc.freeze first: what start-up made
# lives as long as the daemon).
gc.disable()

import argparse  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from typing import Sequence  # noqa: E402

# Standard library alone, so that the params are being read before numpy and trio import.
from .. import settings  # noqa: E402
from ..emulator import prefetch  # noqa: E402
from .mount_options import MountOptions  # noqa: E402


def _options(text: str) -> MountOptions:
    try:
        return MountOptions.from_json(text)
    except ValueError as exc:  # argparse would say only "invalid value"
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cossd mount", description="the mount daemon (started by `cossd mount`)")
    parser.add_argument("--ready-fd", type=int, help="the pipe to write 'ready' to once the mount serves")
    parser.add_argument("--options", type=_options, required=True,
                        help="the mount's options, as MountOptions.to_json writes them")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options: MountOptions = args.options
    logging.basicConfig(
        level=logging.DEBUG if options.debug else logging.INFO,
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
    )
    # Before anything heavy: the disk reads the committed params while the imports below
    # run (prefetch.py). COSSD_PREFETCH=0 turns it off, for an A/B of what it is worth.
    if settings.PREFETCH.read():
        prefetch.start(options.backing)
    # numpy's OpenBLAS would start a thread per core that spins for work the daemon never
    # gives it (no BLAS call in the device), taking CPU from the start-up and the data path.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    from ..protocol.status import DeviceError

    try:
        # The device opens before trio, pyfuse3 and the fs layer import, so that the
        # background verification checks the params (read ahead meanwhile) beside those
        # imports, on the other core. Not with a metrics port: serve() binds it first, so
        # that a busy port fails the mount before the device has counted a power cycle.
        device, open_seconds = None, None
        if options.metrics_port is None:
            from .device_start import open_device

            opening = time.monotonic()
            device = open_device(options, mark_in_use=False)
            open_seconds = time.monotonic() - opening
        try:
            from . import daemon  # after the logging is set, as the command line does
        except BaseException:
            if device is not None:
                device.close()
            raise
        daemon.serve(options, ready_fd=args.ready_fd, entered=ENTERED, device=device, open_seconds=open_seconds)
    except DeviceError as exc:
        # The line start_background quotes from the log when the mount fails, as the
        # command line words it.
        print(f"cossd mount: {exc.message} [{exc.status.name}]", file=sys.stderr)
        return 1
    except (OSError, RuntimeError, settings.SettingError) as exc:
        print(f"cossd mount: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
