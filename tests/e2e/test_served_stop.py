"""ServedDevice.stop() on a server stopped with SIGSTOP: it still ends cleanly (its own exit, its counters logged), not killed after the stop's timeout."""
from __future__ import annotations

import os
import signal
from pathlib import Path

from cossd.emulator import Device
from served import ServedDevice, write_token


def test_stop_ends_a_stopped_server_cleanly(tmp_path: Path) -> None:
    Device.format(tmp_path / "backing", serial="SERVEDSTOP0001")
    served = ServedDevice(tmp_path / "backing", write_token(tmp_path / "token"))
    try:
        os.kill(served.pid, signal.SIGSTOP)
        # A SIGTERM alone stays pending on a stopped process: the old stop() waited out its
        # timeout, then SIGKILLed it, and the server never logged its counters.
        stopped = served.stop(timeout_s=20)
        assert "connections" in stopped, stopped  # the server's own "stopped: {...}" line
        assert not Path(f"/proc/{served.pid}").exists()
    finally:
        if Path(f"/proc/{served.pid}").exists():
            os.kill(served.pid, signal.SIGKILL)
