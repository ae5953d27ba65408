"""The storage server across a real link: the server in network namespace a (10.77.0.1,
--insecure with a token), the trainer in namespace b, joined by a veth pair (tests/netns.py):
the hidden-size check bit for bit, a cut link as a timeout, a tbf rate limit that binds."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import netns
import pytest
from conftest import Mount
from netns import NetnsPair
from test_server import KILL_MODEL, KILL_TENSORS, TOKEN, _grads, _masters, _reference, _step, train_hidden

from cossd.client import AdminClient, DeviceTimeoutError
from cossd.emulator import Device
from cossd.server.command import READY_PREFIX

netns_pair = netns.netns_pair  # the fixture, from the helper

READY_TIMEOUT_S = 30.0


class NetnsServer:
    """A `cossd serve --foreground` process inside namespace a, on a's address."""

    def __init__(self, pair: NetnsPair, backing: Path, token_file: Path) -> None:
        Device.format(backing, capacity_bytes=2 << 30, serial="NETNS0001")
        self.token_file = token_file
        self.stderr = open(backing.parent / f"{backing.name}.stderr", "wb")
        read_fd, write_fd = os.pipe()
        self.process = pair.popen(pair.a, [
            sys.executable, "-m", "cossd.server.command", str(backing), "--foreground", "--ready-fd", str(write_fd),
            "--listen", f"{pair.a.address}:0", "--insecure", "--token-file", str(token_file), "--lease-s", "2"],
            pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=self.stderr)
        os.close(write_fd)
        try:
            line = b""
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not line.endswith(b"\n") and time.monotonic() < deadline:
                if select.select([read_fd], [], [], 0.5)[0]:
                    chunk = os.read(read_fd, 256)
                    if not chunk:
                        break
                    line += chunk
        finally:
            os.close(read_fd)
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise AssertionError(f"the server in namespace a did not start: {self.log()}")
        self.url = line[len(READY_PREFIX):].decode().strip()

    def log(self) -> str:
        self.stderr.flush()
        return Path(self.stderr.name).read_text(errors="replace")[-2000:]

    def client(self, timeout_s: float = 10.0) -> AdminClient:
        return AdminClient(self.url, timeout_s, token_file=self.token_file)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.stderr.close()


@pytest.fixture
def far(netns_pair: NetnsPair, tmp_path: Path) -> Iterator[NetnsServer]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    server = NetnsServer(netns_pair, tmp_path / "far", token_file)
    try:
        yield server
    finally:
        server.stop()


def test_hidden_sizes_across_the_veth_bit_for_bit(mount: Mount, netns_pair: NetnsPair, far: NetnsServer) -> None:
    assert far.url.startswith(f"cossd://{netns_pair.a.address}:")

    def trained() -> dict[str, bytes]:
        with far.client() as client:
            return train_hidden(client)

    with AdminClient(mount.mountpoint) as local:
        expected = train_hidden(local)
    assert netns_pair.b.call(trained, timeout=120) == expected


def _load(client: AdminClient) -> int:
    nsid = client.create_namespace(KILL_MODEL)
    transport = client.transport
    for tensor, data in _masters().items():
        handle = transport.open_file(f"ns/k/tensors/{tensor}/master", True, False)
        transport.write_at(handle, memoryview(data), 0)
        transport.close_file(handle)
    return nsid


def _params(client: AdminClient) -> dict[str, bytes]:
    transport = client.transport
    handles = [transport.open_file(f"ns/k/tensors/{t}/param", False, False) for t, _ in KILL_TENSORS]
    buffers = [bytearray(n * 2) for _, n in KILL_TENSORS]
    counts = transport.read_many([(h, memoryview(b), 0) for h, b in zip(handles, buffers)])
    for handle in handles:
        transport.close_file(handle)
    return {t: bytes(b[:c]) for (t, _), b, c in zip(KILL_TENSORS, buffers, counts)}


def test_a_cut_veth_is_a_timeout_and_the_device_serves_step_n_or_n_plus_1(
        netns_pair: NetnsPair, far: NetnsServer, tmp_path: Path) -> None:
    timeout_s = 3.0

    def cut_mid_step() -> tuple[type, float]:
        client = far.client(timeout_s)
        nsid = _load(client)
        _step(client, nsid, 1, [])
        transport = client.transport
        handles = {t: transport.open_file(f"ns/k/tensors/{t}/grad", True, False) for t, _ in KILL_TENSORS}
        client.begin_step(nsid, 2)
        grads = _grads(2)
        transport.write_many([(handles["b"], memoryview(grads["b"]), 0)])  # some of step 2 in
        netns_pair.link_down()
        started = time.monotonic()
        try:
            transport.write_many([(handles["a"], memoryview(grads["a"]), 0), (handles["c"], memoryview(grads["c"]), 0)])
            client.commit_step(nsid)
        except (DeviceTimeoutError, OSError) as exc:
            return type(exc), time.monotonic() - started
        finally:
            client.close()
        raise AssertionError("step 2 went through a cut link")

    kind, waited = netns_pair.b.call(cut_mid_step, timeout=60)
    assert issubclass(kind, DeviceTimeoutError), kind
    assert waited < timeout_s + 10.0, waited  # its bound, not a hang (slack for a loaded machine)
    netns_pair.link_up()

    def after() -> tuple[int, dict[str, bytes]]:
        # A link just brought up may refuse a connect for a moment (EHOSTUNREACH until the
        # neighbour entry is resolved again): a client retries, as an operator's would.
        deadline = time.monotonic() + 10.0
        while True:
            try:
                client = far.client()
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with client:
            return client.statistics(client.nsid("k"))["committed_step"], _params(client)

    committed, params = netns_pair.b.call(after, timeout=60)
    states = _reference(tmp_path, 2)
    assert committed in (1, 2)
    assert params == {t: states[committed][f"{t}/param"][: n * 2] for t, n in KILL_TENSORS}


def test_a_rate_limited_link_bounds_the_step(netns_pair: NetnsPair, far: NetnsServer, tmp_path: Path) -> None:
    mbit = 200.0
    netns_pair.rate_limit(netns_pair.a, mbit=mbit)
    netns_pair.rate_limit(netns_pair.b, mbit=mbit)

    def timed_step() -> tuple[float, float, int, dict[str, bytes]]:
        with far.client(30.0) as client:
            nsid = _load(client)
            started = time.monotonic()
            _step(client, nsid, 1, [], batched=True)
            step_s = time.monotonic() - started
            started = time.monotonic()
            params = _params(client)
            read_s = time.monotonic() - started
            return step_s, read_s, client.statistics(nsid)["committed_step"], params

    step_s, read_s, committed, params = netns_pair.b.call(timed_step, timeout=60)
    assert committed == 1
    grad_bytes = sum(n * 2 for _, n in KILL_TENSORS)
    limit = mbit * 1e6 / 8
    # Loose: the bucket's burst and the headers move the figure a little, never by 2x.
    assert grad_bytes / step_s < 1.5 * limit, (grad_bytes / step_s, limit)
    assert grad_bytes / read_s < 1.5 * limit, (grad_bytes / read_s, limit)
    expected = _reference(tmp_path, 1)[1]
    assert params == {t: expected[f"{t}/param"][: n * 2] for t, n in KILL_TENSORS}
    print(f"across a {mbit:g} Mbit/s veth: grads {grad_bytes / step_s / 1e6:.1f} MB/s, "
          f"params {grad_bytes / read_s / 1e6:.1f} MB/s (limit {limit / 1e6:.1f} MB/s)")
