"""`cossd bench --sections devices --devices-link netns`: each device a `cossd serve` in a network namespace of its own, the bytes on each link from the veth and the server, nothing left behind on any exit, and a row saying why where namespaces cannot be made."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cossd.harness import netns
from cossd.harness.bench import devices_net
from cossd.harness.bench.devices import gpt_shapes
from cossd.trainer.placement import place_on_devices
from helpers import run_cli


def _ours(pid: int) -> tuple[list[str], list[str]]:
    """The namespaces and host veth ends named after `pid`'s run."""
    spaces = [name for name in netns.namespaces() if name.startswith(f"{devices_net.NS_PREFIX}{pid}x")]
    links = [name for name in os.listdir("/sys/class/net") if name.startswith(f"{devices_net.HOST_IF_PREFIX}{pid}x")]
    return spaces, links


def test_bench_devices_over_network_namespaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 1.1M-param GPT (width 256, one layer, its embedding 30%) at 1, 2 and 4 devices, each
    served in its own namespace: every device commits every step; per device and step its
    veth carries to the device at least its 2 B of gradients an element (and not 30% more:
    headers) and back at least its 2 B of params, the server counts the payload in that
    range too; the devices hold the placement rule's pieces; nothing of the run is left."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    code, out, err = run_cli(capsys, "bench", "--sections", "devices", "--devices-link", "netns", "--device-width",
                             "256", "--device-layers", "1", "--repeat", "1", "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    section = json.loads((tmp_path / "b/bench.json").read_text())["devices"]
    assert section["link"] == "netns" and [row["devices"] for row in section["rows"]] == [1, 2, 4]
    for row in section["rows"]:
        assert sum(device["elements"] for device in row["per_device"]) == row["elements"]
        assert len(set(row["addresses"])) == row["devices"]
        rule = place_on_devices([(name, math.prod(shape)) for name, shape in gpt_shapes(256, 1)], row["devices"])
        assert [[tuple(t) for t in device["tensors"]] for device in row["per_device"]] == \
            [[(piece.name, piece.numel) for piece in shard] for shard in rule]
        for device in row["per_device"]:
            payload, link = 2 * device["elements"], device["link"]
            assert device["grad_bytes_in_per_step"] == payload
            for key in ("veth_to_device", "veth_from_device", "server_bytes_in", "server_bytes_out"):
                assert payload <= link[key] < 1.3 * payload, (key, link, payload)
            assert 0 < device["share_of_step"] <= 1.0
    assert _ours(os.getpid()) == ([], [])
    assert "each a `cossd serve` in its own network namespace" in (tmp_path / "b/bench.md").read_text()


def test_without_namespaces_the_section_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where namespaces cannot be made (not root, no iproute2), the section measures nothing,
    creates nothing, and its table is one line saying why."""
    monkeypatch.setattr(netns, "_unavailable", ["network namespaces need root"])
    section = devices_net.devices_net_costs(tmp_path, 256, 1, 1)
    assert section["unavailable"] == "network namespaces need root" and "rows" not in section
    assert devices_net.markdown_rows(section) == [
        "", "Several devices over network namespaces: not measured: network namespaces need root."]
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_signal_right_after_a_namespace_is_made_leaves_nothing(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM just as DeviceNamespace.create returns, before the bench has noted the new
    namespace for its teardown: the interrupt waits until it is noted, so it is removed."""
    if netns.unavailable():
        pytest.skip(netns.unavailable())
    from cossd.harness.bench.interrupt import RunInterrupted, signals_end_the_run
    create = devices_net.DeviceNamespace.create.__func__  # type: ignore[attr-defined]

    def create_then_signal(cls: type, index: int, link_mbit: float | None) -> devices_net.DeviceNamespace:
        made = create(cls, index, link_mbit)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the main thread
        return made

    monkeypatch.setattr(devices_net.DeviceNamespace, "create", classmethod(create_then_signal))
    with pytest.raises(RunInterrupted), signals_end_the_run():
        with devices_net.served_devices(tmp_path, 1, None):
            pytest.fail("the signal did not end the run")
    assert _ours(os.getpid()) == ([], [])


# The section at one device count (argv[2]) only, a job long enough (200 steps of an 18M-param
# model) to be under way whenever the test looks.
_RUN = """
import sys
from pathlib import Path
from cossd.harness.bench import devices_net
devices_net.DEVICE_COUNTS = (int(sys.argv[2]),)
devices_net.devices_net_costs(Path(sys.argv[1]), 512, 4, 200)
"""


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):  # not made yet (or gone)
        return 0


def _server_queues(namespace: str) -> list[int]:
    """The unread bytes of each established connection to the server in `namespace`, from its
    /proc/net/tcp (seen from inside): with the server stopped, bytes there are a command the
    client sent and awaits the answer to."""
    table = netns.Netns(namespace, "", "").run(["cat", "/proc/net/tcp"], check=False).stdout.splitlines()[1:]
    queues = []
    for line in table:
        fields = line.split()  # sl, local address:port, remote, state, tx_queue:rx_queue, ...
        if int(fields[1].split(":")[1], 16) == devices_net.PORT and fields[3] == "01":  # ESTABLISHED
            queues.append(int(fields[4].split(":")[1], 16))
    return queues


# The signal comes while a command's answer is certainly awaited: the last device's server is
# stopped (SIGSTOP) once its first client has connected, and the signal is sent only once that
# server's socket holds a command it has not read. Before the fix the run then waited out the
# client's 120 s reply timeout: on one device in the cleanup, which sent its commands into the
# connection the interrupt had left mid-answer; on two, in the device thread the interrupted
# main thread waits for. One device takes SIGTERM, two take SIGINT (both ways, both signals).
@pytest.mark.parametrize("signum, devices", [(signal.SIGTERM, 1), (signal.SIGINT, 2)],
                         ids=["SIGTERM-1-device", "SIGINT-2-devices"])
def test_a_signal_mid_run_leaves_no_namespace_link_or_server(tmp_path: Path, signum: int, devices: int) -> None:
    """Ctrl-C (SIGINT) or SIGTERM while the bench awaits a device's answer: the run ends at
    once (not at the client's 120 s timeout), says why, and its namespaces, its veth ends and
    its servers are gone."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    # SIGINT as a terminal would deliver it: a run started in the background by a shell (as CI
    # may start this suite) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; the default disposition at exec lets it install its handler.
    process = subprocess.Popen([sys.executable, "-c", _RUN, str(tmp_path), str(devices)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    stopped: list[int] = []
    try:
        namespace = f"{devices_net.NS_PREFIX}{process.pid}x{devices - 1}"
        sent = Path(f"/sys/class/net/{devices_net.HOST_IF_PREFIX}{process.pid}x{devices - 1}/statistics/tx_bytes")
        deadline = time.monotonic() + 120
        # The job's gradients under way to the device (16 MB: past the connections' handshakes
        # and the namespace's creation): its commands are the optimizer's, not a handshake's.
        while _read_int(sent) <= 16e6:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "the run never reached its device"
            time.sleep(0.1)
        servers = netns.Netns(namespace, "", "").pids()
        stopped += servers
        while True:
            for pid in servers:
                os.kill(pid, signal.SIGSTOP)
            looked_until = time.monotonic() + 3
            while time.monotonic() < looked_until and not any(_server_queues(namespace)):
                time.sleep(0.1)
            if any(_server_queues(namespace)):
                break
            # Stopped after it had read the command it was working on: nothing to see queued
            # (though the client waits); let it answer and stop it again.
            for pid in servers:
                os.kill(pid, signal.SIGCONT)
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "never caught the stopped device with a command unread"
            time.sleep(0.3)
        process.send_signal(signum)
        # Half the client's reply timeout: the old code waited all of it.
        output = process.communicate(timeout=60)[0].decode()
        assert process.returncode != 0, output
        assert f"ended by {signal.Signals(signum).name}; its namespaces, veths and servers are removed" in output
        assert _ours(process.pid) == ([], []), output
        assert not [pid for pid in servers if Path(f"/proc/{pid}").exists()]
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if process.poll() is None:
            process.kill()
            process.wait()
        devices_net.clean_leftovers()

