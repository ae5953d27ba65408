"""The daemon log's line for a write refused as past a file's end, which the writer sees only as EFBIG."""
from __future__ import annotations

import logging
import threading
import time

from ..protocol.status import DeviceError, Status

log = logging.getLogger(__name__)

# At most one line per this many seconds: a trainer that writes wrong-sized gradients does so
# every step, for every tensor.
INTERVAL_S = 10.0


class OversizeWriteLog:
    """Logs why a write got "File too large" (LBA_OUT_OF_RANGE): the file, the write and the
    file's size, and for a grad file the likely cause. Rate-limited; the lines left out are
    counted in the next one."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()  # the data path's threads and the event loop both refuse writes
        self._last = -interval_s
        self._left_out = 0

    def note(self, exc: DeviceError) -> None:
        if exc.status != Status.LBA_OUT_OF_RANGE or "write of" not in exc.message:
            return
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval_s:
                self._left_out += 1
                return
            self._last, left_out, self._left_out = now, self._left_out, 0
        hint = ("; a gradient in another dtype than the namespace's grad_dtype (FP32 into an "
                "FP16/BF16 grad file is twice its size)") if "/grad:" in exc.message else ""
        more = f" ({left_out} more such writes since the last line)" if left_out else ""
        log.warning("write refused with EFBIG (File too large): %s%s%s", exc.message, hint, more)
