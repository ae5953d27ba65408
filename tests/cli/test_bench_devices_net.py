"""`cossd bench --sections devices --devices-link netns`: each device a `cossd serve` in a network namespace of its own, the bytes on each link from the veth and the server, nothing left behind on any exit, and a row saying why where namespaces cannot be made."""
from __future__ import annotations

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


_RUN = """
import sys
from pathlib import Path
from cossd.harness.bench import devices_net
devices_net.devices_net_costs(Path(sys.argv[1]), 512, 4, 200)
"""


# Slow tier: intermittent. In some runs (the suite's, under load) the run is still in a
# command's reply (a socket recv with the client's 120 s timeout) when the signal comes, and it
# has not ended by this test's 120 s: seen three times for SIGTERM on this machine (on a
# fresh clone's `make test`, in a rerun, and alone), passing in other runs. Not understood yet
# (stop 41's closing note); kept here so `make torture` keeps running it.
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_run_leaves_no_namespace_link_or_server(tmp_path: Path, signum: int) -> None:
    """Ctrl-C (SIGINT) or SIGTERM while the bench's devices are served: the run ends, and its
    namespaces, its veth ends and its servers are gone."""
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    # SIGINT as a terminal would deliver it: a run started in the background by a shell (as CI
    # may start this suite) inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt; the default disposition at exec lets it install its handler.
    process = subprocess.Popen([sys.executable, "-c", _RUN, str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not list(tmp_path.glob("net-1-0/server.stderr")):
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            time.sleep(0.2)
        time.sleep(3)  # the server up and the job under way
        assert _ours(process.pid)[0], "the run made no namespace"
        servers = [pid for pid in netns.Netns(_ours(process.pid)[0][0], "", "").pids()]
        process.send_signal(signum)
        output = process.communicate(timeout=120)[0].decode()
        assert process.returncode != 0, output
        assert _ours(process.pid) == ([], []), output
        assert not [pid for pid in servers if Path(f"/proc/{pid}").exists()]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        devices_net.clean_leftovers()
