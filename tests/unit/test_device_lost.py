"""client/lost.py: the one translation of a transport's OSError into DeviceLostError, and what it lets pass."""
from __future__ import annotations

import errno

import pytest

from cossd.client.lost import LOST_ERRNOS, DeviceLostError, device_lost
from cossd.client.watchdog import DeviceTimeoutError
from cossd.trainer import DeviceLostError as TrainersDeviceLostError


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize("code", sorted(LOST_ERRNOS))
def test_a_gone_device_errno_is_device_lost_with_the_remount_advice(code: int) -> None:
    with pytest.raises(DeviceLostError, match=r"cossd device at /mnt/x stopped answering .*remount") as caught:
        with device_lost("/mnt/x"):
            _raise(OSError(code, "gone"))
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == code


def test_an_oserror_without_errno_is_a_dead_queue_pair() -> None:
    with pytest.raises(DeviceLostError, match="control file returned no completion"):
        with device_lost("/mnt/x"):
            _raise(OSError("control file returned no completion"))


def test_a_refused_request_stays_an_oserror_and_gets_what_it_was_doing() -> None:
    """EIO is the daemon failing one request (it stays up): the caller sees the errno."""
    with pytest.raises(OSError, match=r"writing w/grad: Input/output error") as caught:
        with device_lost("/mnt/x", reachable=lambda: True, doing="writing w/grad"):
            _raise(OSError(errno.EIO, "Input/output error"))
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, DeviceLostError)
    with pytest.raises(FileNotFoundError):
        with device_lost("/mnt/x", reachable=lambda: True):
            _raise(FileNotFoundError(errno.ENOENT, "no such file"))


def test_any_errno_once_the_device_is_unreachable_is_device_lost() -> None:
    """A vanished mount's files are ENOENT; its probe itself may fail (ENOTCONN on a dead FUSE mount)."""
    with pytest.raises(DeviceLostError):
        with device_lost("/mnt/x", reachable=lambda: False):
            _raise(FileNotFoundError(errno.ENOENT, "no such file"))
    with pytest.raises(DeviceLostError):
        with device_lost("/mnt/x", reachable=lambda: _raise(OSError(errno.ENOTCONN, "not connected")) or True):
            _raise(OSError(errno.EIO, "Input/output error"))


def test_a_timeout_passes_as_it_is_even_with_what_it_was_doing() -> None:
    """A stopped daemon may resume: DeviceTimeoutError is not a lost device, nor re-labelled."""
    timeout = DeviceTimeoutError("the daemon did not answer within 1.5 s")
    with pytest.raises(DeviceTimeoutError) as caught:
        with device_lost("/mnt/x", reachable=lambda: False, doing="writing w/grad"):
            _raise(timeout)
    assert caught.value is timeout


def test_the_trainer_exports_the_same_class() -> None:
    assert TrainersDeviceLostError is DeviceLostError
