"""The real drive under a backing directory: sysfs mapping to its disks, and `nvme smart-log` on NVMe."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

# nvmeXnY is an NVMe namespace (a disk); nvmeXnYpZ one of its partitions. nvmeXcYnZ are the
# hidden per-path devices of native multipath: their disk is the head nvmeXnZ, which sysfs
# shows as the device, so they never come out of a mapping.
NVME_NAMESPACE = re.compile(r"nvme\d+n\d+")
NVME_PARTITION = re.compile(r"(nvme\d+n\d+)p\d+")
MAX_DEPTH = 16  # dm over md over partitions is 3 levels; this only stops a looping tree
NVME_TIMEOUT_S = 30.0


@dataclasses.dataclass
class BackingDevice:
    """Where a directory's bytes live: its filesystem, its block device, the disks below it."""

    path: str
    fstype: str | None  # from mountinfo; None if the mount was not found
    source: str | None  # the mount's source field ("/dev/vda", "tmpfs", ...)
    device: str | None  # the block device of the filesystem; None for tmpfs and the like
    disks: list[str]  # whole disks under `device`: partitions to their disk, dm/md to their slaves
    nvme: list[str]  # the NVMe namespaces among `disks`, as /dev/nvmeXnY

    def describe(self) -> str:
        """One line for people: where the backing directory is."""
        if self.device is None:
            return f"{self.path} is on {self.fstype or 'an unknown filesystem'}, no block device"
        below = [disk for disk in self.disks if disk != self.device]
        return f"{self.path} is on {self.device}" + (f" (over {', '.join(below)})" if below else "")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _dev_name(node: Path) -> str:
    """The /dev name of a sysfs block node: DEVNAME from its uevent, else the directory name."""
    uevent = _read(node / "uevent") or ""
    for line in uevent.splitlines():
        key, _, value = line.partition("=")
        if key == "DEVNAME" and value:
            return value
    return node.name


def _disks_below(node: Path, depth: int = 0) -> list[Path]:
    """The whole-disk sysfs nodes that hold a block device's data."""
    if depth > MAX_DEPTH:
        return []
    if (node / "partition").exists():
        # A partition's sysfs directory sits inside its disk's.
        return _disks_below(node.parent, depth + 1)
    slaves = node / "slaves"
    below = sorted(slaves.iterdir()) if slaves.is_dir() else []
    if not below:
        return [node]
    # dm (LVM, crypt) and md (RAID) devices: their slaves are partitions or other stacked
    # devices, each listed as a link to its own sysfs node.
    disks: list[Path] = []
    for slave in below:
        for disk in _disks_below(slave.resolve(), depth + 1):
            if disk not in disks:
                disks.append(disk)
    return disks


def map_dev(major: int, minor: int, sysfs: Path = Path("/sys")) -> tuple[str, list[str]] | None:
    """(block device, whole disks below it) of device number major:minor; None if sysfs has no
    block device by that number (tmpfs, overlay, NFS: anonymous device numbers)."""
    link = sysfs / "dev" / "block" / f"{major}:{minor}"
    if not link.exists():
        return None
    node = link.resolve()
    disks = [f"/dev/{_dev_name(disk)}" for disk in _disks_below(node)]
    return f"/dev/{_dev_name(node)}", disks


def _mount_of(dev: str, mountinfo: Path) -> tuple[str, str] | None:
    """(fstype, source) of the mount whose device number (field 3) is `dev` ("MAJ:MIN")."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, separator, fs_fields = line.partition(" - ")
        parts, fs = fields.split(), fs_fields.split()
        if separator and len(parts) > 2 and len(fs) > 1 and parts[2] == dev:
            return fs[0], fs[1].replace("\\040", " ")
    return None


def locate(path: str | os.PathLike[str], *, sysfs: Path = Path("/sys"),
           mountinfo: Path = Path("/proc/self/mountinfo")) -> BackingDevice:
    """Map a directory to its block device and disks through its st_dev and sysfs."""
    st_dev = os.stat(path).st_dev
    number = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    fstype, source = _mount_of(number, mountinfo) or (None, None)
    mapped = map_dev(os.major(st_dev), os.minor(st_dev), sysfs)
    if mapped is None and source and source.startswith("/dev/"):
        # Filesystems such as btrfs give files an anonymous st_dev; their mount's source
        # still names the block device.
        try:
            source_stat = os.stat(source)
        except OSError:
            source_stat = None
        if source_stat is not None and stat.S_ISBLK(source_stat.st_mode):
            mapped = map_dev(os.major(source_stat.st_rdev), os.minor(source_stat.st_rdev), sysfs)
    device, disks = mapped if mapped else (None, [])
    nvme = [disk for disk in disks if NVME_NAMESPACE.fullmatch(Path(disk).name)]
    return BackingDevice(str(path), fstype, source, device, disks, nvme)


# cossd answers as nvme-cli when run as `nvme` (tools/cli.py); such an `nvme` on PATH (a symlink
# to cossd's entry point, or a wrapper script that runs cossd) is not the real nvme-cli, and
# asking it about /dev/nvmeXnY would only fail. Its first bytes name cossd; nvme-cli's do not.
COSSD_MARK = b"cossd"
SNIFF_BYTES = 4096


def is_cossd(executable: str) -> bool:
    """Whether an executable is cossd itself (its entry point or a script that runs it)."""
    try:
        with open(os.path.realpath(executable), "rb") as stream:
            return COSSD_MARK in stream.read(SNIFF_BYTES)
    except OSError:
        return False


def find_nvme_cli(nvme: str = "nvme") -> str | None:
    """The nvme-cli executable: `nvme` (a name on PATH, or a path), passing over cossd itself."""
    if os.sep in nvme:
        candidates = [nvme]
    else:
        candidates = [os.path.join(directory or os.curdir, nvme)
                      for directory in os.environ.get("PATH", os.defpath).split(os.pathsep)]
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and not is_cossd(candidate):
            return candidate
    return None


def nvme_smart_log(device: str, nvme: str = "nvme") -> dict[str, Any]:
    """`nvme smart-log DEVICE -o json`, parsed. Raises FileNotFoundError without nvme-cli and
    RuntimeError when it fails."""
    executable = find_nvme_cli(nvme)
    if executable is None:
        raise FileNotFoundError(nvme)
    try:
        result = subprocess.run([executable, "smart-log", device, "-o", "json"], capture_output=True,
                                text=True, timeout=NVME_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"nvme smart-log {device} did not answer within {NVME_TIMEOUT_S:g} s") from None
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1:] or [f"exit {result.returncode}"]
        raise RuntimeError(f"nvme smart-log {device} failed: {reason[0]}")
    try:
        parsed = json.loads(result.stdout)
    except ValueError:
        raise RuntimeError(f"nvme smart-log {device} printed no JSON") from None
    if not isinstance(parsed, dict):
        raise RuntimeError(f"nvme smart-log {device} printed JSON that is not an object")
    return parsed


def media_report(backing: str | os.PathLike[str], *, sysfs: Path = Path("/sys"),
                 mountinfo: Path = Path("/proc/self/mountinfo"), nvme: str = "nvme") -> dict[str, Any]:
    """The `media` section of `cossd smart-log --media`.

    `status` is "nvme" (smart_log holds nvme-cli's JSON per device), "not_nvme", "no_block_device",
    "nvme_cli_missing" or "failed" (only the last is an error).
    """
    where = locate(backing, sysfs=sysfs, mountinfo=mountinfo)
    report: dict[str, Any] = {"backing": str(backing), "fstype": where.fstype, "device": where.device,
                              "disks": where.disks, "nvme_devices": where.nvme, "smart_log": {}}
    if where.device is None:
        return report | {"status": "no_block_device", "message": where.describe()}
    if not where.nvme:
        return report | {"status": "not_nvme", "message": f"{where.describe()}, not an NVMe device"}
    lines = []
    for device in where.nvme:
        try:
            report["smart_log"][device] = nvme_smart_log(device, nvme)
        except FileNotFoundError:
            return report | {"status": "nvme_cli_missing", "message": (
                f"{where.describe()} (NVMe), but nvme-cli is not installed: no `{nvme}` on PATH "
                "other than cossd's own (Debian/Ubuntu: apt-get install nvme-cli)")}
        except RuntimeError as exc:
            return report | {"status": "failed", "message": f"{where.describe()} (NVMe): {exc}"}
        lines.append(device)
    return report | {"status": "nvme", "message": f"{where.describe()}: nvme smart-log of {', '.join(lines)}"}


def render_media(report: dict[str, Any]) -> str:
    """The second section of `cossd smart-log --media`: one line, then each drive's figures."""
    lines = [f"media: {report['message']}"]
    for device, smart in report["smart_log"].items():
        lines += ["", f"Smart Log for NVME device:{Path(device).name} namespace-id:ffffffff"]
        lines += [f"{key:<40}: {json.dumps(value) if isinstance(value, (dict, list)) else value}"
                  for key, value in smart.items()]
    return "\n".join(lines)
