"""Get Features (0Ah) and Set Features (09h) as they travel: identifiers, fields, values."""
from __future__ import annotations

import enum


class FeatureId(enum.IntEnum):
    """cdw10 bits 7:0: NVMe's own identifiers, then the vendor range (C0h-FFh)."""

    TEMPERATURE_THRESHOLD = 0x04
    NUMBER_OF_QUEUES = 0x07
    HYPERPARAMETERS = 0xC0  # of one namespace
    DEVICE_SETTINGS = 0xC1  # durability mode and kernel path


class Select(enum.IntEnum):
    """Get Features cdw10 bits 10:8 (SEL)."""

    CURRENT = 0
    DEFAULT = 1
    SAVED = 2
    SUPPORTED_CAPABILITIES = 3


# Supported capabilities (SEL 3), returned in the completion's result dword as NVMe defines.
CAP_SAVEABLE = 1 << 0
CAP_NAMESPACE_SPECIFIC = 1 << 1
CAP_CHANGEABLE = 1 << 2
SAVE_BIT = 1 << 31  # Set Features cdw10 bit 31 (SV)
ALL_GROUPS = 0xFFFFFFFF  # C0h cdw11: every hyperparameter group

# Temperature threshold (04h) cdw11 / result: TMPTH 15:0 (Kelvin), TMPSEL 19:16, THSEL 21:20.
TMPSEL_COMPOSITE = 0x0
TMPSEL_ALL = 0xF  # set only: every sensor the device has (here: the composite one)
THSEL_OVER, THSEL_UNDER = 0, 1

# Number of queues (07h): each open() of .admin is one queue pair, opened rather than
# allocated, with no limit below what the field can say: 65535 (FFFEh, 0's based) each way.
QUEUE_PAIRS_0S_BASED = 0xFFFE

DURABILITY_MODES = ("sync", "plp")
KERNEL_CHOICES = ("auto", "scalar", "avx2", "avx512")
