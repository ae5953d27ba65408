"""The GPU node's bundle: what the cossd wheel is built from, the manifest, the fuse3 .debs unpacked without dpkg.

Standard library only, beside tools/gpu_node_run.py (which imports it as a plain script's
neighbour): tools/gpu_bundle.sh writes the manifest through that script, the node checks it.
"""
from __future__ import annotations

import hashlib
import io
import json
import platform
import re
import sys
import tarfile
import time
from pathlib import Path

# What the cossd wheel is built from (with pyproject's package-dir), to tell a stale bundle.
SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md")
SOURCE_SUFFIXES = (".py", ".c", ".h")
# Not cossd's code: the generated kernel C, and this run's own scripts (editing them needs no new wheel).
NOT_SOURCES = ("kernels/_cossd_kernels.c", "tools/gpu_node_run.py", "tools/gpu_node_bundle.py")
# The node-side set: cossd and its [test] extra without torch, which is the node's own build.
REQUIREMENTS = ("pytest>=8", "hypothesis>=6.100", "safetensors>=0.4", "tqdm>=4.66", "matplotlib>=3.8")


class Failed(Exception):
    """A missing piece: the run stops there, says what, and exits 1."""


def source_dirs(root: Path) -> list[str]:
    """The folders pyproject.toml maps cossd's packages to."""
    import tomllib  # 3.11: imported here so an older Python gets to the version check's message

    with open(root / "pyproject.toml", "rb") as stream:
        return sorted(set(tomllib.load(stream)["tool"]["setuptools"]["package-dir"].values()))


def source_digests(root: Path) -> dict[str, str]:
    """SHA-256 of each source the cossd wheel is built from, by path."""
    paths = [root / name for name in SOURCE_FILES]
    for top in source_dirs(root):
        paths += [p for p in (root / top).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()
                  and "__pycache__" not in p.parts and p.relative_to(root).as_posix() not in NOT_SOURCES]
    return {path.relative_to(root).as_posix(): sha256_of(path) for path in sorted(paths)}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def symbols_needed(paths: list[Path], library: bytes) -> str:
    """The highest LIBRARY_x.y symbol version (GLIBC, FUSE) the shared objects in these wheels ask for."""
    import zipfile

    found = [(0, 0)]
    for wheel in paths:
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.endswith(".so") or ".so." in name:
                    found += [(int(a), int(b)) for a, b in
                              re.findall(library + rb"_(\d+)\.(\d+)", archive.read(name))]
    return "%d.%d" % max(found)


def write_manifest(bundle: Path, libfuse3_version: str, source_root: Path) -> None:
    """What the node checks before installing: its Python, glibc, the sources, every file's hash."""
    wheels = sorted((bundle / "wheels").glob("*.whl"))
    local = [w for w in wheels if w.name.endswith("linux_x86_64.whl") and "manylinux" not in w.name]
    manifest = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(), "cache_tag": sys.implementation.cache_tag,
        "machine": platform.machine(), "glibc_built_on": platform.libc_ver()[1],
        "glibc_needed": symbols_needed(local, b"GLIBC"), "libfuse3": libfuse3_version,
        # Any libfuse3.so.3 serves pyfuse3 when this is 3.0: its symbols are all from the 3.0 ABI.
        "libfuse3_symbols_needed": symbols_needed(local, b"FUSE"),
        "sources": source_digests(source_root),
        "files": {f"{p.parent.name}/{p.name}": sha256_of(p) for p in [*wheels, *sorted((bundle / "debs").glob("*.deb"))]},
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def extract_deb(deb: Path, target: Path) -> None:
    """Unpack a .deb's files (an ar archive holding data.tar.*) with no dpkg: no root, nothing system-wide."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise Failed(f"{deb} is not a .deb")
    offset = 8
    while offset < len(data):
        name, size = data[offset:offset + 16].decode().strip().rstrip("/"), int(data[offset + 48:offset + 58])
        body = data[offset + 60:offset + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body)) as archive:
                try:
                    archive.extractall(target, filter="tar")
                except TypeError:  # a Python before 3.11.4 has no filter (and trusts the archive anyway)
                    archive.extractall(target)
            return
        offset += 60 + size + size % 2
    raise Failed(f"{deb} has no data.tar member")
