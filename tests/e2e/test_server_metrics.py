"""The storage server's figures, seen from outside after real traffic: its Prometheus endpoint
(`cossd serve --metrics-port`, scraped over HTTP, with and without the bearer token) and its
log page C5h read by a real client, `cossd server-log` and `cossd get-log -i 0xc5`; param
cache hits and a wrong-token refusal counted in both; a mount's controller has no such page."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.protocol.entries import Opcode, encode_submission
from cossd.protocol.logpages import SERVER_LOG_BYTES, SERVER_LOG_FIELDS, SERVER_REFUSALS, LogId, decode_server_log
from cossd.protocol.status import Status
from cossd.server.metrics import RECV_REFUSALS, SERVER_METRICS
from helpers import free_port
from test_server import TOKEN, Served, start_server

METRICS_TOKEN = "metrics-s3cret-0123456789abcdef"
REPO = Path(__file__).resolve().parents[2]



def scrape(port: int, authorization: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if authorization is not None:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def samples(text: str) -> dict[str, float]:
    """Each sample line of an exposition as {"name{labels}": value}."""
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def secret(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Served, int]]:
    """A real `cossd serve` with a token, the param cache and a token-guarded metrics port."""
    backing = tmp_path / "srv"
    Device.format(backing, capacity_bytes=2 << 30, serial="METRICS0001")
    port = free_port()
    server = start_server(backing, ["--listen", "127.0.0.1:0", "--token-file", str(secret(tmp_path / "token", TOKEN)),
                                    "--param-cache-size", "64M", "--metrics-port", str(port),
                                    "--metrics-token-file", str(secret(tmp_path / "metrics.token", METRICS_TOKEN))])
    try:
        yield server, port
    finally:
        server.stop()


def _traffic(client: AdminClient) -> int:
    """Two committed steps of a namespace, its params read three times (one fill, then hits)."""
    nsid = client.create_namespace({"name": "m", "tensors": [["w", 300_001], ["b", 17]]})
    transport = client.transport
    grads = [transport.open_file(f"ns/m/tensors/{t}/grad", True, False) for t in ("w", "b")]
    params = [transport.open_file(f"ns/m/tensors/{t}/param", False, False) for t in ("w", "b")]
    values = [np.full(300_001, 0.5, np.float16).tobytes(), np.full(17, 0.5, np.float16).tobytes()]
    out = [bytearray(len(v)) for v in values]
    for step in (1, 2):
        client.begin_step(nsid, step)
        transport.write_many([(h, memoryview(v), 0) for h, v in zip(grads, values)])
        client.commit_step(nsid)
    for _ in range(3):
        transport.read_many([(h, memoryview(o), 0) for h, o in zip(params, out)])
    return nsid


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cossd.tools.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env={"PATH": "/usr/bin:/bin"})


def test_metrics_and_log_page_after_real_traffic(served: tuple[Served, int], tmp_path: Path) -> None:
    server, port = served
    token_file = tmp_path / "token"
    with AdminClient(server.url, 30, token_file=token_file) as client:
        _traffic(client)
        wrong = secret(tmp_path / "wrong", "not-the-server-token-00000")
        with pytest.raises(PermissionError, match="wrong token"):
            AdminClient(server.url, 5, token_file=wrong)
        page = client.get_log_page(LogId.SERVER)
        assert len(page) == SERVER_LOG_BYTES
        figures = decode_server_log(page)
        # A part of the page by offset, as NVMe reads it: the same bytes.
        start = 8 * SERVER_LOG_FIELDS.index("cache_hits")
        assert client.get_log_page(LogId.SERVER, length=16, offset=start) == page[start : start + 16]

        # The Prometheus endpoint: the token is required.
        assert scrape(port)[0] == 401
        assert scrape(port, "Bearer not-it")[0] == 401
        code, text = scrape(port, f"Bearer {METRICS_TOKEN}")
        assert code == 200, text
        scraped = samples(text)
        again = decode_server_log(client.get_log_page(LogId.SERVER))

    assert figures["version"] == 1
    assert figures["connections_total"] >= 1 and figures["connections_open"] >= 1
    assert figures["refused_wrong_token"] == 1 and figures["refused_total"] == 1
    assert figures["cache_fills"] == 1 and figures["cache_hits"] >= 2  # each read after the fill
    assert figures["cache_hit_bytes"] >= 2 * (300_001 + 17) * 2
    assert figures["link_bytes_in"] >= 2 * (300_001 + 17) * 2  # both steps' gradients
    assert figures["link_bytes_out"] >= 3 * (300_001 + 17) * 2  # three param reads
    assert figures["max_connections"] == 64 and figures["recv_memory_bytes"] == 2 << 30
    # The endpoint reads the same figures as the page (between the two reads, only the
    # link's and the connection counters could move, by the one GET_LOG_PAGE).
    assert scraped["cossd_server_param_cache_hits_total"] == figures["cache_hits"]
    assert scraped["cossd_server_param_cache_fills_total"] == figures["cache_fills"]
    assert scraped['cossd_server_refused_total{reason="wrong_token"}'] == 1
    assert scraped['cossd_server_refused_total{reason="busy"}'] == 0
    assert scraped["cossd_server_connections_total"] == figures["connections_total"]
    assert figures["link_bytes_in"] <= scraped["cossd_server_link_received_bytes_total"] <= again["link_bytes_in"]
    # The device's per-namespace figures, as the mount's endpoint serves them.
    assert scraped['cossd_steps_committed_total{namespace="m"}'] == 2
    assert scraped['cossd_committed_step{namespace="m"}'] == 2
    assert scraped['cossd_grad_bytes_total{namespace="m"}'] == 2 * (300_001 + 17) * 2
    assert scraped["cossd_namespaces"] == 1
    assert 'serial="METRICS0001"' in text

    # The CLI: the named verb and get-log, as JSON and as text, with the server's token.
    shown = _cli("server-log", server.url, "--token-file", str(token_file), "-o", "json")
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)
    assert list(listed) == list(SERVER_LOG_FIELDS)
    assert listed["refused_wrong_token"] == 1 and listed["cache_fills"] == 1
    raw = _cli("get-log", server.url, "-i", "0xc5", "--token-file", str(token_file), "-o", "json")
    assert raw.returncode == 0, raw.stderr
    assert json.loads(raw.stdout)["refused_wrong_token"] == 1
    text_out = _cli("server-log", server.url, "--token-file", str(token_file))
    assert text_out.returncode == 0 and "refused_wrong_token" in text_out.stdout, text_out.stderr


def test_metrics_tables_in_the_docs_name_what_is_served(served: tuple[Served, int]) -> None:
    """docs/metrics.md's server table lists exactly the server's metrics, with their types."""
    server, port = served
    code, text = scrape(port, f"Bearer {METRICS_TOKEN}")
    assert code == 200
    # Counters' TYPE lines name them with _total, as the table does.
    served_types = dict(re.findall(r"^# TYPE (cossd_server_\w+) (\w+)$", text, re.M))
    docs = (REPO / "docs/metrics.md").read_text()
    section = docs.split("### The storage server's metrics", 1)[1].split("\n#", 1)[0]
    documented = dict(re.findall(r"^\| `(cossd_server_\w+)` \| (\w+) \|", section, re.M))
    assert documented == served_types
    expected = {name + ("_total" if kind == "counter" else ""): kind for name, kind, *_ in SERVER_METRICS}
    expected |= {"cossd_server_refused_total": "counter", "cossd_server_recv_refused_total": "counter"}
    assert served_types == expected
    assert [reason for reason, _ in RECV_REFUSALS] == ["too_large", "timeout"]
    assert len(SERVER_REFUSALS) == len({f"refused_{r}" for r in SERVER_REFUSALS} & set(SERVER_LOG_FIELDS))


def test_the_page_layout_in_the_docs_is_the_code_s() -> None:
    """docs/command-set.md's table of LID C5h names every field at its byte offset."""
    from cossd.protocol.logpages import SERVER_LOG

    section = (REPO / "docs/command-set.md").read_text().split("#### LID C5h", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (\d+)-(\d+) \| `(\w+)` \|", section, re.M)
    assert [name for _, _, name in rows] == list(SERVER_LOG_FIELDS)
    assert all(SERVER_LOG.fields[name][1] == int(start) and int(end) == int(start) + 7 for start, end, name in rows)


def test_a_mount_has_no_server_page(tmp_path: Path) -> None:
    """C5h is served by a server's controller only: the device's own controller (a mount's)
    answers INVALID_LOG_PAGE, as for any page it does not have."""
    Device.format(tmp_path / "d", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "d") as device:
        controller = Controller(device)
        try:
            completion = controller.submit(encode_submission(Opcode.GET_LOG_PAGE, cid=1, nsid=0xFFFFFFFF,
                                                             cdw10=LogId.SERVER | 0xFFFF << 16, cdw11=0xFFFF))
        finally:
            controller.close()
    assert completion.status == Status.INVALID_LOG_PAGE


def test_metrics_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    """A busy metrics port, or a token file without a port, fails `cossd serve` with one line;
    the device is not opened (no power cycle counted)."""
    backing = tmp_path / "srv"
    Device.format(backing, capacity_bytes=1 << 30)
    token = secret(tmp_path / "token", TOKEN)
    before = json.loads((backing / "superblock.json").read_text())["health"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy_port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="cannot serve metrics on 127.0.0.1:.*address already in use"):
            start_server(backing, ["--listen", "127.0.0.1:0", "--token-file", str(token),
                                   "--metrics-port", str(busy_port)])
    alone = _cli("serve", str(backing), "--token-file", str(token),
                 "--metrics-token-file", str(secret(tmp_path / "m.token", METRICS_TOKEN)))
    assert alone.returncode != 0 and "--metrics-token-file goes with --metrics-port" in alone.stderr, alone.stderr
    assert json.loads((backing / "superblock.json").read_text())["health"] == before
