"""cossd.harness.bench: `cossd bench`'s sections (one module each), their devices and report, and the runner.

It may import every layer below tools (as the rest of cossd.harness may) and the harness's
shared helpers (measure.py, nvm_volume.py, served.py, netns.py, cgroups.py, ...). The runner's
names (run, and what the tests call: KernelBuffers, cossd_kernel, ...) are exported here but
imported when first used, so that a worker process started as
`python -m cossd.harness.bench.peers_worker` does not import every section with the package.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_exports

if TYPE_CHECKING:
    from .runner import *  # noqa: F401,F403

_RUNNER_NAMES = (
    "BENCH_SECTIONS", "BYTES_MOVED", "BYTES_PER_ELEMENT", "CHECKPOINT_NAMESPACE", "DEEPSPEED_INSTALL",
    "FILE_PATH_VARIANTS", "HYPER", "MOUNT_TURNS", "SWEEP_BYTES", "BenchDevice", "KernelBuffers",
    "add_bench_arguments", "chart", "checkpoint_costs", "checkpoint_volume", "cmb_rows", "cmb_step",
    "cossd_device_update", "cossd_kernel", "cossd_ordinary_stores", "deepspeed_cpuadam", "file_path_rows",
    "file_path_step", "filesystem_of", "kernel_row", "markdown", "ram_workdir", "ram_workdir_available",
    "restore_costs", "roofline_probe", "run", "split_run", "timed", "torch_adamw", "trainer_checkpoint_target",
    "_write_report",
)
# Each exported name, and the module (relative to this package) that defines it.
_EXPORTS = {name: ".runner" for name in _RUNNER_NAMES}

__all__ = sorted(name for name in _EXPORTS if not name.startswith("_"))

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
