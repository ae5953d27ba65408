"""The memory namespace's own face (no mount): the SLM Identify Namespace page, Memory Copy's
source formats byte for byte, and hostile SLM commands and range sets that change nothing."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.client.computational import ComputationalClient
from cossd.emulator.controller import Controller
from cossd.protocol.computational import (CSI_MEMORY, IDENTIFY_CNS_CSI_NAMESPACE, IDENTIFY_CSI_SHIFT, MAX_RANGES,
                                          MEMORY_SOURCE_RANGE, NVM_SOURCE_RANGE, NVM_SOURCE_RANGE_64,
                                          SLM_IDENTIFY_NAMESPACE, SLM_MAX_TRANSFER, CpAdminOpcode, MemoryOpcode,
                                          encode_ranges)
from cossd.protocol.entries import Opcode
from cossd.protocol.status import Status
from test_computational import CMB_BYTES, cp_setup, rig  # noqa: F401 (rig is a fixture)

Rig = tuple[Controller, AdminClient, ComputationalClient]
SLM_BYTES = 1 << 20


def test_source_and_identify_layouts_byte_for_byte() -> None:
    # Formats 2h and 3h: libnvme's nvme_copy_range_f2 / nvme_copy_range_f3.
    offsets = {name: NVM_SOURCE_RANGE.fields[name][1] for name in NVM_SOURCE_RANGE.names or ()}
    assert NVM_SOURCE_RANGE.itemsize == 32
    assert (offsets["snsid"], offsets["slba"], offsets["nlb"], offsets["cetype"], offsets["cev"], offsets["sopt"],
            offsets["elbt"], offsets["elbat"], offsets["elbatm"]) == (0, 8, 16, 18, 20, 22, 24, 28, 30)
    offsets = {name: NVM_SOURCE_RANGE_64.fields[name][1] for name in NVM_SOURCE_RANGE_64.names or ()}
    assert NVM_SOURCE_RANGE_64.itemsize == 40
    assert (offsets["slba"], offsets["nlb"], offsets["sopt"], offsets["elbt"], offsets["elbat"], offsets["elbatm"]) \
        == (8, 16, 22, 26, 36, 38)
    # Format 4h: the prototype's spdk_nvme_slm_copy_desc_format_4.
    offsets = {name: MEMORY_SOURCE_RANGE.fields[name][1] for name in MEMORY_SOURCE_RANGE.names or ()}
    assert MEMORY_SOURCE_RANGE.itemsize == 32
    assert (offsets["snsid"], offsets["saddr"], offsets["nbyte"], offsets["sopt"]) == (0, 8, 16, 22)
    # The SLM Identify Namespace (cossd's layout).
    offsets = {name: SLM_IDENTIFY_NAMESPACE.fields[name][1] for name in SLM_IDENTIFY_NAMESPACE.names or ()}
    assert offsets == {"msz": 0, "mgran": 8, "mxfer": 12, "msrc": 16, "cfmts": 18, "mattr": 20}


def test_identify_cns_05h_csi_03h_answers_the_memory_namespace(rig: Rig) -> None:
    _, admin, cp = rig
    compute, window = cp_setup(cp)
    own = cp.ensure_namespace("slm0", "memory", capacity_bytes=SLM_BYTES)
    page = admin.call(Opcode.IDENTIFY, nsid=own, cdw10=IDENTIFY_CNS_CSI_NAMESPACE,
                      cdw11=CSI_MEMORY << IDENTIFY_CSI_SHIFT).data
    assert len(page) == 4096 and page[21:] == bytes(4096 - 21)
    assert struct.unpack_from("<QIIHHB", page) == (SLM_BYTES, 4, SLM_MAX_TRANSFER, MAX_RANGES,
                                                   1 << 2 | 1 << 3 | 1 << 4, 0b10)
    assert cp.identify_memory(own) == {
        "fields": {"msz": SLM_BYTES, "mgran": 4, "mxfer": SLM_MAX_TRANSFER, "msrc": MAX_RANGES, "cfmts": 0x1C,
                   "mattr": 2},
        "copy_formats": [2, 3, 4], "cmb_window": False, "volatile": True}
    # A window on the CMB: the CMB's size, attribute bit 0.
    assert cp.identify_memory(window)["fields"]["msz"] == CMB_BYTES
    assert cp.identify_memory(window)["cmb_window"] is True
    # CSI 03h of a compute namespace is the wrong kind; an unknown CSI is INVALID_FIELD.
    assert admin.submit(Opcode.IDENTIFY, nsid=compute, cdw10=IDENTIFY_CNS_CSI_NAMESPACE,
                        cdw11=CSI_MEMORY << IDENTIFY_CSI_SHIFT).status == Status.NAMESPACE_KIND_MISMATCH
    assert admin.submit(Opcode.IDENTIFY, nsid=own, cdw10=IDENTIFY_CNS_CSI_NAMESPACE,
                        cdw11=7 << IDENTIFY_CSI_SHIFT).status == Status.INVALID_FIELD


def test_copy_formats_4h_across_namespaces_and_3h_from_nvm(rig: Rig) -> None:
    controller, admin, cp = rig
    a = cp.ensure_namespace("slm-a", "memory", capacity_bytes=SLM_BYTES)
    b = cp.ensure_namespace("slm-b", "memory", capacity_bytes=SLM_BYTES)
    payload = np.arange(256, dtype=np.uint32).tobytes()
    cp.write(a, 0, payload)
    # 4h: another memory namespace's bytes, then this one's, back to back at the destination.
    cp.write(b, 4096, b"ABCDEFGH")
    assert cp.copy_from_memory(b, 8192, [(a, 16, 64), (b, 4096, 8)]) == 72
    assert cp.read(b, 8192, 72) == payload[16:80] + b"ABCDEFGH"
    # 3h: 40-byte descriptors naming LBAs (NLB 0's based); the protection tags are ignored.
    nvm = admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": SLM_BYTES})
    blocks = np.random.default_rng(2).integers(0, 255, 2 * 4096, dtype=np.uint8).tobytes()
    controller.device.namespaces["raw"].write(4096 * 7, blocks)
    source = np.zeros(1, dtype=NVM_SOURCE_RANGE_64)
    source["snsid"], source["slba"], source["nlb"], source["elbat"] = nvm, 7, 1, 0xBEEF
    completion = cp.call(MemoryOpcode.MEMORY_COPY, io=True, nsid=a, cdw2=len(blocks), cdw10=65536, cdw12=3 << 8,
                         payload=source.tobytes())
    assert completion.result == len(blocks) and cp.read(a, 65536, len(blocks)) == blocks


def test_hostile_slm_commands_get_their_status_and_change_nothing(rig: Rig) -> None:
    _, admin, cp = rig
    _, window = cp_setup(cp)
    slm = cp.ensure_namespace("slm0", "memory", capacity_bytes=SLM_BYTES)
    nvm = admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": SLM_BYTES})
    cp.write(slm, 0, np.arange(SLM_BYTES // 4, dtype=np.uint32).tobytes())
    before = cp.read(slm, 0, SLM_BYTES)

    def memory_source(snsid: int, saddr: int, nbyte: int, sopt: int = 0) -> bytes:
        return struct.pack("<I4xQIxxH8x", snsid, saddr, nbyte, sopt)

    cases = [
        ("copy: CDW2-3 not the sources' bytes", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 60, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(slm, 0, 64)}, Status.INVALID_FIELD),
        ("copy: format 0h", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "payload": encode_ranges([(slm, 0, 64)])}, Status.INVALID_FIELD),
        ("copy: a descriptor short", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(slm, 0, 64)[:31]}, Status.INVALID_FIELD),
        ("copy: misaligned source", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(slm, 2, 64)}, Status.INVALID_FIELD),
        ("copy: source past its end", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(slm, SLM_BYTES - 32, 64)},
         Status.INVALID_FIELD),
        ("copy: destination past the end", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": SLM_BYTES - 32, "cdw12": 4 << 8, "payload": memory_source(slm, 0, 64)},
         Status.INVALID_FIELD),
        ("copy: 4h naming an NVM namespace", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(nvm, 0, 64)}, Status.INVALID_NAMESPACE),
        ("copy: 2h naming a memory namespace", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 4096, "cdw10": 4096, "cdw12": 2 << 8, "payload": struct.pack("<I4xQH14x", window, 0, 0)},
         Status.INVALID_NAMESPACE),
        ("copy: reserved bytes set", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 4096, "cdw12": 4 << 8, "payload": memory_source(slm, 0, 64)[:24] + b"\x01" + bytes(7)},
         Status.INVALID_FIELD),
        ("copy: 256 sources", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 256 * 4, "cdw10": 4096, "cdw12": 255 | 4 << 8, "payload": memory_source(slm, 0, 4) * 256},
         Status.MAX_MEMORY_RANGE_EXCEEDED),
        ("copy: source overlaps destination", MemoryOpcode.MEMORY_COPY,
         {"cdw2": 64, "cdw10": 32, "cdw12": 4 << 8, "payload": memory_source(slm, 0, 64)}, Status.OVERLAPPING_IO_RANGE),
        ("write: CDW12 not the bytes sent", MemoryOpcode.MEMORY_WRITE,
         {"cdw10": 0, "cdw12": 4, "payload": bytes(8)}, Status.INVALID_FIELD),
        ("write: misaligned length", MemoryOpcode.MEMORY_WRITE,
         {"cdw10": 0, "cdw12": 6, "payload": bytes(6)}, Status.INVALID_FIELD),
        ("read: more than mxfer", MemoryOpcode.MEMORY_READ,
         {"cdw10": 0, "cdw12": SLM_MAX_TRANSFER + 4}, Status.INVALID_FIELD),
        ("fill: past the end", MemoryOpcode.MEMORY_FILL,
         {"cdw10": SLM_BYTES - 4, "cdw12": 8, "cdw13": 0xFFFFFFFF}, Status.INVALID_FIELD),
    ]
    for why, opcode, fields, status in cases:
        assert cp.submit(opcode, io=True, nsid=slm, **fields).status == status, why
        assert cp.read(slm, 0, SLM_BYTES) == before, why


def test_range_set_create_refuses_misaligned_and_out_of_bounds_ranges(rig: Rig) -> None:
    _, _, cp = rig
    compute, window = cp_setup(cp)
    for why, ranges, status in (
            ("misaligned start", [(window, 1, 4)], Status.INVALID_MEMORY_RANGE_SET),
            ("odd length", [(window, 0, 3)], Status.INVALID_MEMORY_RANGE_SET),
            ("empty", [(window, 0, 0)], Status.INVALID_MEMORY_RANGE_SET),
            ("out of bounds", [(window, CMB_BYTES - 2, 4)], Status.INVALID_MEMORY_RANGE_SET),
            ("reserved bytes", None, Status.INVALID_FIELD)):
        payload = encode_ranges(ranges) if ranges is not None else encode_ranges([(window, 0, 4)])[:16] + b"\x01" + bytes(15)
        completion = cp.submit(CpAdminOpcode.MEMORY_RANGE_SET_MANAGEMENT, nsid=compute, cdw10=0, cdw11=1,
                               payload=payload)
        assert completion.status == status, why
    # None of them made a set: the first set made now is 1.
    assert cp.create_range_set(compute, [(window, 0, 4)]) == 1


@pytest.mark.parametrize("blocks", [0, 1 << 16 | 1])
def test_the_client_refuses_block_counts_nlb_cannot_carry(rig: Rig, blocks: int) -> None:
    _, _, cp = rig
    slm = cp.ensure_namespace("slm0", "memory", capacity_bytes=SLM_BYTES)
    with pytest.raises(ValueError, match="NLB"):
        cp.copy_from_nvm(slm, 0, [(1, 0, blocks)])
