"""Hypothesis fuzz of the control entries: thousands of random submissions against a Controller on
a real Device, and hundreds through a real mount's .admin. Every entry is answered with a status
(or a clean errno for a malformed one), nothing crashes, and no failed command changes anything.

Successful commands are legitimate changes (a delete, an armed injection, a new snapshot): the
state is compared around each *failed* entry, and after each example the device is brought
back to its baseline (injections cleared, open steps aborted, extra namespaces deleted, deleted
ones re-created) so that the next example starts from the same place.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Mount
from cossd import kernels
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.protocol.status import Status
from cossd.protocol.computational import CpAdminOpcode
from cossd.protocol.entries import MAX_PAYLOAD_BYTES
from cossd.protocol.entries import (
    COMPLETION,
    NSID_ALL,
    Completion,
    Opcode,
    SubmissionError,
    decode_completion,
    encode_submission,
)
from cossd.client import AdminClient
from cossd.tools.verbs.inject import clear_injections, injection_log
from helpers import pwrite_all, tensor_dir

# The namespaces every example starts from, each with step 1 committed.
BASELINE: dict[str, dict[str, Any]] = {
    "net": {"name": "net", "tensors": [["w", 3000], ["b", 10, 1]], "groups": [{}, {"weight_decay": 0.0}]},
    "aux": {"name": "aux", "tensors": [["t", 100]]},
}
SUCCESSFUL = (Status.SUCCESS, Status.STEP_SKIPPED_NONFINITE)
# The admin opcodes of the vendor command set and of the Computational Programs command set.
KNOWN_OPCODES = sorted(int(opcode) for opcode in (*Opcode, *CpAdminOpcode))
IN_PROCESS_EXAMPLES = 1100  # 1-4 entries each: about 2600 entries
THROUGH_MOUNT_EXAMPLES = 90  # 2-5 entries each: about 300 entries

# Dwords that mean something to some opcode: FIDs with SEL or SV, inject actions, thresholds
# (with TMPSEL/THSEL), CNS and LIDs, groups; otherwise any 32-bit value.
INTERESTING_DWORDS = [0, 1, 2, 3, 4, 7, 0xC0, 0xC1, 0xC3, 0x42, 0x104, 0x204, 0x304, 0x504, 0x3C0, 0x1C1,
                      0x80000004, 0x80000007, 0x800000C0, 0x800000C1, 300, 330, 1 << 16 | 300, 1 << 20 | 5,
                      2 << 20, 0xF0000 | 320, 0xFFFFFFFF]
FEATURE_IDS = [0x04, 0x07, 0xC0, 0xC1]
LOG_IDS = [0x01, 0x02, 0x05, 0xC0, 0xC1, 0xC2, 0xC3]
# The feature, injection and hyperparameter commands parse the most fields: drawn more often.
SHAPED_OPCODES = KNOWN_OPCODES + [Opcode.SET_FEATURES] * 4 + [Opcode.GET_FEATURES, Opcode.INJECT_ERROR] * 3 + [
    Opcode.SET_HYPERPARAMETERS] * 2
SNAPSHOT_OPCODES = (Opcode.SNAPSHOT_CREATE, Opcode.SNAPSHOT_DELETE, Opcode.SNAPSHOT_ROLLBACK,
                    Opcode.SNAPSHOT_CLONE, Opcode.EXPORT)
STATUS_NAMES = [status.name for status in Status]
HYPER_KEYS = ["lr", "beta1", "beta2", "eps", "weight_decay"] * 3 + ["mode", "group", "momentum"]
HYPER_VALUES = [0, 1, 1e-8, 0.5, 0.9, 1e39, -1, float("inf"), "adam", "x", None, True, [1]]
SETTING_VALUES = ["sync", "plp", "fast", "auto", "scalar", "avx2", "avx512", "sse9", 1, None]
ANY_KEYS = ["lr", "tag", "name", "tensor", "block", "opcode", "status", "kernel", "durability", "group",
            "count", "queue", "x"]
ANY_VALUES = [None, True, -3, 0, 1, 7, 5000, 0.5, "w", "t", "s1", "net", "sync", "scalar", "io", "WRITE_FAULT",
              [1, "a"], {}]
CREATE_PAYLOADS = [
    {"name": "fz", "tensors": [["x", 8]]}, {"name": "net", "tensors": [["x", 8]]},
    {"name": "../x", "tensors": [["x", 8]]}, {"name": "fz2", "tensors": [["x", -8]]},
    {"name": "fz3", "tensors": [["x", 8]], "hyperparameters": {"lr": -1}}, {"name": "fz4"}]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One control entry: a command with symbolic ("net") or numeric nsid, or raw bytes."""

    opcode: int = 0
    nsid: str | int = 0
    cdws: tuple[int, ...] = (0,) * 6
    payload: bytes = b""
    raw: bytes | None = None


class EntryMaker:
    """Random control entries with chosen weights: about a third anything at all, the rest
    shaped for their opcode (its FIDs, SEL and SV, actions, LIDs, payload keys), with values in
    and out of range. The Random is seeded by Hypothesis, so a failure prints what replays it;
    plain random draws keep the weights exact (Hypothesis's own draws lean to small values)."""

    def __init__(self, rng: random.Random, queues: tuple[str, ...]) -> None:
        self.rng = rng
        self.queues = queues

    def dword(self) -> int:
        return self.rng.choice(INTERESTING_DWORDS) if self.rng.random() < 0.5 else self.rng.getrandbits(32)

    def nsid(self, right: list[str | int] | None = None) -> str | int:
        """Mostly `right` (the nsids the command takes), else any: a namespace, 0, all, unknown."""
        roll = self.rng.random()
        if right and roll < 0.6:
            return self.rng.choice(right)
        if roll < 0.8:
            return self.rng.choice([*BASELINE, 0, NSID_ALL, 99])
        return self.rng.getrandbits(32)

    def _object(self, keys: list[str], values: list[Any]) -> dict[str, Any]:
        rng = self.rng
        return {rng.choice(keys): rng.choice(values) if rng.random() < 0.8 else rng.uniform(-1, 2)
                for _ in range(rng.randrange(0, 4))}

    def arm_payload(self, opcode: int | None = None) -> dict[str, Any]:
        rng = self.rng
        spec: dict[str, Any] = {
            "opcode": opcode if opcode is not None else rng.choice(KNOWN_OPCODES) if rng.random() < 0.8
            else rng.randrange(256),
            "status": rng.choice(STATUS_NAMES) if rng.random() < 0.7 else rng.randrange(0x800),
            "count": rng.randrange(-1, 4)}
        if rng.random() < 0.5:
            spec["queue"] = rng.choice([*self.queues, "nvme"])
        return spec

    def payload(self, opcode: int, fid: int = -1) -> bytes:
        rng = self.rng
        roll = rng.random()
        if roll < 0.05:
            return rng.randbytes(rng.randrange(0, 48))
        if roll < 0.08:
            return rng.choice([b"", b"[]", b"not json", b"{"])
        if roll < 0.15:
            return json.dumps(self._object(ANY_KEYS, ANY_VALUES)).encode()
        if opcode == Opcode.SET_HYPERPARAMETERS or fid == 0xC0:
            value: Any = self._object(HYPER_KEYS, HYPER_VALUES)
        elif fid == 0xC1:
            value = self._object(["durability", "kernel", "durability", "kernel", "bogus"], SETTING_VALUES)
        elif opcode == Opcode.INJECT_ERROR:
            value = self.arm_payload() if rng.random() < 0.6 else {
                "tensor": rng.choice(["w", "b", "t", "zz", 3]), "block": rng.choice([0, 0, 1, 2, -1, "0"])}
        elif opcode == Opcode.CREATE_NAMESPACE:
            value = rng.choice(CREATE_PAYLOADS)
        elif opcode in SNAPSHOT_OPCODES:
            value = {"tag": rng.choice(["s1", "s2", "", 5])}
            if opcode == Opcode.SNAPSHOT_CLONE or rng.random() < 0.2:
                value["name"] = rng.choice(["clone1", "net", "../x"])
        else:
            value = self._object(ANY_KEYS, ANY_VALUES)
        return json.dumps(value).encode()

    def command(self) -> Entry:
        rng = self.rng
        cdws = [self.dword() for _ in range(6)]
        if rng.random() < 0.3:  # anything at all
            opcode = rng.choice(KNOWN_OPCODES) if rng.random() < 0.5 else rng.randrange(256)
            return Entry(opcode, self.nsid(), tuple(cdws), self.payload(opcode))
        opcode = rng.choice(SHAPED_OPCODES)
        right: list[str | int] = list(BASELINE)
        fid = -1
        if opcode in (Opcode.GET_FEATURES, Opcode.SET_FEATURES):
            fid = rng.choice(FEATURE_IDS) if rng.random() < 0.85 else rng.randrange(256)
            right = list(BASELINE) if fid == 0xC0 else [0, NSID_ALL]
            select_or_save = rng.randrange(8) << 8 if opcode == Opcode.GET_FEATURES else rng.randrange(2) << 31
            cdws[0] = fid | select_or_save
            if fid == 0xC0 and rng.random() < 0.8:
                cdws[1] = rng.choice([0, 1, 2, 0xFFFFFFFF, 0xFFFFFFFF])  # a group, or every group
        elif opcode == Opcode.INJECT_ERROR:
            cdws[0] = rng.randrange(4)
            right = [*BASELINE, 0]
        elif opcode == Opcode.GET_LOG_PAGE:
            cdws[0] = rng.choice(LOG_IDS) if rng.random() < 0.8 else rng.randrange(256)
            right = [NSID_ALL, 0, *BASELINE]
        elif opcode == Opcode.IDENTIFY:
            cdws[0] = rng.randrange(4)
        return Entry(opcode, self.nsid(right), tuple(cdws), self.payload(opcode, fid))

    def raw(self) -> Entry:
        rng = self.rng
        if rng.random() < 0.3:  # an entry announcing more than the 16 MiB a payload may have
            data_len = rng.randrange(MAX_PAYLOAD_BYTES + 1, 1 << 32)
            return Entry(raw=encode_submission(rng.randrange(256))[:24] + data_len.to_bytes(4, "little") + bytes(36))
        return Entry(raw=rng.randbytes(rng.randrange(0, 100)))

    def batch(self, sizes: tuple[int, int]) -> list[Entry]:
        """`sizes` entries (one in eight raw); half the time an injection armed for the first
        command comes first, so that injections fire often."""
        rng = self.rng
        entries = [self.raw() if rng.random() < 0.125 else self.command()
                   for _ in range(rng.randint(*sizes))]
        target = next((entry for entry in entries if entry.raw is None), None)
        if target is not None and rng.random() < 0.5:
            arm = self.arm_payload(target.opcode) | {"count": rng.randint(1, 2)}
            arm["status"] = rng.choice([name for name in STATUS_NAMES if Status[name] not in SUCCESSFUL])
            entries.insert(0, Entry(Opcode.INJECT_ERROR, rng.choice([0, target.nsid]), (0,) * 6,
                                    json.dumps(arm).encode()))
        return entries


def batches(queues: tuple[str, ...], sizes: tuple[int, int]) -> st.SearchStrategy[list[Entry]]:
    return st.randoms(use_true_random=True).map(lambda rng: EntryMaker(rng, queues).batch(sizes))


@dataclasses.dataclass
class Tally:
    entries: int = 0
    failed: int = 0
    succeeded: int = 0
    injected: int = 0
    errno_channel: int = 0
    incomplete: int = 0  # raw bytes that held no whole entry: buffered, then dropped at close

    def line(self, where: str) -> str:
        return (f"control-entry fuzz ({where}): {self.entries} entries, {self.failed} failed with state "
                f"unchanged ({self.injected} by an injection), {self.succeeded} succeeded, "
                f"{self.errno_channel} refused on the errno channel, {self.incomplete} incomplete, 0 crashes")


def tree_digest(directory: Path) -> str:
    """Every file under `directory`, names and bytes (state copies, slots, meta, snapshots)."""
    seen = hashlib.sha256()
    for root, folders, files in os.walk(directory):
        folders.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            with open(path, "rb") as stream:
                seen.update(path.encode() + b"\0" + stream.read())
    return seen.hexdigest()


def registry(backing: Path) -> dict[str, Any]:
    """superblock.json without the health figures (every failure counts an error log entry)."""
    stored = json.loads((backing / "superblock.json").read_text())
    stored.pop("health", None)
    return stored


def check_answer(entry: Entry, completion: Completion, injected: int) -> None:
    """Every entry gets a known status; only an injection may answer INTERNAL_ERROR."""
    assert isinstance(completion.status, Status), completion
    assert injected in (0, 1)
    if injected:
        assert completion.data.startswith(b"injected error"), completion.data
    elif entry.raw is None and entry.opcode not in KNOWN_OPCODES:
        assert completion.status == Status.INVALID_OPCODE
    if completion.status == Status.INTERNAL_ERROR:
        assert injected, completion.data  # a crash in a handler, not an injected failure


# ---------------------------------------------------------------------- in process


class InProcess:
    """A Controller on a real Device, the baseline namespaces committed at step 1."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.controller = Controller(device)
        self.nsids: dict[str, int] = {}
        self.cid = 0
        self.tally = Tally()
        for name in BASELINE:
            self.ensure(name)
        self.known = self.state()  # the state now: each entry's "before" (a failure keeps it)

    def ensure(self, name: str) -> None:
        completion = self.controller.submit(encode_submission(
            Opcode.CREATE_NAMESPACE, payload=json.dumps(BASELINE[name]).encode()))
        assert completion.status == Status.SUCCESS, completion.data
        namespace = self.device.namespace(name)
        for tensor in namespace.layouts:
            namespace.write_grad(tensor.name, 0, np.ones(tensor.numel, np.float16).tobytes())
        assert namespace.committed_step == 1
        self.nsids[name] = namespace.nsid

    def state(self) -> tuple[Any, ...]:
        device = self.device
        namespaces = []
        for ns in sorted(device.namespaces.values(), key=lambda n: n.nsid):
            hypers = ns.hypers if ns.kind == "optimizer" else None
            namespaces.append((ns.name, ns.nsid, ns.kind, ns.committed_step, ns.loading, ns.step_open, hypers,
                               getattr(ns, "sync_commits", None), tree_digest(ns.directory)))
        health = device.health
        features = (health.over_temp_threshold_kelvin, health.under_temp_threshold_kelvin, device.config.sync,
                    kernels.simd_level())
        return (tuple(namespaces), dict(device.failed_namespaces), registry(device.path), features)

    def run(self, entry: Entry) -> None:
        self.tally.entries += 1
        injector = self.controller.injector
        before, armed, fired = self.known, injector.armed, injector.fired_total
        if entry.raw is not None:
            raw = entry.raw
        else:
            self.cid = (self.cid + 1) & 0xFFFF
            nsid = self.nsids.get(entry.nsid, 0) if isinstance(entry.nsid, str) else entry.nsid
            raw = encode_submission(entry.opcode, cid=self.cid, nsid=nsid, payload=entry.payload,
                                    **{f"cdw{10 + i}": value for i, value in enumerate(entry.cdws)})
        try:
            completion = self.controller.submit(raw)
        except SubmissionError:
            assert entry.raw is not None
            self.tally.errno_channel += 1
            assert self.state() == before and injector.armed == armed
            return
        injected = injector.fired_total - fired
        check_answer(entry, completion, injected)
        if completion.status in SUCCESSFUL:
            self.tally.succeeded += 1
            self.known = self.state()
            return
        self.tally.failed += 1
        self.tally.injected += injected
        assert self.state() == before, (entry, completion)
        if not injected:
            assert injector.armed == armed, (entry, completion)
        newest = self.device.health.error_entries()[0]
        assert (newest.cmdid, newest.status) == (completion.cid, int(completion.status))

    def reset(self) -> None:
        """Back to the baseline: what successful commands changed is undone."""
        self.controller.injector.clear()
        device = self.device
        for namespace in list(device.namespaces.values()):
            if namespace.step_open is not None:
                namespace.abort_step()
        for name in [*device.namespaces, *device.failed_namespaces]:
            if name not in BASELINE:
                device.delete_namespace(name)
        for name in BASELINE:
            if name not in device.namespaces:
                self.ensure(name)
        self.known = self.state()


@pytest.fixture
def in_process(tmp_path: Path) -> Iterator[InProcess]:
    Device.format(tmp_path / "dev", capacity_bytes=8 << 30)
    with Device.open(tmp_path / "dev") as device:
        try:
            yield InProcess(device)
        finally:
            kernels.use_kernel("auto")  # C1h may have capped it: the kernel path is process wide


def test_thousands_of_random_entries_in_process(in_process: InProcess, figures: list[str]) -> None:
    env = in_process

    @settings(max_examples=IN_PROCESS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batches(("admin", "io"), (1, 3)))
    def check(batch: list[Entry]) -> None:
        try:
            for entry in batch:
                env.run(entry)
        finally:
            env.reset()

    check()
    tally = env.tally
    figures.append(tally.line("in process"))
    assert tally.entries >= 2000 and tally.failed > tally.entries // 3 and tally.succeeded > 50
    assert tally.injected > 0 and tally.errno_channel > 0


# ---------------------------------------------------------------------- through a mount


class ThroughMount:
    """The same entries through a real mount: raw writes to .admin, state read back through
    the tensor files and the backing directory (no command: any command could be armed)."""

    def __init__(self, mount: Mount) -> None:
        self.mount = mount
        self.mp = mount.mountpoint
        self.admin = AdminClient(self.mp)
        self.nsids: dict[str, int] = {}
        self.tally = Tally()
        self.failed_cids: list[tuple[int, int]] = []
        # Open param files, by (namespace, nsid): one read request each time the state is read.
        self.params: dict[tuple[str, int], list[int]] = {}
        for name in BASELINE:
            self.ensure(name)
        self.known = self.state()  # the state now: each entry's "before" (a failure keeps it)

    def ensure(self, name: str) -> None:
        self.nsids[name] = self.admin.create_namespace(BASELINE[name])
        for tensor in BASELINE[name]["tensors"]:
            pwrite_all(tensor_dir(self.mp, name, tensor[0]) / "grad", np.ones(tensor[1], np.float16).tobytes())
        assert (self.mp / "ns" / name / "step").read_text() == "1\n"

    def state(self) -> tuple[Any, ...]:
        names = sorted(os.listdir(self.mp / "ns"))
        namespaces = []
        for name in names:
            root = self.mp / "ns" / name
            stats = json.loads((root / "stats.json").read_text())
            seen = hashlib.sha256((root / "config.json").read_bytes())
            for fd in self._param_fds(name, stats["nsid"]):  # the params a trainer reads
                seen.update(os.pread(fd, 1 << 20, 0))
            namespaces.append((name, stats.get("committed_step"), stats.get("step_open"), stats.get("loading"),
                               seen.hexdigest(), tree_digest(self.mount.backing / "ns" / name)))
        return tuple(namespaces), registry(self.mount.backing)

    def _param_fds(self, name: str, nsid: int) -> list[int]:
        if name not in BASELINE:
            return []
        if (name, nsid) not in self.params:
            self.params[(name, nsid)] = [os.open(tensor_dir(self.mp, name, tensor[0]) / "param", os.O_RDONLY)
                                         for tensor in BASELINE[name]["tensors"]]
        return self.params[(name, nsid)]

    def close(self) -> None:
        for fds in self.params.values():
            for fd in fds:
                os.close(fd)
        self.admin.close()

    def _raw(self, raw: bytes) -> tuple[list[Completion], bool]:
        """Raw bytes on a fresh queue pair: the completions of what they held, and whether the
        write was refused on the errno channel (EINVAL)."""
        fd = os.open(self.mp / ".admin", os.O_RDWR)
        refused = False
        try:
            try:
                os.write(fd, raw)
            except OSError as exc:
                assert exc.errno == errno.EINVAL
                self.tally.errno_channel += 1
                refused = True
            completions = []
            while header := os.read(fd, COMPLETION.itemsize):
                completion, data_len = decode_completion(header)
                data = os.read(fd, data_len) if data_len else b""
                completions.append(dataclasses.replace(completion, data=data))
            return completions, refused
        finally:
            os.close(fd)

    def run(self, entry: Entry) -> None:
        self.tally.entries += 1
        before = self.known
        refused = False
        if entry.raw is not None:
            completions, refused = self._raw(entry.raw)
        else:
            nsid = self.nsids.get(entry.nsid, 0) if isinstance(entry.nsid, str) else entry.nsid
            completions = [self.admin.submit(entry.opcode, nsid=nsid, payload=entry.payload,
                                             **{f"cdw{10 + i}": value for i, value in enumerate(entry.cdws)})]
        for completion in completions:
            injected = int(completion.data.startswith(b"injected error"))
            check_answer(entry, completion, injected)
        if any(c.status in SUCCESSFUL for c in completions):
            self.tally.succeeded += 1
            self.known = self.state()
            return
        if not completions and not refused:
            self.tally.incomplete += 1
        if completions:
            self.tally.failed += 1
            self.tally.injected += sum(c.data.startswith(b"injected error") for c in completions)
        assert self.state() == before, (entry, completions)
        if entry.raw is None:
            self.failed_cids.append((completions[0].cid, int(completions[0].status)))

    def reset(self) -> None:
        """Back to the baseline, and every failed command of the example found in the error log."""
        clear_injections(self.admin)  # INJECT_ERROR cannot itself be armed
        logged = {(e["cmdid"], e["status_field"] & 0x7FF) for e in self.admin.error_log()}
        assert set(self.failed_cids) <= logged, (self.failed_cids, logged)
        self.failed_cids.clear()
        for name, stats in self.admin.optimizer_log().items():
            if stats.get("step_open") is not None:
                self.admin.abort_step(stats["nsid"])
            if name not in BASELINE:
                self.admin.delete_namespace(stats["nsid"])
        present = {entry["name"] for entry in self.admin.describe()["namespaces"]}
        for name in BASELINE:
            if name not in present:
                self.ensure(name)
        self.known = self.state()


def test_hundreds_of_random_entries_through_a_mount(mount: Mount, figures: list[str]) -> None:
    env = ThroughMount(mount)

    # Only admin-queue injections: an armed tensor-file read would fail the state reads
    # themselves (test_features.py covers the data path).
    @settings(max_examples=THROUGH_MOUNT_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(batches(("admin",), (2, 4)))
    def check(batch: list[Entry]) -> None:
        try:
            for entry in batch:
                env.run(entry)
        finally:
            env.reset()

    try:
        check()
        assert injection_log(env.admin)["armed"] == []
    finally:
        env.close()
    tally = env.tally
    figures.append(tally.line("through a mount"))
    assert tally.entries >= 200 and tally.failed > tally.entries // 3
