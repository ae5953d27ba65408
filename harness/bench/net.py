"""`cossd bench`'s net section: the step through a storage server on loopback against a plain TCP socket pair and the local CMB and file steps."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ...emulator import Device

from .interrupt import held
from ..netns import Netns
from ..served import ServedDevice, write_token

# The socket pair's far end: one process, as the server is, answering 'w' (take TOTAL bytes,
# ack one byte) and 'r' (send TOTAL bytes) until 'q'. recv_into one buffer: no copies.
_PEER = r"""
import socket, sys
total = int(sys.argv[1])
listener = socket.create_server((sys.argv[2], 0))
print(listener.getsockname()[1], flush=True)
conn, _ = listener.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buffer = bytearray(total)
view = memoryview(buffer)
while True:
    op = conn.recv(1)
    if op in (b"", b"q"):
        break
    if op == b"w":
        got = 0
        while got < total:
            got += conn.recv_into(view[got:], total - got)
        conn.sendall(b"k")
    else:
        conn.sendall(view)
"""


class BenchServer(ServedDevice):
    """A freshly formatted device served on 127.0.0.1, any free port, with a token of its
    own; stop() sends SIGTERM and returns the link totals it logs."""

    def __init__(self, workdir: Path, extra: tuple[str, ...] = (), host: str = "127.0.0.1") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        backing = workdir / "backing"
        Device.format(backing)
        super().__init__(backing, write_token(workdir / "token"), host=host, extra=extra)


class SocketPair:
    """A plain TCP connection to a peer process: the same bytes, no protocol. On loopback, or
    across the veth: the peer started inside `peer_side` on its address, the connection made
    from inside `client_side` (network namespaces, harness/netns.py)."""

    def __init__(self, total: int, peer_side: Netns | None = None, client_side: Netns | None = None) -> None:
        import contextlib
        import socket

        self.total = total
        host = peer_side.address if peer_side is not None else "127.0.0.1"
        # A child forked by a thread inside a namespace lives in that namespace.
        with peer_side.entered() if peer_side is not None else contextlib.nullcontext():
            self.peer = subprocess.Popen([sys.executable, "-c", _PEER, str(total), host], stdout=subprocess.PIPE,
                                         text=True)
        assert self.peer.stdout is not None
        port = int(self.peer.stdout.readline())
        with client_side.entered() if client_side is not None else contextlib.nullcontext():
            self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray(total)

    def send(self, data: memoryview) -> None:
        self.sock.sendall(b"w")
        self.sock.sendall(data)
        if self.sock.recv(1) != b"k":
            raise RuntimeError("socket pair: the peer went away")

    def receive(self) -> None:
        self.sock.sendall(b"r")
        view, got = memoryview(self.buffer), 0
        while got < self.total:
            count = self.sock.recv_into(view[got:], self.total - got)
            if not count:
                raise RuntimeError("socket pair: the peer went away")
            got += count

    def close(self) -> None:
        try:
            self.sock.sendall(b"q")
        finally:
            self.sock.close()
            self.peer.wait(timeout=30)


def _cache_option() -> bool:
    """Whether this server has a parameter cache (`--param-cache-size`) to measure."""
    import argparse

    from ...server.command import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return any("--param-cache-size" in action.option_strings for action in parser._actions)


class RemoteStep:
    """One step through the server, as the optimizer takes it: BEGIN, the fp16 grads in one
    WRITE, COMMIT, the fp16 params back in one READ; each part timed on its own."""

    def __init__(self, server: BenchServer, n: int) -> None:
        import numpy as np

        from ...client import AdminClient

        self.admin = AdminClient(server.url, token_file=server.token_file)
        self.nsid = self.admin.create_namespace({"name": "bench", "tensors": [["w", n]]})
        transport = self.admin.transport
        self.transport = transport
        self.grad = transport.open_file("ns/bench/tensors/w/grad", True, False)
        self.param = transport.open_file("ns/bench/tensors/w/param", False, False)
        self.grads = (np.random.default_rng(1).standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).data
        self.params = memoryview(bytearray(2 * n))
        self.step_number = 0
        self.write_s = self.read_s = 0.0
        self.raw: tuple[int, int] | None = None  # an NVM namespace and its data file, once asked for

    def __call__(self) -> None:
        self.step_number += 1
        self.admin.begin_step(self.nsid, self.step_number)
        started = time.perf_counter()
        self.transport.write_many([(self.grad, self.grads, 0)])
        self.write_s = time.perf_counter() - started
        self.admin.commit_step(self.nsid)
        started = time.perf_counter()
        self.transport.read_many([(self.param, self.params, 0)])
        self.read_s = time.perf_counter() - started

    def read_only(self) -> None:
        self.transport.read_many([(self.param, self.params, 0)])

    def raw_write(self) -> None:
        """The same bytes in one WRITE to a plain NVM namespace's data: the wire and a copy
        onto the media, no Adam kernel; what the gradient WRITE costs beyond is the device's
        step, which it completes before it answers."""
        if self.raw is None:
            nsid = self.admin.create_namespace({"name": "bench-raw", "kind": "nvm",
                                                "capacity_bytes": -(-len(self.grads) // 4096) * 4096})
            self.raw = (nsid, self.transport.open_file("ns/bench-raw/data", True, False))
        self.transport.write_many([(self.raw[1], self.grads, 0)])

    def close(self) -> None:
        self.admin.close()


def wire_turn(pair: SocketPair, remote: RemoteStep, samples: dict[str, list[float]]) -> None:
    """One turn of the wire's rows: the socket pair both ways, then a step through the server
    (its WRITE and READ timed inside it)."""
    from ..measure import timed

    samples["tcp_write"] += timed(lambda: pair.send(remote.grads), 1, warmup=0)
    samples["tcp_read"] += timed(pair.receive, 1, warmup=0)
    samples["server_step"] += timed(remote, 1, warmup=0)
    samples["server_write"].append(remote.write_s)
    samples["server_read"].append(remote.read_s)


def net_costs(workdir: Path, n: int, repeat: int) -> dict[str, Any]:
    """The net section's rows: bytes through the server against the socket pair, the step
    through the server against the local CMB and O_DIRECT file steps, all in turns."""
    import statistics

    from .device import BenchDevice
    from .mount import cmb_step, file_path_step
    from ..measure import say, timed

    size = 2 * n
    samples: dict[str, list[float]] = {key: [] for key in
                                       ("tcp_write", "tcp_read", "server_write", "server_read", "server_step",
                                        "raw_write", "cmb_step", "file_step")}
    closers: list[Callable[[], object]] = []  # in reverse on the way out, whatever failed
    link: dict[str, Any] | None = None
    try:
        # Each start and its registration for teardown in one held block: a signal between
        # the two would leave the server, mount or peer process running (interrupt.py).
        with held():
            server = BenchServer(workdir / "served")
            closers.append(server.stop)
        with held():
            local = BenchDevice(_fresh(workdir / "local"), n)
            closers.append(local.stop)
        with held():
            pair = SocketPair(size)
            closers.append(pair.close)
        remote = RemoteStep(server, n)
        closers.append(remote.close)
        cmb, cmb_close = cmb_step(local, in_place=False)
        closers.append(cmb_close)
        file_step = file_path_step(local, True)
        for step in (remote, cmb, file_step, remote.raw_write):
            step()  # warm-up
        pair.send(remote.grads)
        pair.receive()
        for _ in range(repeat):
            wire_turn(pair, remote, samples)
            samples["raw_write"] += timed(remote.raw_write, 1, warmup=0)
            samples["cmb_step"] += timed(cmb, 1, warmup=0)
            samples["file_step"] += timed(file_step, 1, warmup=0)
    finally:
        for close in reversed(closers):
            result = close()
            if close == closers[0] and isinstance(result, dict):
                link = result  # the server's own counters, logged as it stopped
    median = statistics.median

    def ratio(ours: str, theirs: str) -> float:  # > 1: ours is faster; turn by turn
        return median(t / o for o, t in zip(samples[ours], samples[theirs]))

    rows: dict[str, Any] = {
        "bytes": size,
        "media": "tmpfs" if str(workdir).startswith("/dev/shm") else "temp dir",
        "gradient_write": {"server_gbs": size / median(samples["server_write"]) / 1e9,
                           "tcp_gbs": size / median(samples["tcp_write"]) / 1e9,
                           "vs_tcp": ratio("server_write", "tcp_write"), "goal": 0.8,
                           # The same WRITE without the step: to an NVM namespace's data.
                           "nvm_gbs": size / median(samples["raw_write"]) / 1e9,
                           "nvm_vs_tcp": ratio("raw_write", "tcp_write")},
        "param_read": {"server_gbs": size / median(samples["server_read"]) / 1e9,
                       "tcp_gbs": size / median(samples["tcp_read"]) / 1e9,
                       "vs_tcp": ratio("server_read", "tcp_read"), "goal": 0.8},
        "step": {"server_seconds": median(samples["server_step"]), "cmb_seconds": median(samples["cmb_step"]),
                 "file_seconds": median(samples["file_step"]),
                 "vs_cmb": ratio("server_step", "cmb_step"), "vs_file": ratio("server_step", "file_step"),
                 "goal": 0.5},
        "server_link": (link or {}).get("link"),
    }
    rows["param_cache"] = _cache_rows(workdir, n, repeat) if _cache_option() else {
        "measured": False, "why": "not measured: no cache (this server has no --param-cache-size)"}
    for name in ("gradient_write", "param_read"):
        row = rows[name]
        say(f"  net, {name.replace('_', ' ')}: server {row['server_gbs']:.2f} GB/s, socket pair {row['tcp_gbs']:.2f} "
            f"GB/s: {row['vs_tcp']:.2f}x turn by turn (goal >= 0.8x)")
    row = rows["gradient_write"]
    say(f"  net, the same WRITE to an NVM namespace (no kernel): {row['nvm_gbs']:.2f} GB/s, "
        f"{row['nvm_vs_tcp']:.2f}x the socket pair")
    step = rows["step"]
    say(f"  net, step: server {step['server_seconds'] * 1e3:.1f} ms = {step['vs_cmb']:.2f}x the local CMB step "
        f"({step['cmb_seconds'] * 1e3:.1f} ms), {step['vs_file']:.2f}x the local file step "
        f"({step['file_seconds'] * 1e3:.1f} ms), turn by turn (goal >= 0.5x)")
    return rows


def veth_costs(workdir: Path, n: int, repeat: int) -> dict[str, Any]:
    """The same wire across a real link: the server in network namespace a, the client in b,
    joined by a veth pair with no rate limit (harness/netns.py); the socket pair likewise.
    Where namespaces cannot be made (not root, no iproute2), says why instead."""
    import statistics

    from .. import netns
    from ..measure import say

    reason = netns.unavailable()
    if reason is not None:
        return {"measured": False, "why": f"not measured: network namespaces unavailable ({reason})"}
    size = 2 * n
    samples: dict[str, list[float]] = {key: [] for key in
                                       ("tcp_write", "tcp_read", "server_write", "server_read", "server_step")}
    with netns.joined_namespaces() as pair:
        # Off loopback the server insists on TLS unless told --insecure: the link is the
        # bench's own, inside two namespaces it made, and a token still guards it.
        closers: list[Callable[[], object]] = []
        try:
            with held():  # started and registered for teardown, not cut apart by a signal
                server = pair.a.call(BenchServer, workdir / "veth", ("--insecure",), pair.a.address)
                closers.append(server.stop)
            with held():
                socket_pair = SocketPair(size, peer_side=pair.a, client_side=pair.b)
                closers.append(socket_pair.close)
            remote = pair.b.call(RemoteStep, server, n)
            closers.append(remote.close)
            remote()  # warm-up
            socket_pair.send(remote.grads)
            socket_pair.receive()
            for _ in range(repeat):
                wire_turn(socket_pair, remote, samples)
        finally:
            for close in reversed(closers):
                close()
    median = statistics.median

    def ratio(ours: str, theirs: str) -> float:
        return median(t / o for o, t in zip(samples[ours], samples[theirs]))

    rows: dict[str, Any] = {"measured": True, "link": f"veth {pair.b.address} -> {pair.a.address}, no rate limit"}
    for name, ours, theirs in (("gradient_write", "server_write", "tcp_write"),
                               ("param_read", "server_read", "tcp_read")):
        rows[name] = {"server_gbs": size / median(samples[ours]) / 1e9, "tcp_gbs": size / median(samples[theirs]) / 1e9,
                      "vs_tcp": ratio(ours, theirs), "goal": 0.8}
        row = rows[name]
        say(f"  net across the veth, {name.replace('_', ' ')}: server {row['server_gbs']:.2f} GB/s, socket pair "
            f"{row['tcp_gbs']:.2f} GB/s: {row['vs_tcp']:.2f}x turn by turn (goal >= 0.8x)")
    rows["step_seconds"] = median(samples["server_step"])
    return rows


def fairness(workdir: Path, n: int, repeat: int) -> dict[str, Any]:
    """Eight trainers at once, each a process on its own namespace, stepping through one server
    for a window (2 s a turn, 10 s at most): the steps each completed and Jain's index of them
    (harness/bench/fairness.py)."""
    from .fairness import measure_fairness
    from ..measure import say

    result = measure_fairness(workdir / "fairness", clients=8, elements=min(n, 1 << 20),
                              duration_s=float(min(10, 2 * repeat)))
    say(f"  net, fairness: 8 clients for {result['duration_s']:.0f} s: {min(result['steps'])}-{max(result['steps'])} "
        f"steps each, Jain's index {result['jain_index']:.4f}")
    return result


def _cache_rows(workdir: Path, n: int, repeat: int) -> dict[str, Any]:
    """Param reads with the server's cache on against off, in turns (two servers)."""
    import statistics

    from ..measure import timed

    servers: list[BenchServer] = []
    steps: list[RemoteStep] = []
    try:
        with held():  # each server in `servers` (for the teardown) as soon as it runs
            servers.append(BenchServer(workdir / "cache-on", ("--param-cache-size", str(64 << 20))))
        with held():
            servers.append(BenchServer(workdir / "cache-off"))
        steps = [RemoteStep(server, n) for server in servers]
        for step in steps:
            step()  # a committed step: its params are what a read returns (and, on, what the cache holds)
            step.read_only()
        on: list[float] = []
        off: list[float] = []
        for _ in range(repeat):
            on += timed(steps[0].read_only, 1, warmup=0)
            off += timed(steps[1].read_only, 1, warmup=0)
    finally:
        for step in steps:
            step.close()
        for server in servers:
            server.stop()
    return {"measured": True, "cache_on_gbs": 2 * n / statistics.median(on) / 1e9,
            "cache_off_gbs": 2 * n / statistics.median(off) / 1e9,
            "on_vs_off": statistics.median(f / o for o, f in zip(on, off))}


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True)
    return directory


def _wire_table(rows: dict[str, Any]) -> list[str]:
    """The gradient WRITE and param READ against the socket pair, one table (loopback or veth)."""
    lines = ["| transfer | through the server | plain TCP socket pair | server / socket pair (goal >= 0.8x) |",
             "|---|---|---|---|"]
    for name, what in (("gradient_write", "gradient write (one WRITE)"), ("param_read", "param read (one READ)")):
        row = rows[name]
        lines.append(f"| {what} | {row['server_gbs']:.2f} GB/s | {row['tcp_gbs']:.2f} GB/s | {row['vs_tcp']:.2f}x |")
    return lines


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """The net section's tables for bench.md: the wire, the step, the cache, the I/O paths."""
    net = report["net"]
    lines = ["", f"Through a storage server on loopback (backing on {net['media']}; {net['elements']:,} FP16 elements, "
             f"{net['bytes'] / 1e6:.1f} MB each way): medians of {net['turns']} turns; the ratios are medians of "
             "turn-by-turn ratios (> 1: the server is faster).", "", *_wire_table(net)]
    row = net["gradient_write"]
    lines.append(f"| the same bytes in one WRITE to an NVM namespace (no Adam step) | {row['nvm_gbs']:.2f} GB/s "
                 f"| {row['tcp_gbs']:.2f} GB/s | {row['nvm_vs_tcp']:.2f}x |")
    step = net["step"]
    lines += ["", "| one step (BEGIN, grads in, COMMIT, params out) | ms | server / it (goal >= 0.5x) |",
              "|---|---|---|",
              f"| through the server (cossd://) | {step['server_seconds'] * 1e3:.1f} | |",
              f"| local CMB step (client copies in and out) | {step['cmb_seconds'] * 1e3:.1f} | {step['vs_cmb']:.2f}x |",
              f"| local O_DIRECT file step | {step['file_seconds'] * 1e3:.1f} | {step['vs_file']:.2f}x |"]
    veth = net.get("veth")
    if veth is not None and veth.get("measured"):
        lines += ["", f"The same across a real link ({veth['link']}: the server in one network namespace, the "
                  "client in another):", "", *_wire_table(veth)]
        lines += ["", f"One step through the server across the veth: {veth['step_seconds'] * 1e3:.1f} ms."]
    elif veth is not None:
        lines += ["", f"Across a real link (veth): {veth['why']}."]
    fair = net.get("fairness")
    if fair is not None:
        lines += ["", f"Fairness: {fair['clients']} trainers at once, each a process stepping its own namespace of "
                  f"{fair['elements']:,} elements through one server on loopback for {fair['duration_s']:.0f} s: "
                  f"{min(fair['steps'])}-{max(fair['steps'])} steps each ({fair['total_steps_per_s']:.1f} steps/s in all), "
                  f"Jain's index {fair['jain_index']:.4f} (1: every client served alike), min/max "
                  f"{fair['min_over_max']:.2f}" + (f"; errors: {fair['errors']}" if fair["errors"] else "") + "."]
    cache = net["param_cache"]
    if cache.get("measured"):
        lines += ["", f"Param reads, server parameter cache on: {cache['cache_on_gbs']:.2f} GB/s, off (from the media): "
                  f"{cache['cache_off_gbs']:.2f} GB/s; on / off {cache['on_vs_off']:.2f}x turn by turn."]
    else:
        lines += ["", f"Param reads from the cache against the media: {cache['why']}."]
    iopath = report.get("iopath")
    if iopath:
        lines += ["", f"The I/O-path comparison: {iopath['parameters']:,} parameters in {iopath['tensors']} tensors, medians of "
                  f"{iopath['cycles']} cycles; bytes per cycle as the client's socket (wire, both ways, headers "
                  "included) and the device's namespace statistics counted them.", "",
                  "| path | ms a cycle | wire | written to the device | read from the device | to the media "
                  "| SMART data units written |", "|---|---|---|---|---|---|---|"]
        for name in ("conventional", "conventional_ext4", "cossd"):
            row = iopath.get(name)
            if row is None or not row.get("measured", True):
                continue
            lines.append(f"| {row['what']} | {row['seconds'] * 1e3:.1f} | {row['wire_bytes'] / 1e6:.2f} MB "
                         f"| {row['device_bytes_written'] / 1e6:.2f} MB | {row['device_bytes_read'] / 1e6:.2f} MB "
                         f"| {row['media_bytes_written'] / 1e6:.2f} MB | {row['smart_data_units_written']:.1f} |")
        lines += ["", f"Conventional / cossd: {iopath['wire_ratio']:.2f}x the wire bytes, "
                  f"{iopath['time_ratio']:.2f}x the time."]
        ext4 = iopath.get("conventional_ext4") or {}
        if ext4.get("measured"):
            lines.append(f"Through the remote mount onto ext4 (the wire as the server's link counted it, every "
                         f"connection): {ext4['wire_bytes'] / iopath['cossd']['wire_bytes']:.2f}x the wire bytes of "
                         f"cossd, {ext4['seconds'] / iopath['cossd']['seconds']:.2f}x the time.")
        elif ext4:
            lines.append(f"Through the remote mount onto ext4: {ext4['why']}.")
    return lines

