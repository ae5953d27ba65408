"""Fairness of a storage server: N trainers at once, each on its own namespace, stepping through
the server for the same window; each one's completed steps and Jain's fairness index of them."""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...client import AdminClient
from ...emulator import Device
from ...protocol.logpages import LogId, decode_server_log
from ...protocol.status import DeviceError

from ..served import ServedDevice, write_token
from .interrupt import held

# Each client's tensors: one large and one small, as a model's weight and bias.
BIAS_ELEMENTS = 1024


def jain_index(values: list[float]) -> float:
    """Jain's fairness index, (sum x)^2 / (n * sum x^2): 1 when every x is equal, 1/n when one
    gets everything; 0 for no values or all zero."""
    total = sum(values)
    squares = sum(value * value for value in values)
    return total * total / (len(values) * squares) if squares else 0.0


def _client(url: str, token_file: str, index: int, elements: int, duration_s: float, ready: Any,
            results: Any) -> None:
    """One trainer (a process of its own): its namespace, then, once every trainer has its own
    (`ready`, a barrier), steps (begin, one WRITE of its gradients, commit, one READ of its
    params) for duration_s; it reports the steps it completed in that window and their times."""
    try:
        with AdminClient(url, 120, token_file=token_file) as client:
            name = f"fair{index}"
            sizes = (("w", elements), ("b", BIAS_ELEMENTS))
            nsid = client.create_namespace({"name": name, "tensors": [[t, n] for t, n in sizes],
                                            "hyperparameters": {"lr": 1e-4, "weight_decay": 0.0}})
            transport = client.transport
            grads = [transport.open_file(f"ns/{name}/tensors/{t}/grad", True, False) for t, _ in sizes]
            params = [transport.open_file(f"ns/{name}/tensors/{t}/param", False, False) for t, _ in sizes]
            values = [np.full(n, 1e-3 * (index + 1), np.float16).tobytes() for _, n in sizes]
            out = [bytearray(len(v)) for v in values]
            step, done, step_s = 0, 0, []
            # Every client starts at the same instant, however long the others took to start
            # (a loaded machine spawns eight interpreters slowly): no window opens early.
            ready.wait(300)
            stop_at = time.time() + duration_s
            while time.time() < stop_at:
                began = time.time()
                step += 1
                client.begin_step(nsid, step)
                transport.write_many([(h, memoryview(v), 0) for h, v in zip(grads, values)])
                client.commit_step(nsid)
                transport.read_many([(h, memoryview(o), 0) for h, o in zip(params, out)])
                if time.time() <= stop_at:
                    done += 1
                    step_s.append(time.time() - began)
            results.put({"index": index, "steps": done, "step_s": step_s, "error": None})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        ready.abort()  # the others do not wait for this one
        results.put({"index": index, "steps": 0, "step_s": [], "error": f"{type(exc).__name__}: {exc}"})


def measure_fairness(workdir: Path, *, clients: int = 8, elements: int = 1 << 20, duration_s: float = 10.0,
                     url: str | None = None, token_file: Path | None = None,
                     server_options: tuple[str, ...] = ()) -> dict[str, Any]:
    """`clients` trainers at once, each a process with its own namespace of `elements` FP16
    gradients (and a small bias), stepping through one server for `duration_s`: the steps
    each completed in that window, their rates and Jain's index of the counts (1.0: every
    client served alike). A server of its own on loopback in `workdir` (with
    `server_options`), unless `url` and `token_file` name one; its namespaces are deleted
    after."""
    workdir.mkdir(parents=True, exist_ok=True)
    served = None
    processes: list[Any] = []
    try:
        if url is None:
            backing = workdir / "fairness-backing"
            per_client = (elements + BIAS_ELEMENTS) * 28 + (1 << 20)  # both state copies, fp32 moments
            Device.format(backing, capacity_bytes=max(1 << 30, 2 * clients * per_client))
            token_file = write_token(workdir / "fairness.token")
            # A signal ending the run waits until `served` names the server (else the finally
            # below could not stop it: it runs in a session of its own).
            with held():
                served = ServedDevice(backing, token_file, extra=server_options)
            url = served.url
        assert token_file is not None, "a server's url goes with its token_file"
        context = multiprocessing.get_context("spawn")  # no threads or locks of this process copied
        results = context.Queue()
        ready = context.Barrier(clients)
        processes = [context.Process(target=_client, args=(url, str(token_file), index, elements, duration_s, ready,
                                                           results), daemon=True) for index in range(clients)]
        for process in processes:
            process.start()
        reports = sorted((results.get(timeout=duration_s + 600) for _ in processes),
                         key=lambda report: report["index"])
        for process in processes:
            process.join(60)
        with AdminClient(url, 60, token_file=token_file) as admin:
            figures = decode_server_log(admin.get_log_page(LogId.SERVER))
            for index in range(clients):
                try:
                    admin.delete_namespace(admin.nsid(f"fair{index}"))
                except DeviceError:
                    pass  # never created (its client failed first)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        if served is not None:
            served.stop()
    errors = [report["error"] for report in reports if report["error"]]
    steps = [report["steps"] for report in reports]
    rates = [count / duration_s for count in steps]
    means = [float(np.mean(report["step_s"])) if report["step_s"] else None for report in reports]
    step_bytes = 2 * (elements + BIAS_ELEMENTS) * 2  # gradients out and params back
    return {
        "clients": clients,
        "elements": elements,
        "duration_s": duration_s,
        "cores": os.cpu_count(),
        "steps": steps,
        "steps_per_s": rates,
        "bytes_per_s": [rate * step_bytes for rate in rates],
        "mean_step_s": means,
        "jain_index": jain_index([float(count) for count in steps]),
        "min_over_max": min(steps) / max(steps) if max(steps) else 0.0,
        "total_steps_per_s": sum(rates),
        "server": {key: figures[key] for key in ("connections_total", "refused_total", "link_commands",
                                                 "link_bytes_in", "link_bytes_out", "recv_peak_bytes",
                                                 "recv_waits")},
        "errors": errors,
    }
