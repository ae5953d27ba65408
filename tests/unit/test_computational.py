"""The standard face (no mount): compute and memory namespaces, program activation, range sets,
Execute Program's adamw_step against the vendor CMB_WRITE, hostile ranges, SLM I/O, layouts."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.client.computational import ComputationalClient, submission
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.protocol.computational import (ADAMW_HYPERPARAMETERS, ADAMW_PROGRAM_ID, CP_IDENTIFY_NAMESPACE, IO_QUEUE_FLAG,
                                          MAX_RANGES, MEMORY_RANGE, NVM_SOURCE_RANGE, PROGRAM_DESCRIPTOR,
                                          ComputeOpcode, CpAdminOpcode, MemoryOpcode, encode_ranges)
from cossd.protocol.entries import SUBMISSION, Opcode, decode_submission
from cossd.protocol.status import DeviceError, Status
from helpers import InProcessTransport

CMB_BYTES = 16 << 20
TENSORS = [["w", BLOCK_ELEMS + 77], ["b", 13]]
NUMEL = sum(numel for _, numel in TENSORS)


@pytest.fixture
def rig(device: Device) -> Iterator[tuple[Controller, AdminClient, ComputationalClient]]:
    controller = Controller(device, CMB_BYTES)
    admin = AdminClient(InProcessTransport(controller))  # type: ignore[arg-type]
    try:
        yield controller, admin, ComputationalClient(admin)
    finally:
        controller.close()


def optimizer(admin: AdminClient, name: str = "opt", seed: int = 0) -> int:
    nsid = admin.create_namespace({"name": name, "tensors": TENSORS, "hyperparameters": {"lr": 1e-2, "weight_decay": 0.1}})
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(NUMEL, dtype=np.float32)
    namespace = admin.transport.controller.device.namespaces[name]  # type: ignore[attr-defined]
    at = 0
    for tensor, numel in TENSORS:
        namespace.write_state(tensor, "master", 0, master[at : at + numel].tobytes())
        at += numel
    return nsid


def state(device: Device, name: str = "opt") -> dict[str, bytes]:
    ns = device.namespaces[name]
    return {f"{t}/{r}": ns.read(t, r, 0, 1 << 30) for t, _ in TENSORS  # type: ignore[call-arg]
            for r in ("master", "exp_avg", "exp_avg_sq", "param")}


def cp_setup(cp: ComputationalClient) -> tuple[int, int]:
    compute = cp.ensure_namespace("cp", "compute")
    window = cp.ensure_namespace("slm", "memory", cmb=True)
    cp.activate(compute)
    return compute, window


def adamw_ranges(window: int, opt: int, grad_at: int, params_at: int, first: int = 0, count: int = NUMEL) -> list:
    return [(window, grad_at, 2 * count), (opt, 4 * first, 4 * count), (opt, 4 * first, 4 * count),
            (opt, 4 * first, 4 * count), (window, params_at, 2 * count)]


# ---------------------------------------------------------------------- layouts


def test_layouts_byte_for_byte() -> None:
    assert MEMORY_RANGE.itemsize == 32 and [MEMORY_RANGE.fields[n][1] for n in ("mnsid", "length", "sb")] == [0, 4, 8]
    assert PROGRAM_DESCRIPTOR.itemsize == 64 and PROGRAM_DESCRIPTOR.fields["pid"][1] == 8
    assert [CP_IDENTIFY_NAMESPACE.fields[n][1] for n in ("maxact", "maxmemrs", "mrsg", "maxmemr", "maxpb", "lpg")] \
        == [0, 2, 4, 6, 8, 16]
    assert ADAMW_HYPERPARAMETERS.itemsize == 48 and NVM_SOURCE_RANGE.itemsize == 32
    assert encode_ranges([(7, 0x1122334455, 64)]) == struct.pack("<IIQ16x", 7, 64, 0x1122334455)
    raw = submission(ComputeOpcode.EXECUTE_PROGRAM, io=True, nsid=3, cdw2=0 | 5 << 16, cdw3=2, cdw4=96,
                     cdw10=9, cdw11=1, cdw12=0xAABBCCDD, cdw13=0x3FF00000)
    assert raw[0] == 0x01 and raw[1] == IO_QUEUE_FLAG
    assert struct.unpack_from("<IIII", raw, 4) == (3, 5 << 16, 2, 96)  # nsid, CDW2, CDW3, CDW4
    assert struct.unpack_from("<IIII", raw, 40) == (9, 1, 0xAABBCCDD, 0x3FF00000)
    command = decode_submission(raw)
    assert (command.cdw2, command.cdw3, command.cdw4, command.cdw10_11) == (5 << 16, 2, 96, 9 | 1 << 32)
    assert SUBMISSION.itemsize == 64


def test_identify_program_table_and_load_program(rig: tuple[Controller, AdminClient, ComputationalClient]) -> None:
    _, admin, cp = rig
    compute, _ = cp_setup(cp)
    ident = cp.identify(compute)
    assert ident["fields"]["maxact"] == 1 and ident["fields"]["maxmemr"] == MAX_RANGES
    # mrsg is an exponent (the prototype's unit): 2^1 = 2-byte ranges, which a half-precision tensor needs.
    assert ident["fields"]["maxpb"] == 0 and ident["fields"]["mrsg"] == 1
    assert ident["programs"] == [{"index": 0, "occupied": 2, "activated": True, "type": 0, "pid": ADAMW_PROGRAM_ID}]
    assert cp.submit(CpAdminOpcode.LOAD_PROGRAM, nsid=compute, cdw10=0).status == Status.PROGRAM_INDEX_NOT_DOWNLOADABLE
    assert cp.submit(CpAdminOpcode.LOAD_PROGRAM, nsid=compute, cdw10=1).status == Status.INVALID_PROGRAM_INDEX
    assert cp.submit(CpAdminOpcode.PROGRAM_ACTIVATION_MANAGEMENT, nsid=compute, cdw10=1 | 1 << 16).status \
        == Status.INVALID_PROGRAM_INDEX
    cp.activate(compute, active=False)
    assert cp.identify(compute)["programs"][0]["activated"] is False
    # Plain Identify still answers as before (the controller's own CNS 01h).
    assert admin.call(Opcode.IDENTIFY, cdw10=1).data[:2] == struct.pack("<H", 0x1D1D)


def test_execute_is_bit_identical_to_cmb_write(tmp_path: Path) -> None:
    """Five steps through Execute Program (inline ranges, then a range set) and through
    CMB_WRITE on two devices with the same start: every state byte and param equal."""
    results = []
    for path_name in ("vendor", "cp"):
        backing = tmp_path / path_name
        Device.format(backing, capacity_bytes=1 << 30, serial="T" + path_name)
        with Device.open(backing) as device:
            controller = Controller(device, CMB_BYTES)
            admin = AdminClient(InProcessTransport(controller))  # type: ignore[arg-type]
            cp = ComputationalClient(admin)
            opt = optimizer(admin)
            compute, window = cp_setup(cp)
            rsid = cp.create_range_set(compute, adamw_ranges(window, opt, 0, 1 << 20))
            params_seen = []
            for step in range(1, 6):
                grads = (np.random.default_rng(step).standard_normal(NUMEL) * 0.05).astype(np.float16)
                controller.cmb.array[: 2 * NUMEL] = grads.view(np.uint8)
                if path_name == "vendor":
                    at = 0
                    transfers = []
                    for tensor, numel in TENSORS:
                        transfers.append({"tensor": tensor, "length": 2 * numel, "cmb_offset": 2 * at,
                                          "param_cmb_offset": (1 << 20) + 2 * at})
                        at += numel
                    admin.cmb_write(opt, transfers)
                elif step % 2:
                    result = cp.execute(compute, ranges=adamw_ranges(window, opt, 0, 1 << 20), step=step)
                    assert result.report["commit"]["committed_step"] == step and result.return_value == 0
                else:
                    cp.execute(compute, range_set=rsid, step=step)
                params_seen.append(controller.cmb.array[1 << 20 : (1 << 20) + 2 * NUMEL].tobytes())
            results.append((state(device), params_seen, device.namespaces["opt"].committed_step))
            controller.close()
    assert results[0][2] == results[1][2] == 5
    assert results[0] == results[1]


def test_nonfinite_step_returns_its_count(rig: tuple[Controller, AdminClient, ComputationalClient]) -> None:
    controller, admin, cp = rig
    opt = optimizer(admin)
    compute, window = cp_setup(cp)
    grads = np.zeros(NUMEL, np.float16)
    grads[[3, 9, NUMEL - 1]] = [np.inf, np.nan, -np.inf]
    controller.cmb.array[: 2 * NUMEL] = grads.view(np.uint8)
    before = state(controller.device)
    result = cp.execute(compute, ranges=adamw_ranges(window, opt, 0, 1 << 20), step=1)
    assert result.return_value == 3 and result.report["commit"]["skipped"]
    after = state(controller.device)
    assert {k: v for k, v in after.items() if "param" not in k} == {k: v for k, v in before.items() if "param" not in k}


def _hostile(window: int, opt: int, other: int) -> list[tuple[str, dict, Status]]:
    good = adamw_ranges(window, opt, 0, 1 << 20)
    return [
        ("misaligned", {"ranges": good[:4] + [(window, (1 << 20) + 1, 2 * NUMEL)]}, Status.INVALID_MEMORY_RANGE_SET),
        ("overlap", {"ranges": good[:4] + [(window, 4, 2 * NUMEL)]}, Status.OVERLAPPING_MEMORY_RANGE),
        ("out of bounds", {"ranges": good[:4] + [(window, CMB_BYTES - 4, 2 * NUMEL)]}, Status.INVALID_MEMORY_RANGE_SET),
        ("past the namespace", {"ranges": adamw_ranges(window, opt, 0, 1 << 20, first=8)}, Status.INVALID_MEMORY_RANGE_SET),
        ("too many", {"ranges": good * 51}, Status.MAX_MEMORY_RANGE_EXCEEDED),
        ("unknown mnsid", {"ranges": [(999, 0, 2 * NUMEL)] + good[1:]}, Status.INVALID_MEMORY_NAMESPACE),
        ("compute as memory", {"ranges": [(other, 0, 2 * NUMEL)] + good[1:]}, Status.INVALID_MEMORY_NAMESPACE),
        ("state span differs", {"ranges": good[:2] + [(opt, 4, 4 * NUMEL)] + good[3:]}, Status.INVALID_FIELD),
        ("not groups of five", {"ranges": good[:4]}, Status.INVALID_FIELD),
        ("unknown set", {"range_set": 77}, Status.INVALID_MEMORY_RANGE_SET_ID),
        ("set and inline", {"range_set": 1, "ranges": good}, Status.INVALID_FIELD),
        ("wrong step", {"ranges": good, "step": 5}, Status.STEP_NUMBER_MISMATCH),
    ]


def test_hostile_ranges_get_their_status_and_change_nothing(
        rig: tuple[Controller, AdminClient, ComputationalClient]) -> None:
    controller, admin, cp = rig
    opt = optimizer(admin)
    compute, window = cp_setup(cp)
    cp.create_range_set(compute, adamw_ranges(window, opt, 0, 1 << 20))  # set 1
    controller.cmb.array[: 2 * NUMEL] = np.full(NUMEL, 0.5, np.float16).view(np.uint8)
    controller.cmb.array[1 << 20 : (1 << 20) + 2 * NUMEL] = 0xAB
    before = state(controller.device), controller.cmb.array[: 2 << 20].copy()
    for why, fields, status in _hostile(window, opt, compute):
        with pytest.raises(DeviceError) as caught:
            cp.execute(compute, **fields)
        assert caught.value.status == status, why
        assert controller.device.namespaces["opt"].step_open is None, why
        assert controller.device.namespaces["opt"].committed_step == 0, why
        assert state(controller.device) == before[0], why
        assert np.array_equal(controller.cmb.array[: 2 << 20], before[1]), why
    # Not activated: PROGRAM_NOT_ACTIVATED, and still nothing changed.
    cp.activate(compute, active=False)
    with pytest.raises(DeviceError) as caught:
        cp.execute(compute, ranges=adamw_ranges(window, opt, 0, 1 << 20))
    assert caught.value.status == Status.PROGRAM_NOT_ACTIVATED
    # Range set create refuses the same ranges with the same statuses.
    for ranges, status in (([(999, 0, 4)], Status.INVALID_MEMORY_NAMESPACE),
                           ([(window, 0, 8), (window, 4, 8)], Status.OVERLAPPING_MEMORY_RANGE),
                           ([(window, 0, 4)] * (MAX_RANGES + 1), Status.MAX_MEMORY_RANGE_EXCEEDED)):
        completion = cp.submit(CpAdminOpcode.MEMORY_RANGE_SET_MANAGEMENT, nsid=compute, cdw10=0,
                               cdw11=len(ranges), payload=encode_ranges(ranges))
        assert completion.status == status
    cp.delete_range_set(compute, 1)
    with pytest.raises(DeviceError) as caught:
        cp.delete_range_set(compute, 1)
    assert caught.value.status == Status.INVALID_MEMORY_RANGE_SET_ID
    assert state(controller.device) == before[0]


def test_slm_read_write_fill_copy_and_restore_from_nvm(rig: tuple[Controller, AdminClient, ComputationalClient]) -> None:
    _, admin, cp = rig
    slm = cp.ensure_namespace("slm0", "memory", capacity_bytes=1 << 20)
    nvm = admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": 1 << 20})
    payload = np.arange(1024, dtype=np.uint32).tobytes()
    assert cp.write(slm, 4096, payload) == len(payload)
    assert cp.read(slm, 4096, len(payload)) == payload
    cp.fill(slm, 0, 64, 0xDEADBEEF)
    assert cp.read(slm, 0, 8) == struct.pack("<II", 0xDEADBEEF, 0xDEADBEEF)
    cp.copy_from_memory(slm, 65536, [(slm, 4096, 64), (slm, 0, 8)])
    assert cp.read(slm, 65536, 72) == payload[:64] + struct.pack("<II", 0xDEADBEEF, 0xDEADBEEF)
    # A restore: LBAs of an NVM namespace into the memory namespace.
    blocks = np.random.default_rng(1).integers(0, 255, 3 * 4096, dtype=np.uint8).tobytes()
    controller_ns = admin.transport.controller.device.namespaces["raw"]  # type: ignore[attr-defined]
    controller_ns.write(4096 * 5, blocks)
    assert cp.copy_from_nvm(slm, 8192, [(nvm, 5, 3)]) == len(blocks)
    assert cp.read(slm, 8192, len(blocks)) == blocks
    # Hostile SLM I/O: misaligned, past the end, an NVM source past its end, the wrong kind.
    snapshot = cp.read(slm, 0, 1 << 20)
    for opcode, fields, status in (
            (MemoryOpcode.MEMORY_READ, {"cdw10": 2, "cdw12": 8}, Status.INVALID_FIELD),
            (MemoryOpcode.MEMORY_WRITE, {"cdw10": (1 << 20) - 4, "cdw12": 8, "payload": bytes(8)}, Status.INVALID_FIELD),
            (MemoryOpcode.MEMORY_FILL, {"cdw10": 0, "cdw12": 6}, Status.INVALID_FIELD),
            (MemoryOpcode.MEMORY_COPY, {"cdw2": 2 * 4096, "cdw10": 0, "cdw12": 2 << 8,
                                         "payload": struct.pack("<I4xQH14x", nvm, 255, 1)}, Status.LBA_OUT_OF_RANGE),
            (MemoryOpcode.MEMORY_COPY, {"cdw2": 200, "cdw10": 4096, "cdw12": 4 << 8,
                                         "payload": struct.pack("<I4xQI12x", slm, 4000, 200)},
             Status.OVERLAPPING_IO_RANGE)):
        assert cp.submit(opcode, io=True, nsid=slm, **fields).status == status, (opcode, fields)
    assert cp.read(slm, 0, 1 << 20) == snapshot
    assert cp.submit(MemoryOpcode.MEMORY_READ, io=True, nsid=nvm, cdw12=4).status == Status.INVALID_OPCODE
    # Without the I/O flag, 02h is Get Log Page as ever.
    assert admin.submit(Opcode.GET_LOG_PAGE, nsid=0xFFFFFFFF, cdw10=2 | 0xFFFF << 16).status == Status.SUCCESS


def test_namespaces_survive_a_reopen_memory_does_not(backing: Path) -> None:
    with Device.open(backing) as device:
        controller = Controller(device, CMB_BYTES)
        cp = ComputationalClient(AdminClient(InProcessTransport(controller)))  # type: ignore[arg-type]
        compute, _ = cp_setup(cp)
        slm = cp.ensure_namespace("slm0", "memory", capacity_bytes=8192)
        cp.write(slm, 0, b"abcd")
        controller.close()
    with Device.open(backing) as device:
        controller = Controller(device, CMB_BYTES)
        cp = ComputationalClient(AdminClient(InProcessTransport(controller)))  # type: ignore[arg-type]
        kinds = {ns["name"]: ns["kind"] for ns in cp.admin.describe()["namespaces"]}
        assert kinds == {"cp": "compute", "slm": "memory", "slm0": "memory"}
        assert cp.read(slm, 0, 4) == bytes(4)  # memory: zeroed by the restart
        assert cp.identify(compute)["programs"][0]["activated"] is False  # controller state
        with pytest.raises(DeviceError) as caught:
            cp.ensure_namespace("slm0", "compute")
        assert caught.value.status == Status.NAMESPACE_KIND_MISMATCH
        controller.close()
