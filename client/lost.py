"""The one translation of a transport's failure into DeviceLostError: which errors mean the device is gone."""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Callable

from .watchdog import DeviceTimeoutError

# errnos that mean the daemon or server is gone or wedged rather than that a request was
# wrong. (EIO is not among them: the daemon answers EIO for a request it failed, and stays up.)
LOST_ERRNOS = frozenset({errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV, errno.ESHUTDOWN})


class DeviceLostError(RuntimeError):
    """The device stopped answering (daemon killed, mount gone); the committed step is safe."""


def lost_error(location: Path | str, exc: OSError) -> DeviceLostError:
    """The DeviceLostError for `exc`, a transport's failure at `location`."""
    return DeviceLostError(
        f"cossd device at {location} stopped answering ({exc.strerror or exc}); the last "
        "committed step is intact: remount it and create the optimizer again to resume"
    )


def _unreachable(reachable: Callable[[], bool] | None) -> bool:
    if reachable is None:
        return False
    try:
        return not reachable()
    except OSError:
        return True  # a stat of a dead FUSE mount's file fails (ENOTCONN) rather than answering


@contextlib.contextmanager
def device_lost(location: Path | str | os.PathLike[str], *, reachable: Callable[[], bool] | None = None,
                doing: str | None = None) -> Iterator[None]:
    """Turn an OSError of the calls inside into DeviceLostError where the device is gone: an
    errno of LOST_ERRNOS, none at all (a queue pair that returned no completion), or any
    errno once `reachable()` says the device no longer answers (a vanished mount's files are
    ENOENT). DeviceTimeoutError passes as it is (the device may resume); any other OSError
    too, its message prefixed with `doing` ("writing t/grad") where given."""
    try:
        yield
    except DeviceTimeoutError:
        raise
    except OSError as exc:
        if exc.errno in LOST_ERRNOS or exc.errno is None or _unreachable(reachable):
            raise lost_error(os.fspath(location), exc) from exc
        if doing is not None:
            raise OSError(exc.errno, f"{doing}: {exc.strerror}") from exc
        raise
