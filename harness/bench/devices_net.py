"""`cossd bench --sections devices --devices-link netns`: the devices section with each device its own `cossd serve` inside its own network namespace, reached over a veth pair from the trainer in the root namespace, and the bytes on each link as the veth and the server counted them."""
from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from ...client import AdminClient
from ...emulator import Device
from ...protocol.logpages import LogId, decode_server_log
from ...server.command import READY_PREFIX
from .. import netns
from ..measure import say
from ..served import write_token
from .devices import DEVICE_COUNTS, gpt_shapes, run_job
from .interrupt import held, signals_end_the_run

# Names carry this process's pid, so two runs never collide and a killed run's leftovers are
# known by a pid that is gone. The host end of each veth lives in the root namespace, so its
# name must be unique there (15 characters at most: "cdn" + 7 digits + "x" + the index).
NS_PREFIX = "cossdn"
HOST_IF_PREFIX = "cdn"
_NS_NAME = re.compile(rf"^{NS_PREFIX}(\d+)x(\d+)$")
DEVICE_IF = "eth0"  # the device's end, inside its namespace: one per namespace, no clash
PORT = 4420
READY_TIMEOUT_S = 60.0
MAX_DEVICES = 4  # each run's /30s come from one /24: 4 devices a run, 60 runs' worth of /24s


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def _subnet_base() -> int:
    """The third octet's base of this run's /30s (10.79.X.0/30 ...): from the pid, so that
    parallel runs on one machine route to their own devices."""
    return (os.getpid() % 60) * MAX_DEVICES


def clean_leftovers() -> list[str]:
    """Delete the namespaces (and the host ends of their veths) of runs whose process is gone
    (a kill -9 of a bench), killing what still runs inside them; returns their names."""
    removed = []
    for name in netns.namespaces():
        match = _NS_NAME.match(name)
        if match is None or Path(f"/proc/{match.group(1)}").exists():
            continue
        DeviceNamespace(name, f"{HOST_IF_PREFIX}{match.group(1)}x{match.group(2)}", "", "").destroy()
        removed.append(name)
    return removed


class DeviceNamespace:
    """One device's network namespace: a veth pair from the root namespace (host end
    `host_if` at `host_address`/30) to the namespace (DEVICE_IF at `address`/30), optionally
    a tbf rate on both ends, and the `cossd serve` process serving the device inside it."""

    def __init__(self, name: str, host_if: str, host_address: str, address: str) -> None:
        self.name, self.host_if, self.host_address, self.address = name, host_if, host_address, address
        self.server: subprocess.Popen[bytes] | None = None
        self.url = ""

    @classmethod
    def create(cls, index: int, link_mbit: float | None) -> "DeviceNamespace":
        if not 0 <= index < MAX_DEVICES:
            raise ValueError(f"device index {index}: this bench serves at most {MAX_DEVICES} devices")
        octet = _subnet_base() + index
        made = cls(f"{NS_PREFIX}{os.getpid()}x{index}", f"{HOST_IF_PREFIX}{os.getpid()}x{index}",
                   f"10.79.{octet}.1", f"10.79.{octet}.2")
        try:
            _ip("netns", "add", made.name)
            _ip("link", "add", made.host_if, "type", "veth", "peer", "name", DEVICE_IF, "netns", made.name)
            _ip("addr", "add", f"{made.host_address}/30", "dev", made.host_if)
            _ip("link", "set", made.host_if, "up")
            _ip("-n", made.name, "addr", "add", f"{made.address}/30", "dev", DEVICE_IF)
            _ip("-n", made.name, "link", "set", "lo", "up")
            _ip("-n", made.name, "link", "set", DEVICE_IF, "up")
            if link_mbit is not None:
                made.rate_limit(link_mbit)
        except BaseException:
            made.destroy()
            raise
        return made

    def rate_limit(self, mbit: float) -> None:
        """A token bucket (tc tbf) on each end: each direction of the link at `mbit` Mbit/s
        (netem is not available; tbf paces, it adds no fixed delay)."""
        rate = f"{int(mbit * 1000)}kbit"
        burst = str(max(64 << 10, int(mbit * 1e6 / 8) // 100))  # veth hands tbf whole GSO packets
        for prefix, device in (([], self.host_if), (["-n", self.name], DEVICE_IF)):
            subprocess.run(["tc", *prefix, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", "100ms"], check=True, capture_output=True, text=True,
                           timeout=15)

    def serve(self, backing: Path, token_file: Path) -> str:
        """Start `cossd serve --foreground` on `backing` inside the namespace, on its address
        (plain TCP with a token: --insecure, as the link is the bench's own); its URL."""
        log = open(backing.parent / "server.stderr", "ab")
        read_fd, write_fd = os.pipe()
        try:
            self.server = subprocess.Popen(
                ["ip", "netns", "exec", self.name, sys.executable, "-m", "cossd.server.command", str(backing),
                 "--foreground", "--ready-fd", str(write_fd), "--listen", f"{self.address}:{PORT}", "--insecure",
                 "--token-file", str(token_file)],
                pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        finally:
            os.close(write_fd)
            log.close()
        line = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                if select.select([read_fd], [], [], 0.5)[0]:
                    chunk = os.read(read_fd, 256)
                    if not chunk:
                        break
                    line += chunk
        finally:
            os.close(read_fd)
        if not line.startswith(READY_PREFIX):
            tail = (backing.parent / "server.stderr").read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"cossd serve in namespace {self.name} did not start: {' | '.join(tail)}")
        self.url = line[len(READY_PREFIX):].decode().strip()
        return self.url

    def veth_bytes(self) -> dict[str, int]:
        """The host end's counters: what it sent is what went to the device, what it received
        what came back."""
        statistics_dir = Path("/sys/class/net") / self.host_if / "statistics"
        return {"to_device": int((statistics_dir / "tx_bytes").read_text()),
                "from_device": int((statistics_dir / "rx_bytes").read_text())}

    def destroy(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL), kill whatever else runs inside, delete the
        namespace and the host end of the veth. Safe to call twice and after a partial create."""
        if self.server is not None and self.server.poll() is None:
            self.server.terminate()
            # A stopped server (SIGSTOP, a debugger) gets its SIGTERM only once continued.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.server.pid, signal.SIGCONT)
            try:
                self.server.wait(20)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(10)
        if self.name in netns.namespaces():
            netns.Netns(self.name, DEVICE_IF, self.address)._kill_inside()
            _ip("netns", "del", self.name, check=False)
        if Path("/sys/class/net", self.host_if).exists():  # gone with the namespace, unless it was never moved
            _ip("link", "del", self.host_if, check=False)


@contextlib.contextmanager
def served_devices(workdir: Path, count: int, link_mbit: float | None) -> Iterator[list[DeviceNamespace]]:
    """`count` fresh devices, each served in its own namespace, torn down on every exit."""
    token_file = write_token(workdir / "token")
    spaces: list[DeviceNamespace] = []
    try:
        for index in range(count):
            directory = workdir / f"net-{count}-{index}"
            directory.mkdir(parents=True)
            Device.format(directory / "backing", serial=f"BENCHNET{count}{index:04d}")
            # A signal between the namespace's making and its place in `spaces` would leave it
            # behind: it waits until both are done (create() undoes a partial making itself).
            with held():
                space = DeviceNamespace.create(index, link_mbit)
                spaces.append(space)
            space.serve(directory / "backing", token_file)
        yield spaces
    finally:
        for space in reversed(spaces):
            space.destroy()


def _counters(space: DeviceNamespace, admin: AdminClient) -> Any:
    def read() -> dict[str, int]:
        page = decode_server_log(admin.get_log_page(LogId.SERVER))
        veth = space.veth_bytes()  # after the page: the page's own bytes fall outside the window
        return {"veth_to_device": veth["to_device"], "veth_from_device": veth["from_device"],
                "server_bytes_in": page["link_bytes_in"], "server_bytes_out": page["link_bytes_out"]}
    return read


def devices_net_costs(workdir: Path, width: int, layers: int, steps: int,
                      link_mbit: float | None = None) -> dict[str, Any]:
    """For 1, 2 and 4 devices, each a `cossd serve` in a network namespace of its own, one
    job of `steps` timed steps after 2 of warm-up, the trainer in the root namespace. Not
    root, or no network namespaces: {"unavailable": why}, said, nothing measured."""
    section: dict[str, Any] = {"link": "netns", "width": width, "layers": layers, "steps": steps,
                               "link_mbit": link_mbit}
    reason = netns.unavailable()
    if reason is not None:
        say(f"  devices over network namespaces: not measured: {reason}")
        return section | {"unavailable": reason}
    shapes = gpt_shapes(width, layers)
    section["embedding_elements"] = shapes[0][1][0] * shapes[0][1][1]
    # The run's handler (interrupt.py) where the runner opened one, else one for the section.
    with signals_end_the_run() as ended:
        try:
            rows = _measure(workdir, shapes, steps, link_mbit)
        except BaseException:
            # Whatever the interrupt became on its way up (code between may wrap it), the run
            # says why it ended; the teardown (served_devices) has run by now.
            if ended:
                say(f"  devices over network namespaces: ended by {ended[0]}; its namespaces, veths and servers "
                    "are removed")
            raise
    return section | {"rows": rows}


def _measure(workdir: Path, shapes: list[tuple[str, tuple[int, ...]]], steps: int,
             link_mbit: float | None) -> list[dict[str, Any]]:
    """The section's rows: one job at each of DEVICE_COUNTS, its devices served afresh."""
    rows = []
    clean_leftovers()
    for count in DEVICE_COUNTS:
        with served_devices(workdir, count, link_mbit) as spaces:
            admins = [AdminClient(space.url, token_file=workdir / "token") for space in spaces]
            try:
                job = run_job([space.url for space in spaces], shapes, 2, steps,
                              counters=[_counters(space, admin) for space, admin in zip(spaces, admins)],
                              token_file=str(workdir / "token"))
            finally:
                for admin in admins:
                    admin.close()
        if any(device["steps_committed"] != steps for device in job["devices"]):
            raise RuntimeError(f"{count} devices: not every device committed the {steps} timed steps")
        step = statistics.median(job["step_s"])
        # A device's share of the step: its mean seconds over the mean step (the median
        # step is what the table shows, but shares of it could add past 100%).
        mean_step = statistics.fmean(job["step_s"])
        for device in job["devices"]:
            device["share_of_step"] = device["seconds_per_step"] / mean_step
        rows.append({"devices": count, "elements": job["elements"], "step_seconds": step,
                     "per_device": job["devices"], "addresses": [space.address for space in spaces]})
        shares = "; ".join(
            f"{d['elements'] / job['elements']:.0%} of the elements, {d['share_of_step']:.0%} of the "
            f"step, veth {d['link']['veth_to_device'] / 1e6:.1f} MB to + {d['link']['veth_from_device'] / 1e6:.1f} "
            f"MB from" for d in job["devices"])
        say(f"  devices {count} over network namespaces: step {step * 1e3:.1f} ms; per device: {shares}")
    return rows


def markdown_rows(section: dict[str, Any]) -> list[str]:
    if "unavailable" in section:
        return ["", f"Several devices over network namespaces: not measured: {section['unavailable']}."]
    rows = section["rows"]
    total = rows[0]["elements"]
    rate = f"a tbf rate of {section['link_mbit']:g} Mbit/s each way" if section["link_mbit"] else "no rate limit"
    lines = ["", f"One optimizer over several devices, each a `cossd serve` in its own network namespace reached "
             f"over a veth pair ({rate}) from the trainer in the root namespace, one process: a GPT-shaped model "
             f"of {total:,} BF16 params (width {section['width']}, {section['layers']} layers, an embedding of "
             f"{section['embedding_elements']:,} = {section['embedding_elements'] / total:.0%} of them), "
             f"{section['steps']} timed steps after 2 of warm-up; the step time is the median; a device's share of "
             "the step is its mean time in its begin and gradients, its commit, its flush and its params back over "
             "the mean step (the devices work at once, a thread each, so their shares overlap); bytes a step "
             "on each link as the host's veth end counted them (frames, headers included) and as the server "
             "counted its payload.", "",
             "| devices | step | per device: elements, share of the step, veth to + from the device, server in + out |",
             "|---|---|---|"]
    for row in rows:
        devices = "; ".join(
            f"{d['elements'] / total:.0%}, {d['share_of_step']:.0%}, "
            f"{d['link']['veth_to_device'] / 1e6:.1f} + {d['link']['veth_from_device'] / 1e6:.1f} MB, "
            f"{d['link']['server_bytes_in'] / 1e6:.1f} + {d['link']['server_bytes_out'] / 1e6:.1f} MB"
            for d in row["per_device"])
        lines.append(f"| {row['devices']} | {row['step_seconds'] * 1e3:.1f} ms | {devices} |")
    return lines
