"""cossd.kernels: stateless elementwise C kernels (Adam step, half<->FP32 conversion, non-finite count, CRC32C) behind a validating numpy wrapper.

The wrapper imports only numpy and cffi (plus the standard library). Every
function validates its buffers and raises KernelArgumentError instead of
copying: the kernels write into caller-owned memory, so a silent copy would
silently lose the result. Calls go through cffi's API mode, which releases the
GIL, so several threads may run kernels on disjoint buffers in parallel.

Modules, one job each (the public names are re-exported here; use them from here):
validation (formats, the error, buffer checks), hyper (hyperparameters and per-step
scalars), ops (the kernel wrappers), state_formats (the block-scaled FP16 and INT8 moments), dispatch (SIMD path selection, COSSD_KERNEL,
streaming stores); guard (the SIGBUS guard of the state-file mappings) stands apart.
The C sources are listed in _build.py; docs/kernels.md describes both.
"""

from __future__ import annotations

# The bindings, for the tests that call the C entry points directly (k._lib, k._ffi).
from ._cossd_kernels import ffi as _ffi  # noqa: F401
from ._cossd_kernels import lib as _lib  # noqa: F401
from .dispatch import (
    _apply_env,
    available_kernels,
    set_stream_threshold,
    simd_level,
    stream_plan,
    stream_threshold,
    use_kernel,
    use_simd,
)
from .hyper import AdamHyper, AdamScalars, adam_scalars
from .ops import (
    BlockUpdate,
    adam_step,
    adam_step_crc,
    adam_step_crcs,
    copy_count_nonfinite,
    count_nonfinite,
    crc32c,
    crc32c_blocks,
    crc32c_combine,
    master_to_param,
    param_to_master,
    stream_probe,
    stream_probe_out_of_place,
)
from .state_formats import (
    StateCounts,
    adam_step_q,
    adam_step_q_crcs,
    decode_state,
    encode_state,
    state_bytes_per_element,
    state_map,
    state_scale_count,
)
from .validation import (
    BLOCK_SCALED_FORMATS,
    GRAD_ITEMSIZE,
    STATE_BLOCK,
    GradFormat,
    HalfFormat,
    KernelArgumentError,
    Moment,
    StateFormat,
)

__all__ = [
    "HalfFormat",
    "GradFormat",
    "GRAD_ITEMSIZE",
    "StateFormat",
    "Moment",
    "BLOCK_SCALED_FORMATS",
    "STATE_BLOCK",
    "KernelArgumentError",
    "AdamHyper",
    "AdamScalars",
    "adam_scalars",
    "adam_step",
    "adam_step_crc",
    "adam_step_crcs",
    "BlockUpdate",
    "adam_step_q",
    "adam_step_q_crcs",
    "StateCounts",
    "encode_state",
    "decode_state",
    "state_map",
    "state_scale_count",
    "state_bytes_per_element",
    "copy_count_nonfinite",
    "count_nonfinite",
    "master_to_param",
    "param_to_master",
    "crc32c",
    "crc32c_blocks",
    "crc32c_combine",
    "stream_probe",
    "stream_probe_out_of_place",
    "simd_level",
    "available_kernels",
    "use_kernel",
    "use_simd",
    "stream_threshold",
    "set_stream_threshold",
    "stream_plan",
]

# The public names say they come from here, as before the split (reprs, pickles, docs), the
# way trio names its re-exports.
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith(__name__ + "."):
        _obj.__module__ = __name__
del _name, _obj

# COSSD_KERNEL caps the path once, when the package is first imported.
_apply_env()
