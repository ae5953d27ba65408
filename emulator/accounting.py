"""Accounting of modeled time, per namespace and for a storage server's network link, and timed mode's waits.

Each file operation or step command of a namespace is one modeled command. The namespace
marks its methods with `modeled_command`; while one runs, whatever it moves (host bytes,
media bytes, elements, flushes) is added to that command on the same thread, and when it
returns the command's modeled time is computed once (model/timing.py) and summed. In
timed mode the command then returns no earlier than its modeled time after it started.

`LinkTiming` does the same for a storage server's network link (model/links.py): the
front-end opens one command per request it serves, adds the bytes it moved each way, and in
timed mode the completion is held until the modeled wire time after the request arrived.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, TypeVar

from ..model.links import DEFAULT_LINK, LinkModel, WireTiming
from ..model.profiles import DEFAULT_PROFILE
from ..model.timing import TRAFFIC_FIELDS, Timing, TimingModel, Traffic

F = TypeVar("F", bound=Callable[..., Any])

# Work that no host command carries (none today outside a command, kept for safety).
INTERNAL = "internal"
TRAFFIC_INDEX = {field: index for index, field in enumerate(TRAFFIC_FIELDS)}
_TIMING_CACHE_ENTRIES = 4096


def modeled_command(name: str) -> Callable[[F], F]:
    """Account a Namespace method as one modeled command named `name` (self.timing)."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.timing.command(name):
                return method(self, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class NamespaceTiming:
    """Totals of one namespace since it was opened: traffic, modeled time by resource and by
    command, and timed mode's waits. Thread-safe: commands on different threads account
    separately (thread-local), and the lock guards only a few additions at a time."""

    def __init__(self, model: TimingModel | None = None, *, timed: bool = False) -> None:
        self.model = model or TimingModel.named(DEFAULT_PROFILE)
        self.timed = timed
        self._lock = threading.Lock()
        self._local = threading.local()
        self._totals = [0] * len(TRAFFIC_FIELDS)  # Traffic's fields, in order
        self.commands = 0
        self.device_ns = 0
        self.busy_ns = {"host_in": 0, "host_out": 0, "media": 0, "compute": 0, "fixed": 0}
        self.by_command: dict[str, dict[str, int]] = {}
        self.timed_commands = 0
        self.timed_waits = 0
        self.timed_wait_ns = 0
        self.timed_late = 0
        self.timed_block_wait_ns = 0
        self._timings: dict[tuple[tuple[int, ...], bool], Timing] = {}

    # ------------------------------------------------------------------ accounting

    def command(self, name: str, *, host_command: bool = True) -> "_Command":
        """One modeled command (a context manager); a command inside another (same thread)
        joins the outer one. host_command=False: work the device does on its own behind an
        acknowledged command (a gradient block's update); timed mode holds that work, not a
        host completion."""
        return _Command(self, name, host_command)

    def add(self, **amounts: int) -> None:
        """Add traffic (Traffic's fields as keywords) to this thread's open command, or
        account it as internal work when no command is open."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            traffic = Traffic(**amounts)
            if traffic:
                self._record(INTERNAL, traffic, host_command=False)
            return
        for field, amount in amounts.items():
            pending[TRAFFIC_INDEX[field]] += int(amount)

    def _record(self, name: str, traffic: Traffic | list[int], *, host_command: bool) -> Timing:
        amounts = tuple(traffic) if isinstance(traffic, list) else tuple(
            getattr(traffic, field) for field in TRAFFIC_FIELDS)
        # The I/O path repeats a few shapes (1 MiB requests, whole blocks): their modeled
        # times are remembered rather than computed again for every command.
        key = (amounts, host_command)
        timing = self._timings.get(key)
        if timing is None:
            timing = self.model.command(Traffic(*amounts), host_command=host_command)
            if len(self._timings) >= _TIMING_CACHE_ENTRIES:
                self._timings.clear()
            self._timings[key] = timing
        with self._lock:
            for index, amount in enumerate(amounts):
                self._totals[index] += amount
            self.commands += host_command
            self.device_ns += timing.device_ns
            busy = self.busy_ns
            busy["host_in"] += timing.host_in_ns
            busy["host_out"] += timing.host_out_ns
            busy["media"] += timing.media_ns
            busy["compute"] += timing.compute_ns
            busy["fixed"] += timing.fixed_ns
            entry = self.by_command.get(name)
            if entry is None:
                entry = self.by_command[name] = {"commands": 0, "device_ns": 0}
            entry["commands"] += 1
            entry["device_ns"] += timing.device_ns
        return timing

    def _settle(self, started_ns: int, modeled_ns: int, host_command: bool = True) -> None:
        """Timed mode: hold the completion until `modeled_ns` after the command started.
        The timed_* figures count host completions; the device's own work (gradient block
        updates) is held the same way but counted in timed_block_wait_ns."""
        remaining = started_ns + modeled_ns - time.monotonic_ns()
        if remaining > 0:
            time.sleep(remaining / 1e9)
        if not host_command:
            with self._lock:
                self.timed_block_wait_ns += max(0, remaining)
            return
        with self._lock:
            self.timed_commands += 1
            if remaining > 0:
                self.timed_waits += 1
                self.timed_wait_ns += remaining
            else:
                self.timed_late += 1  # the emulator itself took longer than the model

    # ------------------------------------------------------------------ reporting

    def snapshot(self) -> dict[str, Any]:
        """The "model" part of the namespace statistics (vendor log page C0h, stats.json).
        The lock is only ever held for a few additions, never across I/O."""
        with self._lock:
            traffic = Traffic(*self._totals)
            return {
                "profile": self.model.profile.name,
                "timed": self.timed,
                "commands": self.commands,
                "device_ns": self.device_ns,
                "host_link_bytes": traffic.host_link,
                "host_in_bytes": traffic.host_in,
                "host_out_bytes": traffic.host_out,
                "media_read_bytes": traffic.media_read,
                "media_write_bytes": traffic.media_write,
                "elements_updated": traffic.elements,
                "flushes": traffic.flushes,
                "busy_ns": dict(self.busy_ns),
                "by_command": {name: dict(entry) for name, entry in self.by_command.items()},
                "timed_commands": self.timed_commands,
                "timed_waits": self.timed_waits,
                "timed_wait_ns": self.timed_wait_ns,
                "timed_late": self.timed_late,
                "timed_block_wait_ns": self.timed_block_wait_ns,
            }


class _Command:
    """NamespaceTiming.command's context manager: a plain class, because the file path
    opens one per request and a generator-based one measured several times slower."""

    __slots__ = ("_timing", "_name", "_host_command", "_started", "_outer")

    def __init__(self, timing: NamespaceTiming, name: str, host_command: bool) -> None:
        self._timing = timing
        self._name = name
        self._host_command = host_command
        self._started = 0
        self._outer = False

    def __enter__(self) -> None:
        local = self._timing._local
        if getattr(local, "pending", None) is not None:
            self._outer = True  # inside another command on this thread: joins it
            return
        self._started = time.monotonic_ns()
        # A plain list of Traffic's fields: cheap to add to on the I/O path.
        local.pending = [0] * len(TRAFFIC_FIELDS)

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if self._outer:
            return
        timing = self._timing
        pending = timing._local.pending
        timing._local.pending = None
        succeeded = exc_type is None
        # A refused command moved nothing and is not counted; one that failed midway
        # still moved what it moved.
        if succeeded or any(pending):
            modeled = timing._record(self._name, pending, host_command=self._host_command)
            if succeeded and timing.timed:
                timing._settle(self._started, modeled.device_ns, self._host_command)


# ---------------------------------------------------------------------- the server's network link

_LINK_FIELDS = ("net_in", "net_out", "messages_in", "messages_out")
_LINK_INDEX = {field: index for index, field in enumerate(_LINK_FIELDS)}


class LinkTiming:
    """Totals of a storage server's network link since it started: wire bytes each way,
    messages, modeled wire time per direction and by command, and timed mode's holds.

    One server NIC is shared by every connection: in timed mode each direction's transfers
    queue behind each other (in the order their commands finish), so eight trainers at once
    share the link's bandwidth instead of each getting all of it. Latency does not occupy
    the link. The device's own time inside a command is held by its namespace as before:
    the wire and the device overlap (the NIC streams into the device as data arrives), so a
    command takes at least the longer of its wire time and its device time."""

    def __init__(self, model: LinkModel | None = None, *, timed: bool = False) -> None:
        self.model = model or LinkModel.named(DEFAULT_LINK)
        self.timed = timed
        self._lock = threading.Lock()
        self._local = threading.local()
        self._totals = [0] * len(_LINK_FIELDS)
        self.commands = 0
        self.wire_ns = 0
        self.busy_ns = {"in": 0, "out": 0}
        self.by_command: dict[str, dict[str, int]] = {}
        # Timed mode: when each direction of the server's NIC is free again (monotonic ns).
        self._free_ns = {"in": 0, "out": 0}
        self.timed_commands = 0
        self.timed_waits = 0
        self.timed_wait_ns = 0
        self.timed_late = 0

    def command(self, name: str) -> "_LinkCommand":
        """One request served (a context manager), entered once its capsule has arrived; a
        command inside another on the same thread joins the outer one."""
        return _LinkCommand(self, name)

    def add(self, **amounts: int) -> None:
        """Add net_in / net_out payload bytes and messages_in / messages_out (each PDU) to
        this thread's open command. Outside a command this is a caller's bug: refused."""
        pending = getattr(self._local, "pending", None)
        if pending is None:
            raise RuntimeError("LinkTiming.add outside a command")
        for field, amount in amounts.items():
            if type(amount) is not int or amount < 0:
                raise ValueError(f"{field} must be an integer >= 0, got {amount!r}")
            pending[_LINK_INDEX[field]] += amount

    def _record(self, name: str, pending: list[int]) -> WireTiming:
        net_in, net_out, messages_in, messages_out = pending
        timing = self.model.command(net_in, net_out, messages_in=messages_in, messages_out=messages_out)
        with self._lock:
            for index, amount in enumerate(pending):
                self._totals[index] += amount
            self.commands += 1
            self.wire_ns += timing.wire_ns
            self.busy_ns["in"] += timing.in_ns
            self.busy_ns["out"] += timing.out_ns
            entry = self.by_command.setdefault(name, {"commands": 0, "wire_ns": 0})
            entry["commands"] += 1
            entry["wire_ns"] += timing.wire_ns
        return timing

    def completion_ns(self, started_ns: int, timing: WireTiming) -> int:
        """When the completion may go (monotonic ns): the request's transfer queues behind
        what occupies the inbound link, the response's behind the outbound; each direction
        then pays the rest of its time (latency, per-message work)."""
        with self._lock:
            free = self._free_ns
            in_start = max(started_ns, free["in"])
            free["in"] = in_start + timing.in_transfer_ns
            in_done = in_start + timing.in_ns
            out_start = max(in_done, free["out"])  # the response leaves once the request is in
            free["out"] = out_start + timing.out_transfer_ns
            return out_start + timing.out_ns

    def _settle(self, started_ns: int, timing: WireTiming) -> None:
        remaining = self.completion_ns(started_ns, timing) - time.monotonic_ns()
        if remaining > 0:
            time.sleep(remaining / 1e9)
        with self._lock:
            self.timed_commands += 1
            if remaining > 0:
                self.timed_waits += 1
                self.timed_wait_ns += remaining
            else:
                self.timed_late += 1

    def snapshot(self) -> dict[str, Any]:
        """The link's part of the server's statistics."""
        with self._lock:
            net_in, net_out, messages_in, messages_out = self._totals
            return {
                "link": self.model.link.name,
                "timed": self.timed,
                "commands": self.commands,
                "wire_ns": self.wire_ns,
                "net_in_bytes": net_in,
                "net_out_bytes": net_out,
                "messages_in": messages_in,
                "messages_out": messages_out,
                "busy_ns": dict(self.busy_ns),
                "by_command": {name: dict(entry) for name, entry in self.by_command.items()},
                "timed_commands": self.timed_commands,
                "timed_waits": self.timed_waits,
                "timed_wait_ns": self.timed_wait_ns,
                "timed_late": self.timed_late,
            }


class _LinkCommand:
    """LinkTiming.command's context manager."""

    __slots__ = ("_timing", "_name", "_started", "_outer")

    def __init__(self, timing: LinkTiming, name: str) -> None:
        self._timing = timing
        self._name = name
        self._started = 0
        self._outer = False

    def __enter__(self) -> "_LinkCommand":
        local = self._timing._local
        if getattr(local, "pending", None) is not None:
            self._outer = True
            return self
        self._started = time.monotonic_ns()
        local.pending = [0] * len(_LINK_FIELDS)
        return self

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        if self._outer:
            return
        timing = self._timing
        pending = timing._local.pending
        timing._local.pending = None
        # A connection that failed midway (the peer went) sends no completion: what it
        # moved is counted, nothing is held.
        if exc_type is None or any(pending):
            modeled = timing._record(self._name, pending)
            if exc_type is None and timing.timed:
                timing._settle(self._started, modeled)
