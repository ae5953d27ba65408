"""A GPU node without a package index: install cossd from the bundle alone, run the CUDA checks and benches into one JSON."""
from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Iterator

# Standard library only: this runs under the node's Python before anything is installed.
# A plain script (`python3 tools/gpu_node_run.py`): its folder is sys.path[0], so its
# neighbour is imported by its own name, as tools/gpu_bundle.sh's copy of the tree has it.
from gpu_node_bundle import (
    REQUIREMENTS,
    SOURCE_FILES,
    Failed,
    extract_deb,
    sha256_of,
    source_digests,
    source_dirs,
    write_manifest,
)

ROOT = Path(__file__).resolve().parent.parent
CUDA_TESTS = ("tests/e2e/test_trainer.py::test_cuda_model_steps_like_a_cpu_model",
              "tests/e2e/test_trainer.py::test_cuda_streaming_on_a_side_stream_steps_like_the_cpu")
# Quick tests through a real mount that need no GPU: they show the install works at all.
CPU_TESTS = ("tests/e2e/test_trainer.py::test_streaming_equals_step_time_transfer",
             "tests/cli/test_cli.py::test_bench_device_cuda_without_a_gpu_says_so")
SIZES = (16 << 20, 128 << 20)
DRY_RUN_SIZE = 1 << 20
NO_GPU = "no GPU present: CUDA parts skipped"


class Run:
    """The node run: each step announced and timed, the JSON rewritten after each one."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.started = args, time.monotonic()
        self.out: Path = args.out
        self.report: dict[str, Any] = {"mode": "cpu-dry-run" if args.cpu_dry_run else "gpu",
                                       "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "ok": False, "failed_step": None, "steps": {}}
        self.env = dict(os.environ)

    def remaining(self) -> float:
        left = self.args.budget_s - (time.monotonic() - self.started)
        if left <= 0:
            raise Failed(f"the run's budget of {self.args.budget_s:.0f} s is spent")
        return left

    def save(self) -> None:
        self.report["total_seconds"] = round(time.monotonic() - self.started, 1)
        (self.out / "gpu-node.json").write_text(json.dumps(self.report, indent=2) + "\n")

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        print(f"== gpu-node [{time.monotonic() - self.started:5.0f} s] {name}", flush=True)
        row: dict[str, Any] = {}
        began = time.monotonic()
        try:
            yield row
        except (Failed, subprocess.SubprocessError, OSError, ValueError, KeyError) as error:
            row.update(ok=False, error=str(error), seconds=round(time.monotonic() - began, 1))
            self.report["steps"][name] = row
            self.report["failed_step"] = name
            self.save()
            print(f"\ngpu-node: FAILED at '{name}': {error}\n(partial results: {self.out / 'gpu-node.json'})",
                  file=sys.stderr, flush=True)
            raise SystemExit(1) from error
        row.update(ok=True, seconds=round(time.monotonic() - began, 1))
        self.report["steps"][name] = row
        self.save()

    def sh(self, *command: str | Path, check: bool = True, log: str | None = None) -> subprocess.CompletedProcess:
        """Run a command in the run's environment, within what is left of the budget."""
        text = [str(c) for c in command]
        try:
            done = subprocess.run(text, env=self.env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=self.remaining())
        except subprocess.TimeoutExpired as error:
            raise Failed(f"{text[0]} ran past the run's budget ({self.args.budget_s:.0f} s)") from error
        except FileNotFoundError as error:
            raise Failed(f"{text[0]} is missing") from error
        if log:
            (self.out / log).write_text(f"$ {' '.join(text)}\n{done.stdout}\n{done.stderr}")
        if check and done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise Failed(f"{' '.join(text)} exited {done.returncode}:\n  " + "\n  ".join(tail))
        return done


# Where a node's CUDA torch usually is, after the Python running this script.
PYTHON_CANDIDATES = ("python3.11", "python3", "python", "/opt/conda/bin/python", "/usr/local/bin/python3",
                     "/usr/bin/python3")
PROBE = ("import json, sys, site\n"
         "info = {'python': sys.version.split()[0], 'cache_tag': sys.implementation.cache_tag, 'torch': None,"
         " 'site': site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])}\n"
         "try:\n    import torch\nexcept Exception as error:\n    info['error'] = repr(error)\n"
         "else:\n    cuda = torch.cuda.is_available()\n"
         "    info.update(torch=torch.__version__, torch_file=torch.__file__, torch_cuda=torch.version.cuda,"
         " cuda_available=cuda, gpus=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]"
         " if cuda else [])\n"
         "print(json.dumps(info))")


def find_node_python(run: Run, wanted: str | None, cache_tag: str) -> tuple[str, dict[str, Any]]:
    """The node's Python with torch and the bundle's version: --python, else the first that fits."""
    names = [wanted] if wanted else [sys.executable, *PYTHON_CANDIDATES]
    seen: set[str] = set()
    found: dict[str, Any] = {}
    for name in names:
        path = shutil.which(name) or (name if os.path.isfile(name) else None)
        if path is None or os.path.realpath(path) in seen:
            continue
        seen.add(os.path.realpath(path))
        done = run.sh(path, "-c", PROBE, check=False)
        info = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr}
        found[path] = {k: info.get(k) for k in ("python", "cache_tag", "torch", "error")}
        if info.get("torch") and info["cache_tag"] == cache_tag:
            return path, info
    raise Failed(f"no Python here has torch and is {cache_tag}, the bundle's version (build the bundle with the "
                 f"node's: PY=pythonX.Y tools/gpu_bundle.sh; or name it with --python): {found}")


def junit_outcomes(path: Path) -> dict[str, str]:
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        reason = next((child.get("message", "") for child in case if child.tag == "skipped"), "")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = kind + (f" ({reason})" if reason else "")
    return outcomes


def node_run(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    work = Path(tempfile.mkdtemp(prefix="cossd-gpu-node-", dir=args.work))
    try:
        return run_steps(run, args, work)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)


def run_steps(run: Run, args: argparse.Namespace, work: Path) -> int:
    """The steps, in order; the first that fails ends the run (Run.step exits 1)."""
    bundle: Path = args.bundle.resolve()
    dry = args.cpu_dry_run
    with run.step("bundle: manifest and every file's hash") as row:
        manifest_path = bundle / "manifest.json"
        if not manifest_path.is_file():
            raise Failed(f"no {manifest_path}: build the bundle with `make gpu-bundle` and carry it here")
        manifest = json.loads(manifest_path.read_text())
        for name, digest in manifest["files"].items():
            if not (bundle / name).is_file() or sha256_of(bundle / name) != digest:
                raise Failed(f"{bundle / name} is missing or not the file the bundle was built with")
        run.report["bundle"] = {k: manifest[k] for k in ("created", "python", "glibc_needed", "libfuse3",
                                                          "libfuse3_symbols_needed")}
        row["files"] = len(manifest["files"])
    with run.step("python and glibc match the bundle's") as row:
        if platform.machine() != manifest["machine"]:
            raise Failed(f"the bundle's wheels are for {manifest['machine']}, this node is {platform.machine()}")
        python, info = find_node_python(run, args.python, manifest["cache_tag"])
        glibc = platform.libc_ver()[1]
        if tuple(map(int, glibc.split("."))) < tuple(map(int, manifest["glibc_needed"].split("."))):
            raise Failed(f"glibc {glibc} here, the bundle's compiled wheels need {manifest['glibc_needed']}")
        row.update(python=f"{info['python']} at {python}", glibc=glibc)
    with run.step("torch and the GPU") as row:
        row.update({k: info[k] for k in ("torch", "torch_cuda", "cuda_available", "gpus")})
        smi = shutil.which("nvidia-smi")
        if smi:
            query = run.sh(smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader", check=False)
            row["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
        if not info["cuda_available"]:
            if not dry:
                raise Failed(f"torch {info['torch']} at {info['torch_file']} sees no CUDA device "
                             f"(CUDA build: {info['torch_cuda']}); --cpu-dry-run runs the rest without one")
            row["note"] = NO_GPU
            print(f"   {NO_GPU}", flush=True)
        run.report["machine"] = {"gpus": info["gpus"], "torch": info["torch"], "torch_cuda": info["torch_cuda"],
                                 "python": info["python"], "glibc": glibc, "cores": len(os.sched_getaffinity(0)),
                                 "cpu": next((line.split(":", 1)[1].strip() for line in
                                              Path("/proc/cpuinfo").read_text().splitlines()
                                              if line.startswith("model name")), platform.processor()),
                                 "nvidia_smi": row.get("nvidia_smi")}
    with run.step("FUSE: /dev/fuse, fusermount3, libfuse3") as row:
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
        except OSError as error:
            raise Failed(f"cannot open /dev/fuse ({error.strerror}): cossd serves through FUSE; load the fuse "
                         "module, or start the container with --device /dev/fuse --cap-add SYS_ADMIN") from error
        has_lib = ctypes.util.find_library("fuse3") is not None
        if args.bundled_fuse or not shutil.which("fusermount3") or not has_lib:
            if os.geteuid() != 0:
                raise Failed("this node lacks fuse3/libfuse3, and the bundle's fusermount3 (not setuid once "
                             "unpacked) only works as root: install the bundle's debs/ with dpkg -i, or run as root")
            for deb in sorted((bundle / "debs").glob("*.deb")):
                extract_deb(deb, work / "fuse3")
            bins = {p.parent for p in (work / "fuse3").rglob("fusermount3")}
            libs = {p.parent for p in (work / "fuse3").rglob("libfuse3.so.3")}
            if not bins or not libs:
                raise Failed(f"the debs in {bundle / 'debs'} hold no fusermount3 or libfuse3.so.3")
            run.env["PATH"] = os.pathsep.join([*map(str, bins), run.env.get("PATH", "")])
            run.env["LD_LIBRARY_PATH"] = os.pathsep.join([*map(str, libs), run.env.get("LD_LIBRARY_PATH", "")])
            row["from_bundle"] = sorted(p.name for p in (bundle / "debs").glob("*.deb"))
        else:
            row["from_node"] = "fusermount3 and libfuse3.so.3"
    venv = work / "venv"
    vpy = venv / "bin" / "python"
    # pip reads nothing but the bundle: no config file (a node's may name a mirror), no PIP_* variables.
    for key in [k for k in run.env if k.startswith("PIP_")]:
        del run.env[key]
    run.env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip_from_bundle = ("--no-index", "--find-links", bundle / "wheels")
    with run.step("venv on the node's Python (its torch visible)") as row:
        # Not --system-site-packages: that is the base interpreter's, and the node's torch may
        # live in a venv, a conda env or ~/.local. A .pth below adds exactly what the node's
        # Python sees, after the venv's own site-packages.
        made = run.sh(python, "-m", "venv", venv, check=False)
        if made.returncode != 0:  # Debian's python3 without python3-venv has no ensurepip
            shutil.rmtree(venv, ignore_errors=True)
            run.sh(python, "-m", "venv", "--without-pip", venv)
            wheel = next((bundle / "wheels").glob("pip-*.whl"), None)
            if wheel is None:
                raise Failed("no pip wheel in the bundle to put pip into the venv")
            run.sh(vpy, f"{wheel}/pip", "install", "-q", *pip_from_bundle, "pip")
            row["pip"] = "from the bundle (no ensurepip here)"
        # A recent pip from the bundle: the node's ensurepip may predate --report.
        run.sh(vpy, "-m", "pip", "install", "-q", *pip_from_bundle, "--upgrade", "pip", log="pip-upgrade.log")
        purelib = Path(run.sh(vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
        (purelib / "node-site.pth").write_text("\n".join(info["site"]) + "\n")
    with run.step("cossd: the bundle's wheel if this tree is what it was built from") as row:
        wheel = next((bundle / "wheels").glob("cossd-*.whl"), None)
        if wheel is None:
            raise Failed(f"no cossd wheel in {bundle / 'wheels'}")
        here = source_digests(ROOT)
        row["sources_differing"] = sorted(name for name in here.keys() | manifest["sources"].keys()
                                          if here.get(name) != manifest["sources"].get(name))
        if not row["sources_differing"]:
            row["wheel"] = f"the bundle's {wheel.name}"
        else:
            # The tests run from this tree: they must test the cossd built from it.
            include = run.sh(vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])").stdout.strip()
            if not shutil.which("gcc") or not (Path(include) / "Python.h").is_file():
                raise Failed("cossd's sources here differ from those the bundle's wheel was built from, and this "
                             "node cannot build it (no gcc or no Python.h): run `make gpu-bundle` on this tree")
            run.sh(vpy, "-m", "pip", "install", "-q", *pip_from_bundle, "setuptools", "wheel", "cffi",
                   log="build-tools.log")
            copy = work / "cossd-src"
            copy.mkdir()
            for name in [*SOURCE_FILES, *source_dirs(ROOT)]:
                if (ROOT / name).is_dir():
                    shutil.copytree(ROOT / name, copy / name,
                                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_cossd_kernels.c"))
                else:
                    shutil.copy2(ROOT / name, copy / name)
            run.sh(vpy, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", *pip_from_bundle,
                   "-w", work / "wheels", copy, log="cossd-build.log")
            wheel = next((work / "wheels").glob("cossd-*.whl"))
            row["wheel"] = f"built here from this tree: {len(row['sources_differing'])} sources differ from the bundle's"
        print(f"   cossd: {row['wheel']}", flush=True)
    with run.step("pip install from the bundle only") as row:
        report_path = args.out / "pip-install-report.json"
        run.sh(vpy, "-m", "pip", "install", "-q", *pip_from_bundle, "--report", report_path, wheel,
               *REQUIREMENTS, log="pip-install.log")
        allowed = ((bundle / "wheels").as_uri() + "/", wheel.as_uri())
        installed = json.loads(report_path.read_text())["install"]
        stray = [item["download_info"]["url"] for item in installed
                 if not item["download_info"]["url"].startswith(allowed)]
        if stray:
            raise Failed(f"pip took something from outside the bundle: {stray}")
        row["from_bundle"] = sorted(f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installed)
        names = {i["metadata"]["name"].lower().replace("_", "-") for i in installed}
        # What pip left alone because the node already had it (a version that satisfies cossd).
        wanted = ["numpy", "cffi", "trio", "pyfuse3", "prometheus-client", *(re.split("[<>=]", r)[0] for r in REQUIREMENTS)]
        kept = [name for name in wanted if name not in names]
        probe = ("import json, sys, importlib.metadata as m\n"
                 "print(json.dumps({n: f'{m.version(n)} in {m.distribution(n).locate_file(\"\")}' for n in sys.argv[1:]}))")
        row["already_on_node"] = json.loads(run.sh(vpy, "-c", probe, *kept).stdout) if kept else {}
        seen = json.loads(run.sh(vpy, "-c", "import json, torch; print(json.dumps([torch.__version__, torch.__file__]))")
                          .stdout.strip())
        if seen[0] != info["torch"] or str(venv) in seen[1]:
            raise Failed(f"the venv's torch is {seen}, not the node's {info['torch']} at {info['torch_file']}")
    with run.step("smoke: cossd, its kernels, pyfuse3 on libfuse3, one mount") as row:
        probe = ("import json, pyfuse3, shutil\nfrom cossd import kernels\n"
                 "maps = open('/proc/self/maps').read().split()\n"
                 "print(json.dumps({'simd': kernels.simd_level(), 'pyfuse3': pyfuse3.__version__,"
                 " 'libfuse3': sorted({m for m in maps if 'libfuse3' in m}), 'fusermount3': shutil.which('fusermount3')}))")
        row.update(json.loads(run.sh(vpy, "-c", probe).stdout.strip().splitlines()[-1]))
        # One real mount before the long steps: a node whose container may not mount FUSE says so here.
        mount = ("import sys\nfrom pathlib import Path\nfrom cossd.emulator import Device\nfrom cossd.fs import daemon\n"
                 "work = Path(sys.argv[1])\nDevice.format(work / 'backing', capacity_bytes=1 << 30)\n"
                 "(work / 'mnt').mkdir()\npid = daemon.start_background(work / 'backing', work / 'mnt')\n"
                 "assert (work / 'mnt' / '.admin').exists(), 'the mount shows no .admin'\n"
                 "assert daemon.stop_background(work / 'mnt', pid), 'the daemon did not exit'\n")
        (work / "probe").mkdir()
        run.sh(vpy, "-c", mount, work / "probe", log="mount-probe.log")
        row["mount"] = "a device mounted, answered and unmounted"
    with run.step("tests: the CUDA ones, and quick CPU ones through a mount") as row:
        junit = args.out / "tests.xml"
        run.sh(vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", junit, *CUDA_TESTS, *CPU_TESTS,
               log="tests.log")
        outcomes = junit_outcomes(junit)
        row["outcomes"] = outcomes
        cuda = {k: v for k, v in outcomes.items() if "cuda" in k and "without_a_gpu" not in k}
        if len(cuda) < 3:
            raise Failed(f"expected 3 CUDA tests, found {sorted(cuda)}")
        if not dry and any(not v.startswith("passed") for v in cuda.values()):
            raise Failed(f"a CUDA test did not pass: {cuda}")
        if dry:
            row["note"] = NO_GPU
    with run.step("bit for bit: the same gradients stepped from CUDA and from the CPU") as row:
        check = args.out / "bitcheck.json"
        run.sh(vpy, Path(__file__).resolve(), "--bitcheck", str(DRY_RUN_SIZE if dry else SIZES[0]),
               "--bitcheck-device", "cpu" if dry else "cuda", "--bitcheck-json", check, log="bitcheck.log")
        result = json.loads(check.read_text())
        run.report["bitcheck"] = result
        if not result["identical"]:
            raise Failed(f"the params stepped from {result['device']} are not the CPU's bit for bit, or did not "
                         f"move: {result['variants']}")
        if dry:
            row["note"] = NO_GPU + " (the check ran CPU against CPU: the code path only)"
    run.report["bench"] = {}
    if dry:
        with run.step("bench --device cuda says there is no GPU") as row:
            done = run.sh(vpy, "-m", "cossd.tools.cli", "bench", "--sections", "trainer", "--device", "cuda",
                          "--output", work / "nobench", check=False)
            if done.returncode != 2 or "no CUDA device" not in done.stderr:
                raise Failed(f"cossd bench --device cuda without a GPU exited {done.returncode}: {done.stderr}")
            row["note"] = NO_GPU
    for n in [DRY_RUN_SIZE] if dry else SIZES:
        device = "cpu" if dry else "cuda"
        with run.step(f"bench --sections trainer --device {device}, {n:,} parameters"):
            target = args.out / f"bench-{n}"
            run.sh(vpy, "-m", "cossd.tools.cli", "bench", "--sections", "trainer", "--device", device,
                   "--file-elements", str(n), "--repeat", str(args.repeat), "--output", target, log=f"bench-{n}.log")
            run.report["bench"][str(n)] = json.loads((target / "bench.json").read_text())
    run.report["ok"] = True
    run.save()
    print(f"== gpu-node: all done in {run.report['total_seconds']} s; every figure in {args.out / 'gpu-node.json'}")
    return 0


def bitcheck(n: int, device_name: str, out: Path) -> int:
    """Step one BF16 tensor of n parameters from `device_name` and from the CPU with the same
    gradients, through the CMB and through the files; the params must agree bit for bit."""
    import torch

    from cossd.emulator import Device
    from cossd.fs import daemon
    from cossd.trainer import AdamW

    work = Path(tempfile.mkdtemp(prefix="cossd-bitcheck-"))
    Device.format(work / "backing", capacity_bytes=16 << 30, serial="GPUBITCHECK0001")
    (work / "mnt").mkdir()
    pid = daemon.start_background(work / "backing", work / "mnt")
    result: dict[str, Any] = {"parameters": n, "device": device_name, "steps": 3, "variants": {}}
    try:
        for variant, options in (("cmb", {}), ("files", {"use_cmb": False})):
            torch.manual_seed(0)
            here = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
            there = torch.nn.Parameter(here.detach().clone().to(device_name))
            mine = AdamW([here], mount=work / "mnt", namespace=f"reference-{variant}", lr=1e-2)
            theirs = AdamW([there], mount=work / "mnt", namespace=f"on-device-{variant}", lr=1e-2, **options)
            differing, before = [], here.detach().clone()
            try:
                for step in range(result["steps"]):
                    grad = torch.randn(n, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
                    here.grad, there.grad = grad, grad.clone().to(device_name)
                    mine.step()
                    theirs.step()
                    differing.append(int((here.detach().view(torch.int16)
                                          != there.detach().cpu().view(torch.int16)).sum()))
                # Agreement means something only if the steps moved the params at all.
                changed = int((here.detach().view(torch.int16) != before.view(torch.int16)).sum())
                result["variants"][variant] = {"differing_elements_per_step": differing, "changed_elements": changed,
                                               "cmb_pinned": theirs.cmb_pinned}
            finally:
                mine.close()
                theirs.close()
    finally:
        daemon.stop_background(work / "mnt", pid)
        shutil.rmtree(work, ignore_errors=True)
    result["identical"] = all(not any(v["differing_elements_per_step"]) and v["changed_elements"] > n // 2
                              for v in result["variants"].values())
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("bundle", type=Path, nargs="?", help="the folder tools/gpu_bundle.sh made")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-node-out"),
                        help="where gpu-node.json and the logs go (default $OUT, else ./gpu-node-out)")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU: run everything else, say the CUDA parts were skipped, exit 0")
    parser.add_argument("--python", help="the node's Python with CUDA torch (default: the first of this "
                                         "one, python3.11, python3, ... with torch and the bundle's version)")
    parser.add_argument("--work", help="parent of the run's venv and scratch (default the temp dir)")
    parser.add_argument("--keep-work", action="store_true", help="keep the venv and scratch afterwards")
    parser.add_argument("--bundled-fuse", action="store_true",
                        help="use the bundle's fusermount3 and libfuse3 even where the node has its own")
    parser.add_argument("--repeat", type=int, default=3, help="bench: steps per figure (default 3)")
    parser.add_argument("--budget-s", type=float, default=540.0, help="fail once the run has taken this long")
    # Used by tools/gpu_bundle.sh and by the run itself, under the venv's Python.
    parser.add_argument("--requirements", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--source-dirs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-manifest", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--libfuse3-version", default="", help=argparse.SUPPRESS)
    parser.add_argument("--source-root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--bitcheck", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--bitcheck-device", default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--bitcheck-json", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.source_dirs:
        print(" ".join([*SOURCE_FILES, *source_dirs(ROOT)]))
        return 0
    if args.requirements:
        print("\n".join(("cossd", *REQUIREMENTS)))
        return 0
    if args.write_manifest:
        write_manifest(args.write_manifest, args.libfuse3_version, args.source_root)
        return 0
    if args.bitcheck:
        return bitcheck(args.bitcheck, args.bitcheck_device, args.bitcheck_json)
    if args.bundle is None:
        parser.error("the bundle folder is required")
    return node_run(args)


if __name__ == "__main__":
    sys.exit(main())
