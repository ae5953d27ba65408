"""A mount's options, declared once: `cossd mount` builds a MountOptions, the launcher hands it to the daemon as JSON, the daemon serves by it.

Adding an option means adding a field here (its type, its default, whether it is the device's
own and so the server's for a remote mount) and its flag in tools/verbs/device.py; the
launcher, the daemon's entry and the daemon take every field as it is. Standard library and
the light constants alone: the daemon's entry parses this before its heavy imports.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from ..emulator.geometry import DEFAULT_CMB_BYTES
from ..model.profiles import DEFAULT_PROFILE, PROFILES

# DeviceConfig.verify's values (emulator/namespace/verify.py's VERIFY_MODES, which imports
# numpy; tests/unit/test_mount_options.py keeps the two equal).
VERIFY_CHOICES = ("background", "open")

# Marks a field that sets the device's own behaviour: for a remote mount (cossd://) that is the
# server's (`cossd serve`), so the command line refuses it there. "flag" names the option
# where it is not the field's name with dashes.
_DEVICE = {"device": True}


@dataclass(frozen=True)
class MountOptions:
    """What a local mount is started with; the launcher's own arguments (its log file, how
    long to wait) and the daemon's process details (the ready pipe) are not options."""

    backing: str
    mountpoint: str
    _: KW_ONLY
    allow_other: bool = False
    debug: bool = False  # every FUSE request logged, and the daemon's log at DEBUG
    sync: bool = dataclasses.field(default=False, metadata=_DEVICE)
    metrics_port: int | None = dataclasses.field(default=None, metadata=_DEVICE)
    metrics_addr: str | None = None  # None: the metrics endpoint's default, loopback
    metrics_token_file: str | None = dataclasses.field(default=None, metadata=_DEVICE)
    profile: str = dataclasses.field(default=DEFAULT_PROFILE, metadata=_DEVICE)
    timed: bool = dataclasses.field(default=False, metadata=_DEVICE)
    # None: $COSSD_IO_THREADS, else one per core and at least 2 (the daemon resolves it).
    io_threads: int | None = dataclasses.field(default=None, metadata=_DEVICE)
    cmb_bytes: int = dataclasses.field(default=DEFAULT_CMB_BYTES, metadata=_DEVICE | {"flag": "--cmb-size"})
    verify: str = dataclasses.field(default=VERIFY_CHOICES[0], metadata=_DEVICE)

    def __post_init__(self) -> None:
        # Paths are kept as strings, so that the JSON the daemon reads says the same.
        for name in ("backing", "mountpoint", "metrics_token_file"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            _check_type(field.name, getattr(self, field.name), hints[field.name])
        if self.verify not in VERIFY_CHOICES:
            raise ValueError(f"mount option verify must be one of {', '.join(VERIFY_CHOICES)}, not {self.verify!r}")

    @classmethod
    def from_args(cls, args: Any) -> MountOptions:
        """From `cossd mount`'s parsed arguments: a field whose argument is None (not given)
        keeps its default here, so that the defaults live in this class alone."""
        given = {field.name: getattr(args, field.name) for field in dataclasses.fields(cls)
                 if getattr(args, field.name, None) is not None}
        return cls(**given)

    def to_json(self) -> str:
        """The options as the daemon's entry reads them back (from_json)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MountOptions:
        """The options to_json wrote; ValueError for anything that is not such an object
        (an unknown field, a missing one, a value of the wrong type)."""
        fields = json.loads(text)
        if not isinstance(fields, dict):
            raise ValueError(f"mount options must be a JSON object, not {type(fields).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"unknown mount options: {', '.join(unknown)}")
        try:
            return cls(**fields)
        except TypeError as exc:  # a required field missing
            raise ValueError(f"mount options: {exc}") from None

    def for_daemon(self) -> MountOptions:
        """These options with the files they name made absolute, as the launcher passes them
        (a profile named by its file, the metrics token file); the backing and mountpoint
        stay as given, for the daemon's log and error lines."""
        changes: dict[str, Any] = {}
        if self.metrics_token_file is not None:
            changes["metrics_token_file"] = str(Path(self.metrics_token_file).resolve())
        if self.profile not in PROFILES:
            changes["profile"] = str(Path(self.profile).resolve())
        return dataclasses.replace(self, **changes)

    def device_options_given(self) -> list[str]:
        """The flags of the device's own options set away from their defaults: what a remote
        mount refuses, since those are the server's."""
        return [field.metadata.get("flag", "--" + field.name.replace("_", "-"))
                for field in dataclasses.fields(self)
                if field.metadata.get("device") and getattr(self, field.name) != field.default]


def _check_type(name: str, value: object, hint: Any) -> None:
    """Refuse a value that is not of the field's type (bool is not taken for int: JSON and
    keyword arguments alike would let True through as 1)."""
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        kind = type(None) if kind is None else kind
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return
    names = " or ".join("None" if kind in (None, type(None)) else kind.__name__ for kind in allowed)
    raise ValueError(f"mount option {name} must be {names}, not {value!r}")
