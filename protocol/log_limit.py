"""A bounded share of the log for lines whose number peers decide (refusals, failed accepts, broken scrapes): the caller counts every event, the log gets at most so many lines a window, and the next line logged says how many were left out."""
from __future__ import annotations

import logging
import threading
import time


class LogLimiter:
    """At most `per_window` warning lines every `window_s` seconds on `logger`. A window
    opens at the first line after the last one ended, so one line a window is "at most once
    every `window_s`" measured from the line before."""

    def __init__(self, logger: logging.Logger, *, per_window: int = 1, window_s: float = 1.0) -> None:
        self.logger, self.per_window, self.window_s = logger, per_window, window_s
        self._lock = threading.Lock()
        self._began = -window_s  # the first line opens a window at once
        self._logged = 0  # lines logged in the open window
        self._left_out = 0  # lines not logged since the last one that was

    def warning(self, line: str) -> bool:
        """Log `line` unless the open window's lines are used up; whether it was logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._began >= self.window_s:
                self._began, self._logged = now, 0
            if self._logged >= self.per_window:
                self._left_out += 1
                return False
            self._logged += 1
            left_out, self._left_out = self._left_out, 0
        more = (f" ({left_out} more such lines not logged: at most {self.per_window} every {self.window_s:g} s)"
                if left_out else "")
        self.logger.warning("%s%s", line, more)
        return True
