"""The NVMe Computational Programs (TP4091, CSI 04h) and Subsystem Local Memory (TP4131, CSI
03h) command sets as they travel: opcodes, fields and byte layouts, each declared once.

Where each value comes from is in docs/command-set.md ("The standard face"): the admin
opcodes are the base specification's (libnvme names the same three), the CSI values and the
Memory Copy LBA source formats libnvme's; the I/O command layouts, descriptors and the CP
Identify Namespace fields follow the SPDK prototype (hsung-yang/spdk: include/spdk/
nvme_cpcs_spec.h, "Computational Programs Command Set Specification, Revision 1.1", and its
SLM code); the SLM Identify Namespace layout and the rest are cossd's own, marked so there.
"""
from __future__ import annotations

import enum

import numpy as np

from .entries import MAX_PAYLOAD_BYTES

# Command set identifiers of the two namespace kinds (Identify CNS 05h takes one in CDW11;
# libnvme's enum nvme_csi: NVME_CSI_SLM 3, NVME_CSI_CP 4).
CSI_MEMORY = 0x03  # Subsystem Local Memory (a memory namespace)
CSI_COMPUTE = 0x04  # Computational Programs (a compute namespace)

# One .admin handle is one queue pair, and NVMe tells an I/O command from an admin command of
# the same opcode by its queue, which a submission does not carry. cossd marks a submission
# for the namespace's I/O command set with this bit of its flags byte (CDW0 bit 10, reserved
# in NVMe): SLM Read is 02h, which is Get Log Page on the admin queue.
IO_QUEUE_FLAG = 0x04

# Identify CNS 05h: the I/O command set specific Identify Namespace data structure; CDW11
# bits 31:24 hold the CSI.
IDENTIFY_CNS_CSI_NAMESPACE = 0x05
IDENTIFY_CSI_SHIFT = 24


class CpAdminOpcode(enum.IntEnum):
    """Admin opcodes of the Computational Programs command set (base specification)."""

    LOAD_PROGRAM = 0x85
    PROGRAM_ACTIVATION_MANAGEMENT = 0x88
    MEMORY_RANGE_SET_MANAGEMENT = 0x89


class ComputeOpcode(enum.IntEnum):
    """I/O opcodes on a compute namespace."""

    EXECUTE_PROGRAM = 0x01


class MemoryOpcode(enum.IntEnum):
    """I/O opcodes on a memory namespace (SLM)."""

    MEMORY_COPY = 0x01
    MEMORY_READ = 0x02
    MEMORY_FILL = 0x04
    MEMORY_WRITE = 0x05


class ActivationSelect(enum.IntEnum):
    """Program Activation Management CDW10 bits 19:16 (SEL)."""

    DEACTIVATE = 0x0
    ACTIVATE = 0x1


class RangeSetSelect(enum.IntEnum):
    """Memory Range Set Management CDW10 bits 3:0 (SEL)."""

    CREATE = 0x0
    DELETE = 0x1


class CopyFormat(enum.IntEnum):
    """Memory Copy CDW12 bits 11:8: what the source descriptors name (the prototype takes
    2h, 3h and 4h; 2h and 3h are the NVM Command Set's cross-namespace Copy formats)."""

    NVM_LBAS = 0x2  # LBA ranges of NVM namespaces, 16-bit protection tags (NVM_SOURCE_RANGE)
    NVM_LBAS_64 = 0x3  # the same with 64-bit protection tags (NVM_SOURCE_RANGE_64)
    MEMORY = 0x4  # byte ranges of memory namespaces (MEMORY_SOURCE_RANGE)


# Memory range descriptor: a byte range of a memory namespace (prototype: Figure 34).
MEMORY_RANGE = np.dtype([("mnsid", "<u4"), ("length", "<u4"), ("sb", "<u8"), ("reserved", "V16")])
assert MEMORY_RANGE.itemsize == 32, MEMORY_RANGE.itemsize

# Program descriptor (prototype: Figure 27). Byte 0: PEOCC bits 1:0, ACT bit 2, PIT bits 5:3.
PROGRAM_DESCRIPTOR = np.dtype([("flags", "u1"), ("ptype", "u1"), ("reserved1", "V6"), ("pid", "<u8"),
                               ("reserved2", "V48")])
assert PROGRAM_DESCRIPTOR.itemsize == 64, PROGRAM_DESCRIPTOR.itemsize
PEOCC_EMPTY = 0x0
PEOCC_DEVICE_DEFINED = 0x2  # cossd's value for a built-in program: not checked against the text
ACT_BIT = 1 << 2

# CP-specific Identify Namespace (prototype: Figure 36), the first 17 bytes of a 4096-byte page.
CP_IDENTIFY_NAMESPACE = np.dtype([("maxact", "<u2"), ("maxmemrs", "<u2"), ("mrsg", "<u2"), ("maxmemr", "u1"),
                                  ("reserved7", "u1"), ("maxpb", "<u8"), ("lpg", "u1")])
assert CP_IDENTIFY_NAMESPACE.itemsize == 17, CP_IDENTIFY_NAMESPACE.itemsize
# cossd's placement: the program descriptors (index 0 first) from this byte of the same page.
PROGRAM_TABLE_AT = 1024

# adamw_step's hyperparameters after the descriptors in an Execute's data (cossd's layout):
# optional; `group` 0xFFFFFFFF = every group.
ADAMW_HYPERPARAMETERS = np.dtype([("lr", "<f8"), ("beta1", "<f8"), ("beta2", "<f8"), ("eps", "<f8"),
                                  ("weight_decay", "<f8"), ("group", "<u4"), ("reserved", "V4")])
assert ADAMW_HYPERPARAMETERS.itemsize == 48, ADAMW_HYPERPARAMETERS.itemsize
ALL_GROUPS = 0xFFFFFFFF

# Memory Copy source descriptors. Formats 2h and 3h (libnvme's nvme_copy_range_f2 and
# nvme_copy_range_f3, the NVM Command Set's Copy): NLB + 1 blocks (0's based) of namespace
# SNSID from SLBA; the protection fields after SOPT are ignored (no protection information
# here). Format 4h (the prototype's spdk_nvme_slm_copy_desc_format_4): NBYTE bytes of memory
# namespace SNSID from byte SADDR.
NVM_SOURCE_RANGE = np.dtype([("snsid", "<u4"), ("reserved4", "V4"), ("slba", "<u8"), ("nlb", "<u2"),
                             ("cetype", "u1"), ("reserved19", "u1"), ("cev", "<u2"), ("sopt", "<u2"),
                             ("elbt", "<u4"), ("elbat", "<u2"), ("elbatm", "<u2")])
assert NVM_SOURCE_RANGE.itemsize == 32, NVM_SOURCE_RANGE.itemsize
NVM_SOURCE_RANGE_64 = np.dtype([("snsid", "<u4"), ("reserved4", "V4"), ("slba", "<u8"), ("nlb", "<u2"),
                                ("cetype", "u1"), ("reserved19", "u1"), ("cev", "<u2"), ("sopt", "<u2"),
                                ("reserved24", "V2"), ("elbt", "V10"), ("elbat", "<u2"), ("elbatm", "<u2")])
assert NVM_SOURCE_RANGE_64.itemsize == 40, NVM_SOURCE_RANGE_64.itemsize
MEMORY_SOURCE_RANGE = np.dtype([("snsid", "<u4"), ("reserved4", "V4"), ("saddr", "<u8"), ("nbyte", "<u4"),
                                ("reserved20", "V2"), ("sopt", "<u2"), ("reserved24", "V8")])
assert MEMORY_SOURCE_RANGE.itemsize == 32, MEMORY_SOURCE_RANGE.itemsize
COPY_SOURCE_LAYOUTS = {CopyFormat.NVM_LBAS: NVM_SOURCE_RANGE, CopyFormat.NVM_LBAS_64: NVM_SOURCE_RANGE_64,
                       CopyFormat.MEMORY: MEMORY_SOURCE_RANGE}
# SOPT bit 15, Fast Copy Only: honoured, every copy here is one memory copy (the prototype
# refuses it; cossd's reading).
SOPT_FAST_COPY_ONLY = 1 << 15
# An NVM namespace's one LBA format (LBADS 12): what a Memory Copy's NLB counts in.
NVM_LBA_BYTES = 4096

# SLM Identify Namespace (Identify CNS 05h, CSI 03h). The specification's layout is not public
# (libnvme says it does not define it; the prototype has none), so this one is cossd's own:
# the fields a host needs to address the namespace, in the first 21 bytes of a 4096-byte page.
SLM_IDENTIFY_NAMESPACE = np.dtype([("msz", "<u8"), ("mgran", "<u4"), ("mxfer", "<u4"), ("msrc", "<u2"),
                                   ("cfmts", "<u2"), ("mattr", "u1")])
assert SLM_IDENTIFY_NAMESPACE.itemsize == 21, SLM_IDENTIFY_NAMESPACE.itemsize
MATTR_CMB_WINDOW = 1 << 0  # the namespace is a window on the controller memory buffer
MATTR_VOLATILE = 1 << 1  # its bytes do not survive a restart (memory, not media)

# The built-in program: index 0, not downloadable, with a fixed program identifier.
ADAMW_PROGRAM_INDEX = 0
ADAMW_PROGRAM_ID = 0x0000_0001_C055_ADA3  # cossd's own identifier of adamw_step
ADAMW_PROGRAM_NAME = "adamw_step"
PROGRAM_TYPE_DEVICE_DEFINED = 0x00  # cossd's value: not checked against the text
# adamw_step's ranges come in groups of five, one group a span of elements:
ADAMW_ROLES = ("grad", "master", "exp_avg", "exp_avg_sq", "param_out")

# What a compute namespace reports (CP Identify Namespace).
MAX_ACTIVATED = 1  # maxact: the one program
MAX_RANGE_SETS = 64  # maxmemrs
# mrsg: ranges start and end on multiples of 2^MRSG bytes (the prototype's unit: its
# granularity is 1 << mrsg). 2 bytes, not a dword: a half-precision gradient of an odd number
# of elements must be nameable as one range.
RANGE_GRANULARITY_SHIFT = 1
RANGE_GRANULARITY = 1 << RANGE_GRANULARITY_SHIFT
MAX_RANGES = 250  # maxmemr (a u8): fifty groups of five
MAX_PROGRAM_BYTES = 0  # maxpb: no downloads
LOAD_GRANULARITY = 0  # lpg

# SLM I/O offsets and lengths are whole dwords.
SLM_ALIGN = 4
# The bytes one Memory Read or Write moves at most: a submission's payload (MAX_PAYLOAD_BYTES).
SLM_MAX_TRANSFER = MAX_PAYLOAD_BYTES
# A memory namespace's bytes at most (the shared memory that holds them).
MAX_MEMORY_BYTES = 1 << 40


def range_descriptors(data: bytes | memoryview, count: int) -> np.ndarray:
    """The first `count` memory range descriptors of `data` (a structured array)."""
    return np.frombuffer(data, dtype=MEMORY_RANGE, count=count)


def encode_ranges(ranges: list[tuple[int, int, int]]) -> bytes:
    """Descriptors for (mnsid, sb, length) triples, in order."""
    table = np.zeros(len(ranges), dtype=MEMORY_RANGE)
    for row, (mnsid, sb, length) in zip(table, ranges):
        row["mnsid"], row["sb"], row["length"] = mnsid, sb, length
    return table.tobytes()


def encode_hyperparameters(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                           group: int = ALL_GROUPS) -> bytes:
    block = np.zeros((), dtype=ADAMW_HYPERPARAMETERS)
    for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                        ("weight_decay", weight_decay), ("group", group)):
        block[name] = value
    return block.tobytes()
