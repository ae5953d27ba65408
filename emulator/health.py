"""Device health: lifetime SMART figures (counted, persisted in superblock.json), the error log."""
from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import Any, Iterable

from ..protocol.status import Status
from ..protocol.logpages import (
    DATA_UNIT_BYTES,
    ERROR_LOG_ENTRIES,
    NOT_APPLICABLE,
    WARN_RELIABILITY,
    WARN_TEMPERATURE,
)
from .lifetime import LifetimeCounters, SmartShare


# Modeled figures; docs/command-set.md states each formula.
AMBIENT_KELVIN = 300
KELVIN_PER_BUSY_THREAD = 10  # each thread kept busy adds 10 K once it has been busy a while
THERMAL_TIME_CONSTANT_S = 60.0
WARNING_TEMP_KELVIN = 343  # identify WCTEMP (70 C)
CRITICAL_TEMP_KELVIN = 358  # identify CCTEMP (85 C)
ENDURANCE_DRIVE_WRITES = 1000  # rated endurance: 1000 x capacity written to the media
AVAILABLE_SPARE_PERCENT = 100  # the emulator has no spare blocks to use up
SPARE_THRESHOLD_PERCENT = 10


@dataclasses.dataclass(frozen=True)
class ErrorEntry:
    """One Error Information entry (LID 01h), in the page's own terms."""

    error_count: int
    status: int  # Status value, (SCT << 8) | SC
    sqid: int = 0
    cmdid: int = NOT_APPLICABLE
    parm_error_location: int = NOT_APPLICABLE
    lba: int = 0
    nsid: int = 0
    opcode: int = 0  # reported as cs (command specific information)

    def fields(self) -> dict[str, int]:
        """The page fields; the status field is the completion's (phase tag 0)."""
        sct, sc = (self.status >> 8) & 0x7, self.status & 0xFF
        dnr = 0 if self.status == Status.SUCCESS else 1
        return {
            "error_count": self.error_count,
            "sqid": self.sqid,
            "cmdid": self.cmdid,
            "status_field": (sc << 1) | (sct << 9) | (dnr << 15),
            "parm_error_location": self.parm_error_location,
            "lba": self.lba,
            "nsid": self.nsid,
            "cs": self.opcode,
        }


class Health:
    """The device's lifetime figures, its thermal model and its error log. Thread-safe.

    Lifetime = the figures stored at the last save ("base") + the counters of every namespace
    now open. A namespace that leaves (deleted, or closed with the device) is folded into the
    base first, so nothing is counted twice or lost.
    """

    def __init__(self, stored: dict[str, Any] | None) -> None:
        stored = stored or {}
        self._lock = threading.Lock()
        self._base = LifetimeCounters.from_json(stored)
        # A device formatted before health was recorded has no flag: count it as clean.
        self.previous_open_was_clean = bool(stored.get("clean", True))
        self._on_since_ns = time.monotonic_ns()
        self._errors: collections.deque[ErrorEntry] = collections.deque(maxlen=ERROR_LOG_ENTRIES)
        # Composite temperature thresholds of Set Features 04h (emulator/features.py): the
        # SMART critical warning's temperature bit compares against these, not WCTEMP.
        self.over_temp_threshold_kelvin = WARNING_TEMP_KELVIN
        self.under_temp_threshold_kelvin = 0
        # Thermal model state: exponentially decayed busy seconds, and when it was last sampled.
        self._heat_s = 0.0
        self._sampled_at_ns = self._on_since_ns
        self._sampled_busy_ns = self._base.busy_ns

    # ------------------------------------------------------------------ power

    def power_on(self) -> None:
        """Count this open: one power cycle, and an unsafe shutdown if the last close was not clean."""
        with self._lock:
            self._base.power_cycles += 1
            if not self.previous_open_was_clean:
                self._base.unsafe_shutdowns += 1

    def fold(self, counters: SmartShare) -> None:
        """A namespace leaves (deleted or closed): keep what it counted in the base."""
        with self._lock:
            self._base = self._base.plus(counters.lifetime_share())

    def record(self, live: Iterable[SmartShare], *, clean: bool) -> dict[str, Any]:
        """The "health" object for superblock.json; banks the power-on time so far."""
        with self._lock:
            now = time.monotonic_ns()
            self._base.power_on_ns += now - self._on_since_ns
            self._on_since_ns = now
        return dataclasses.asdict(self.totals(live)) | {"clean": clean}

    def totals(self, live: Iterable[SmartShare]) -> LifetimeCounters:
        """Lifetime figures now: the base, the open namespaces, power-on time not yet banked."""
        with self._lock:
            total = dataclasses.replace(self._base)
            for counters in live:
                total = total.plus(counters.lifetime_share())
            total.power_on_ns = self._base.power_on_ns + time.monotonic_ns() - self._on_since_ns
            return total

    # ------------------------------------------------------------------ errors

    def log_error(self, status: int, **fields: int) -> ErrorEntry:
        """Add an Error Information entry; its error_count is unique over the device's life."""
        with self._lock:
            self._base.error_log_entries += 1
            entry = ErrorEntry(error_count=self._base.error_log_entries, status=int(status), **fields)
            self._errors.appendleft(entry)
            return entry

    def error_entries(self) -> list[ErrorEntry]:
        """The most recent entries (up to 64), newest first."""
        with self._lock:
            return list(self._errors)

    # ------------------------------------------------------------------ SMART

    def _sample_temperature(self, busy_ns: int) -> int:
        """Advance the thermal model to now (caller holds the lock); returns Kelvin.

        The heat is the device's busy seconds, decayed with a 60 s time constant, so heat/60
        is how many threads were kept busy lately. The time until this sample counts as spent
        at the temperature the sample finds (warning/critical composite temperature time).
        """
        now = time.monotonic_ns()
        elapsed_ns = max(0, now - self._sampled_at_ns)
        decay = math.exp(-elapsed_ns / 1e9 / THERMAL_TIME_CONSTANT_S)
        self._heat_s = self._heat_s * decay + max(0, busy_ns - self._sampled_busy_ns) / 1e9
        self._sampled_at_ns, self._sampled_busy_ns = now, busy_ns
        busy_threads = self._heat_s / THERMAL_TIME_CONSTANT_S
        kelvin = min(0xFFFF, round(AMBIENT_KELVIN + KELVIN_PER_BUSY_THREAD * busy_threads))
        if kelvin >= CRITICAL_TEMP_KELVIN:
            self._base.critical_temp_ns += elapsed_ns
        elif kelvin >= WARNING_TEMP_KELVIN:
            self._base.warning_temp_ns += elapsed_ns
        return kelvin

    def smart(self, live: Iterable[SmartShare], capacity_bytes: int, degraded: bool) -> dict[str, int]:
        """The SMART / Health Information figures, in the page's fields and units."""
        live = list(live)
        with self._lock:
            kelvin = self._sample_temperature(self._base.busy_ns + sum(
                counters.lifetime_share().busy_ns for counters in live))
        total = self.totals(live)
        outside = kelvin >= self.over_temp_threshold_kelvin or kelvin <= self.under_temp_threshold_kelvin
        warning = (WARN_TEMPERATURE if outside else 0) | (WARN_RELIABILITY if degraded else 0)
        endurance = ENDURANCE_DRIVE_WRITES * max(1, capacity_bytes)
        return {
            "critical_warning": warning,
            "temperature": kelvin,
            "avail_spare": AVAILABLE_SPARE_PERCENT,
            "spare_thresh": SPARE_THRESHOLD_PERCENT,
            "percent_used": min(255, 100 * total.media_bytes_written // endurance),
            "endurance_grp_critical_warning_summary": 0,
            "data_units_read": -(-total.host_bytes_read // DATA_UNIT_BYTES),
            "data_units_written": -(-total.host_bytes_written // DATA_UNIT_BYTES),
            "host_read_commands": total.host_read_commands,
            "host_write_commands": total.host_write_commands,
            "controller_busy_time": total.busy_ns // (60 * 10**9),
            "power_cycles": total.power_cycles,
            "power_on_hours": total.power_on_ns // (3600 * 10**9),
            "unsafe_shutdowns": total.unsafe_shutdowns,
            "media_errors": total.media_errors,
            "num_err_log_entries": total.error_log_entries,
            "warning_temp_time": min(0xFFFFFFFF, total.warning_temp_ns // (60 * 10**9)),
            "critical_comp_time": min(0xFFFFFFFF, total.critical_temp_ns // (60 * 10**9)),
        }
