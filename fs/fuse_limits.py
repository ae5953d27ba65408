"""FUSE's largest request: the kernel's page limit per request (fs.fuse.max_pages_limit, Linux
6.13+), raised for the moment of one mount where the daemon may, and what a mount then gets.

Why: the kernel splits a client's read or write into requests of at most max_pages pages, and
each request costs the daemon a device read, Python bookkeeping and a reply. Until 6.13 the
limit was fixed at 256 pages (1 MiB, FUSE_MAX_MAX_PAGES); since, the sysctl caps it (default
256), and the kernel reads it once per mount (fuse_conn_init, inside the mount call), so a
value raised just for that call serves the mount for its whole life and can be put back
right after: other filesystems mounted later see the machine's own setting again.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

LIMIT_PATH = Path("/proc/sys/fs/fuse/max_pages_limit")
# The limit where the sysctl does not exist (kernels before 6.13): FUSE_MAX_MAX_PAGES.
FIXED_LIMIT_PAGES = 256
# What fuse_init_out.max_pages can say (a u16); the sysctl's own ceiling too.
MAX_PAGES_FIELD = 65535
# Daemons that mount at the same moment take turns raising and restoring the limit, so that
# none restores a value another raised (it would then stay raised).
LOCK_NAME = "cossd-fuse-max-pages.lock"


@contextlib.contextmanager
def _turn() -> Iterator[None]:
    directory = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield  # no lock to be had: the limit is still put back where unchanged
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def max_pages_limit(path: Path = LIMIT_PATH) -> int:
    """The per-request page limit a mount made now would get."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return FIXED_LIMIT_PAGES


@contextlib.contextmanager
def raised_max_pages_limit(pages: int, path: Path = LIMIT_PATH) -> Iterator[int]:
    """Around a mount call: the limit raised to `pages` where it is lower and this process
    may write it (root), and put back afterwards unless someone changed it meanwhile. Yields
    the limit the mount gets. Never required: where the sysctl is missing or read-only the
    mount gets the limit as it is."""
    pages = min(pages, MAX_PAGES_FIELD)
    if pages <= FIXED_LIMIT_PAGES or not (path.exists() and os.access(path, os.W_OK)):
        yield max_pages_limit(path)
        return
    with _turn():
        with _raised(pages, path) as limit:
            yield limit


@contextlib.contextmanager
def _raised(pages: int, path: Path) -> Iterator[int]:
    before = max_pages_limit(path)
    raised = False
    if before < pages:
        try:
            path.write_text(f"{pages}\n")
            raised = max_pages_limit(path) == pages
        except OSError as exc:
            log.info("FUSE requests stay at %d pages: cannot raise %s: %s", before, path, exc)
    if raised:
        log.info("raised %s from %d to %d pages for this mount", path, before, pages)
    try:
        yield pages if raised else before
    finally:
        if raised:
            try:
                if max_pages_limit(path) == pages:
                    path.write_text(f"{before}\n")
                    log.info("put %s back to %d pages (this mount keeps %d)", path, before, pages)
            except OSError as exc:
                log.warning("could not put %s back to %d pages: %s", path, before, exc)
