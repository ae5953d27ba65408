"""The daemon log's line for a write the device refused, which the writer sees only as an errno."""
from __future__ import annotations

import errno
import logging
import os

from ..protocol.log_limit import LogLimiter
from ..protocol.status import DeviceError

log = logging.getLogger(__name__)

# At most one line per this many seconds: a trainer that writes wrong-sized gradients does so
# every step, for every tensor.
INTERVAL_S = 10.0


class RefusedWriteLog:
    """Logs why a write got its errno (EFBIG past a file's end, EINVAL for values no step can
    start from or a cut element, EROFS, ...): the device's own reason, naming the file and the
    write, and for a grad file past its end the likely cause. Rate-limited; the lines left out
    are counted in the next one."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self._limiter = LogLimiter(log, window_s=interval_s)

    def note(self, exc: DeviceError, what: str = "write") -> None:
        """`exc` refused request `what` (a FUSE operation's name): logged where it is a write."""
        if what != "write":
            return
        self.note_errno(exc.errno or errno.EIO, exc.message)

    def note_errno(self, code: int, reason: str) -> None:
        """A refused write known by its errno and the device's reason (a remote mount's client
        hands it the server's refusal as an OSError). EFBIG is the refusal of a write past a
        file's end: LBA_OUT_OF_RANGE is the one status that maps to it (protocol/status.py)."""
        hint = ("; a gradient in another dtype than the namespace's grad_dtype (FP32 into an "
                "FP16/BF16 grad file is twice its size)") if code == errno.EFBIG and "/grad:" in reason else ""
        self._limiter.warning(f"write refused with {errno.errorcode.get(code, code)} ({os.strerror(code)}): "
                              f"{reason}{hint}")
