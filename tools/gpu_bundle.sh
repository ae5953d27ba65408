#!/usr/bin/env bash
# Builds the offline install bundle for a GPU node without a package index (docs/benchmarks.md,
# "A GPU node without a package index"): wheels, fuse3 .debs and a manifest, into one folder.
#
#   tools/gpu_bundle.sh [BUNDLE_DIR]     default build/gpu-bundle; PY=... picks the interpreter
#
# Run it on a machine that reaches the package index, with the node's Python version (the
# wheels of pyfuse3, cffi, numpy and cossd are for one CPython version). The node runs
# `python3 tools/gpu_node_run.py BUNDLE_DIR` from a copy of the same working tree.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUNDLE="${1:-$ROOT/build/gpu-bundle}"
PY="${PY:-$ROOT/.venv/bin/python}"
cd "$ROOT"

say() { echo "== gpu-bundle: $*"; }
die() { echo "gpu-bundle: FAILED: $*" >&2; exit 1; }

# The folder is emptied before the build: only ever one this script made. That is an empty
# or new one, a finished bundle (manifest.json), or what a failed build left (only the
# entries below; the manifest is written last), never a folder someone named by mistake.
if [ -e "$BUNDLE" ] || [ -L "$BUNDLE" ]; then
  [ ! -L "$BUNDLE" ] || die "$BUNDLE is a symbolic link (it would be removed, not its folder): give the folder itself"
  [ -d "$BUNDLE" ] || die "$BUNDLE exists and is not a folder: give a new or empty folder"
  if [ ! -f "$BUNDLE/manifest.json" ]; then
    foreign=()
    while IFS= read -r -d '' entry; do
      case "${entry##*/}" in
        wheels|debs|build.log) ;;
        *) foreign+=("${entry##*/}") ;;
      esac
    done < <(find "$BUNDLE" -mindepth 1 -maxdepth 1 -print0)
    [ "${#foreign[@]}" -eq 0 ] || die "$BUNDLE is not empty and holds no bundle (no manifest.json; it has" \
      "${foreign[*]:0:5}${foreign[5]+ ...}): it would be wiped. Give a new or empty folder, or the folder of an earlier bundle"
  fi
fi

# Versions as the project's venv has them: the bundle is the set the tests passed with here.
pinned() {  # pinned NAME -> NAME==VERSION from $PY's environment, or NAME when it has none
  "$PY" -c 'import sys, importlib.metadata as m
try: print(f"{sys.argv[1]}=={m.version(sys.argv[1])}")
except m.PackageNotFoundError: print(sys.argv[1])' "$1"
}

say "checking what the build needs"
[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no Python at $PY (run make install, or set PY=)"
"$PY" -m pip --version >/dev/null || die "$PY has no pip"
command -v gcc >/dev/null || die "no gcc: pyfuse3 and the cossd kernels are compiled here"
pkg-config --exists fuse3 || die "no libfuse3-dev (pkg-config fuse3): make system-deps"
command -v apt-get >/dev/null && command -v dpkg-query >/dev/null || die "no apt-get: the fuse3 .debs come from apt"
FUSE_VERSION="$(dpkg-query -W -f='${Version}' libfuse3-3)" || die "libfuse3-3 is not installed as a .deb"

# Every download goes through pip's and apt's own configuration (this machine's mirror);
# what the node installs is then only this folder.
rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/wheels" "$BUNDLE/debs"
BUNDLE="$(cd "$BUNDLE" && pwd)"

say "building pyfuse3 against this machine's libfuse3 $FUSE_VERSION"
"$PY" -m pip wheel -q --no-deps -w "$BUNDLE/wheels" "$(pinned pyfuse3)" >"$BUNDLE/build.log" 2>&1 \
  || { tail -20 "$BUNDLE/build.log"; die "pyfuse3 did not build"; }

say "building cossd from this working tree, its C kernels for $("$PY" -c 'import sys; print(sys.implementation.cache_tag)')"
BUILD_TMP="$(mktemp -d)"
trap 'rm -rf "$BUILD_TMP"' EXIT
# A private copy to build in: others may be building in this tree at the same time, and
# pip's in-tree build would leave its build/ and egg-info behind.
tar -C "$ROOT" --exclude=__pycache__ --exclude='*.so' --exclude='*.egg-info' --exclude=_cossd_kernels.c \
  -cf - $("$PY" "$ROOT/tools/gpu_node_run.py" --source-dirs) | tar -C "$BUILD_TMP" -xf -
# With the build tools $PY has (a `make install` venv's), else pip fetches them from the index.
isolation=(--no-build-isolation)
"$PY" -c 'import cffi, setuptools, wheel' 2>/dev/null || isolation=()
"$PY" -m pip wheel -q --no-deps ${isolation[@]+"${isolation[@]}"} -w "$BUNDLE/wheels" "$BUILD_TMP" >>"$BUNDLE/build.log" 2>&1 \
  || { tail -20 "$BUNDLE/build.log"; die "cossd did not build"; }

say "downloading the binary wheels of cossd's dependencies and the node's test tools"
# torch is not here: the node has its own CUDA build, and cossd needs no particular torch.
# pip, setuptools and wheel: a Debian python3 without python3-venv makes venvs without pip.
# The test tools come from cossd's [test] and [trainer] extras; matplotlib draws bench.png.
names=(numpy cffi pycparser trio prometheus-client tqdm matplotlib pytest hypothesis safetensors pip setuptools wheel)
reqs=()
for name in "${names[@]}"; do reqs+=("$(pinned "$name")"); done
"$PY" -m pip download -q --only-binary :all: -d "$BUNDLE/wheels" "${reqs[@]}" \
  || die "a wheel could not be downloaded"

say "downloading fuse3 and libfuse3-3 $FUSE_VERSION (the ABI pyfuse3 was built against)"
(cd "$BUNDLE/debs" && apt-get download -q -o APT::Sandbox::User=root "fuse3=$FUSE_VERSION" "libfuse3-3=$FUSE_VERSION") \
  || die "apt-get download of fuse3/libfuse3-3 $FUSE_VERSION failed (apt-get update first?)"

say "checking that the node's install resolves from this folder alone"
# The node installs exactly this set; --ignore-installed so nothing of this venv helps.
PIP_CONFIG_FILE=/dev/null "$PY" -m pip install -q --dry-run --ignore-installed --no-index \
  --find-links "$BUNDLE/wheels" -r <("$PY" "$ROOT/tools/gpu_node_run.py" --requirements) \
  || die "the bundle's wheels do not resolve on their own"

say "writing the manifest"
# The digest of the very copy the wheel was built from, however this tree moved since.
"$PY" "$ROOT/tools/gpu_node_run.py" --write-manifest "$BUNDLE" --libfuse3-version "$FUSE_VERSION" \
  --source-root "$BUILD_TMP" \
  || die "the manifest could not be written"

say "done: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1), $(ls "$BUNDLE/wheels" | wc -l) wheels, $(ls "$BUNDLE/debs" | wc -l) debs)"
