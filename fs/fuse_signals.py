"""What both FUSE daemons (the local mount's and the remote mount's) do on SIGTERM, SIGINT or SIGHUP: end pyfuse3's main loop, so the daemon unmounts and closes cleanly."""
from __future__ import annotations

import logging
import signal

import pyfuse3
import trio

log = logging.getLogger(__name__)


async def stop_on_signal() -> None:
    """Wait for the first of the three signals, then end pyfuse3.main() (run it in the nursery
    beside the main loop)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            pyfuse3.terminate()
            return
