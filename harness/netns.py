"""Two network namespaces joined by a veth pair: the storage server across a real link, for its tests and `cossd bench --sections net`.

    pair = NetnsPair.create()          # or joined_namespaces(), or the tests' `netns_pair` fixture
    pair.popen(pair.a, ["cossd", "serve", ...])         # a process inside namespace a
    pair.b.call(client_function, arg)                   # a Python function, in a thread inside b
    with pair.b.entered(): sock = socket.create_connection((pair.a.address, port))
    pair.rate_limit(pair.a, mbit=200)                   # tc tbf on what a sends
    pair.link_down(); pair.link_up()                    # cut the veth, restore it
    pair.destroy()                                      # always: kills what runs inside, deletes both

Names carry this process's pid (`cossdt<pid>x<n>a`), so parallel runs never collide, and
`clean_leftovers()` deletes only the namespaces of processes that are gone (a killed run).
Network namespaces need root and iproute2; `unavailable()` says why they cannot be used.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

PREFIX = "cossdt"
SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d+)[ab]$")
_counter = itertools.count(1)
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


_unavailable: list[str | None] = []


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can). Checked once."""
    if not _unavailable:
        reason = None
        if os.geteuid() != 0:
            reason = "network namespaces need root"
        elif shutil.which("ip") is None or shutil.which("tc") is None:
            reason = "iproute2 (ip, tc) is not installed"
        else:
            probe = f"{PREFIX}{os.getpid()}x0a"
            made = _ip("netns", "add", probe, check=False)
            if made.returncode != 0:
                reason = f"`ip netns add` failed: {made.stderr.strip()}"
            _ip("netns", "del", probe, check=False)
        _unavailable.append(reason)
    return _unavailable[0]


def namespaces() -> list[str]:
    """The names of every network namespace `ip netns` knows."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Delete the namespaces this helper made in runs whose process is gone (killed before
    teardown), with whatever still runs inside them; returns their names."""
    removed = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            Netns(name, "", "")._kill_inside()
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Netns:
    """One side: a network namespace, its end of the veth, and its address."""

    def __init__(self, name: str, ifname: str, address: str) -> None:
        self.name = name
        self.ifname = ifname
        self.address = address

    def __repr__(self) -> str:
        return f"Netns({self.name}, {self.ifname}, {self.address})"

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: list[str], *, timeout: float = 30.0, check: bool = True,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run a command inside this namespace and wait for it."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(argv), timeout=timeout, check=check, text=True, **kwargs)

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a command inside this namespace (destroy() kills it if it still runs)."""
        return subprocess.Popen(self.command(argv), **kwargs)

    @contextlib.contextmanager
    def entered(self) -> Iterator["Netns"]:
        """The calling thread inside this namespace for the block (sockets it makes there stay
        in it afterwards); the thread's own namespace again after, even on an error."""
        own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
        target = os.open(f"/run/netns/{self.name}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield self
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def call(self, function: Callable[..., T], *args: Any, timeout: float = 60.0, **kwargs: Any) -> T:
        """`function(*args, **kwargs)` on a thread of its own inside this namespace; its result,
        or its exception raised here."""
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                with self.entered():
                    outcome["value"] = function(*args, **kwargs)
            except BaseException as exc:  # handed to the caller
                outcome["error"] = exc

        thread = threading.Thread(target=target, name=f"netns-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"{getattr(function, '__name__', function)} in {self.name} ran past {timeout} s")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(word) for word in out.split() if word.isdigit()]

    def _kill_inside(self) -> None:
        # Only processes inside this namespace, which this helper made: each by its pid.
        for pid in self.pids():
            if pid != os.getpid():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class NetnsPair:
    """Namespaces a and b, a veth pair between them, a at SUBNET.1/24 and b at SUBNET.2/24."""

    def __init__(self, a: Netns, b: Netns) -> None:
        self.a = a
        self.b = b
        self._popens: list[subprocess.Popen[Any]] = []

    @classmethod
    def create(cls) -> "NetnsPair":
        token = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        # The veth ends live only inside the namespaces: fixed short names there, no name in
        # the host's namespace to collide with another run's.
        pair = cls(Netns(token + "a", "veth-a", f"{SUBNET}.1"), Netns(token + "b", "veth-b", f"{SUBNET}.2"))
        try:
            for side in (pair.a, pair.b):
                _ip("netns", "add", side.name)
            _ip("link", "add", pair.a.ifname, "netns", pair.a.name, "type", "veth",
                "peer", "name", pair.b.ifname, "netns", pair.b.name)
            for side in (pair.a, pair.b):
                _ip("-n", side.name, "addr", "add", f"{side.address}/24", "dev", side.ifname)
                _ip("-n", side.name, "link", "set", "lo", "up")
                _ip("-n", side.name, "link", "set", side.ifname, "up")
        except BaseException:
            pair.destroy()
            raise
        return pair

    def side(self, which: Netns | str) -> Netns:
        if isinstance(which, Netns):
            return which
        return {"a": self.a, "b": self.b}[which]

    def peer(self, side: Netns) -> Netns:
        return self.b if side is self.a else self.a

    def popen(self, side: Netns | str, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        process = self.side(side).popen(argv, **kwargs)
        self._popens.append(process)
        return process

    # ------------------------------------------------------------------ shaping and faults

    def rate_limit(self, side: Netns | str, *, mbit: float, burst_bytes: int | None = None,
                   latency_ms: int = 100) -> None:
        """Limit what `side` sends to `mbit` Mbit/s with a token bucket (tc tbf); a second call
        changes the rate. The burst is at least 64 KiB: veth hands tbf whole GSO packets."""
        ns = self.side(side)
        rate_bytes = int(mbit * 1e6 / 8)
        burst = burst_bytes or max(64 << 10, rate_bytes // 100)
        subprocess.run(["tc", "-n", ns.name, "qdisc", "replace", "dev", ns.ifname, "root", "tbf",
                        "rate", f"{int(mbit * 1000)}kbit", "burst", str(burst), "latency", f"{latency_ms}ms"],
                       check=True, capture_output=True, text=True, timeout=10)

    def clear_rate_limit(self, side: Netns | str) -> None:
        ns = self.side(side)
        subprocess.run(["tc", "-n", ns.name, "qdisc", "del", "dev", ns.ifname, "root"],
                       capture_output=True, text=True, timeout=10)

    def qdisc(self, side: Netns | str) -> str:
        ns = self.side(side)
        return subprocess.run(["tc", "-n", ns.name, "qdisc", "show", "dev", ns.ifname],
                              capture_output=True, text=True, timeout=10).stdout

    def link_down(self, side: Netns | str | None = None) -> None:
        """Cut the link: `side`'s end of the veth down (a, by default); the peer loses carrier,
        so nothing crosses either way and connects and receives time out."""
        ns = self.side(side or self.a)
        _ip("-n", ns.name, "link", "set", ns.ifname, "down")

    def link_up(self, side: Netns | str | None = None) -> None:
        ns = self.side(side or self.a)
        _ip("-n", ns.name, "link", "set", ns.ifname, "up")

    # ------------------------------------------------------------------ teardown

    def exists(self) -> bool:
        present = set(namespaces())
        return self.a.name in present or self.b.name in present

    def destroy(self) -> None:
        """Kill what runs inside either namespace, then delete both (their veth ends go with
        them). Safe to call twice and after a partial create."""
        for process in self._popens:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        for process in self._popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        present = set(namespaces())
        for side in (self.a, self.b):
            if side.name in present:
                side._kill_inside()
                _ip("netns", "del", side.name, check=False)
        for side in (self.a, self.b):
            # `ip netns del` unmounts at once; the namespace itself goes with its last process.
            if Path(f"/run/netns/{side.name}").exists():
                _ip("netns", "del", side.name, check=False)


@contextlib.contextmanager
def joined_namespaces() -> Iterator[NetnsPair]:
    """A fresh pair for the block, destroyed after it whatever happens (leftovers of killed
    runs are cleaned first)."""
    clean_leftovers()
    pair = NetnsPair.create()
    try:
        yield pair
    finally:
        pair.destroy()
