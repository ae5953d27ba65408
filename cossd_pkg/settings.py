"""The COSSD_* environment knobs: each one's name, type, default and meaning, read here and nowhere else.

Every layer that a knob tunes (the kernels, the emulator, the client, the mount daemon, the
command line) reads it through its Knob below, so this module sits below all of them: it
imports the standard library alone. docs/configuration.md has the same table for people.
A knob set to an empty value counts as unset; one set to something it cannot mean raises
SettingError, which names the variable and what it takes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class SettingError(ValueError):
    """An environment knob set to a value it cannot mean."""


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: `parse` turns its stripped text into a value, `default` is
    what an unset (or empty) variable means; read() looks at the environment every call, so
    a test's monkeypatch.setenv takes effect at once."""

    name: str
    default: T
    parse: Callable[[str], T]
    meaning: str

    def read(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingError(f"{self.name}={raw!r} is not understood: {exc}") from None


def _lowered(text: str) -> str:
    return text.lower()


def _text(text: str) -> str:
    return text


def _optional_text(text: str) -> str | None:
    return text


def _count(text: str) -> int:
    """A count of 0 or more, in base 10."""
    value = int(text)
    if value < 0:
        raise ValueError("a count is 0 or more")
    return value


def _optional_count(text: str) -> int | None:
    return _count(text)


def _switch(text: str) -> bool:
    """On unless it is exactly 0 (what `COSSD_PREFETCH=0` has always meant)."""
    return text != "0"


# The kernels and the device's Get Features read this one; their checks of the value (which
# paths exist, what this CPU has) stay with them.
KERNEL = Knob("COSSD_KERNEL", "auto", _lowered,
              "caps the SIMD path of the C kernels at import: scalar, avx2, avx512 or auto "
              "(kernels/dispatch.py); an unknown one warns and runs auto")
STATE_WRITES = Knob("COSSD_STATE_WRITES", "auto", _lowered,
                    "how a step writes a state copy: mapped (stores into the mapping), pwrite, or "
                    "auto (mapped on tmpfs, pwrite elsewhere; emulator/media.py)")
PREFETCH = Knob("COSSD_PREFETCH", True, _switch,
                "0 stops the mount daemon reading a restarted device's params ahead while it "
                "imports (emulator/prefetch.py), for an A/B of what that is worth")
IO_THREADS = Knob[int | None]("COSSD_IO_THREADS", None, _optional_count,
                              "the mount's data path threads when `cossd mount --io-threads` is not "
                              "given; 0 leaves every request to pyfuse3 (unset: one per core, at least 2)")
FUSE_REQUEST_PAGES = Knob("COSSD_FUSE_REQUEST_PAGES", 512, _count,
                          "the largest FUSE request the mount's data path asks the kernel for, in 4 KiB "
                          "pages (the kernel grants up to fs.fuse.max_pages_limit; fs/fuse_limits.py)")
TOKEN_FILE = Knob[str | None]("COSSD_TOKEN_FILE", None, _optional_text,
                              "a storage server's token file, for a client that names none "
                              "(token_file=, --token-file)")
CA = Knob[str | None]("COSSD_CA", None, _optional_text,
                      "the CA that signed a TLS server's certificate, for a client that names none "
                      "(ca=, --ca); unset: plain TCP")
CLIENT_CERT = Knob[str | None]("COSSD_CLIENT_CERT", None, _optional_text,
                               "the certificate a TLS client presents to a server that asks for one")
CLIENT_KEY = Knob[str | None]("COSSD_CLIENT_KEY", None, _optional_text,
                              "the key of COSSD_CLIENT_CERT (unset: the key is in the certificate's file)")
MOUNTINFO = Knob("COSSD_MOUNTINFO", "/proc/self/mountinfo", _text,
                 "the mount table `cossd list` reads (tests only: a script shown its own mount alone)")
FAULT_HOOKS = Knob("COSSD_FAULT_HOOKS", "", _text,
                   "tests only: faults the mount daemon injects into itself, comma-separated: "
                   "hang-before-ready, fail-handler=OP[:N] (fs/fault_hooks.py)")
CUDA_CACHE = Knob[str | None]("COSSD_CUDA_CACHE", None, _optional_text,
                              "where the CUDA kernel's nvcc builds are kept (unset: a folder in the temp dir)")

# Every knob, in the order docs/configuration.md lists them.
KNOBS: tuple[Knob[Any], ...] = (KERNEL, STATE_WRITES, PREFETCH, IO_THREADS, FUSE_REQUEST_PAGES,
                                TOKEN_FILE, CA, CLIENT_CERT, CLIENT_KEY, MOUNTINFO, FAULT_HOOKS, CUDA_CACHE)
