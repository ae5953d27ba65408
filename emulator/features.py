"""Get Features (0Ah) and Set Features (09h): temperature thresholds, queues, hyperparameters, settings."""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any, Callable

from .. import kernels, settings

from ..protocol.status import DeviceError, Status
from .health import WARNING_TEMP_KELVIN
from ..protocol.entries import NSID_ALL, Command, Completion, Opcode
from ..protocol.features import (
    ALL_GROUPS,
    CAP_CHANGEABLE,
    CAP_NAMESPACE_SPECIFIC,
    CAP_SAVEABLE,
    DURABILITY_MODES,
    KERNEL_CHOICES,
    QUEUE_PAIRS_0S_BASED,
    SAVE_BIT,
    THSEL_OVER,
    THSEL_UNDER,
    TMPSEL_ALL,
    TMPSEL_COMPOSITE,
    FeatureId,
    Select,
)
from ..protocol.hyperparameters import GROUP_FIELDS

if TYPE_CHECKING:
    from .controller import Controller
    from .device import Device

log = logging.getLogger(__name__)


CAPABILITIES = {
    FeatureId.TEMPERATURE_THRESHOLD: CAP_SAVEABLE | CAP_CHANGEABLE,
    FeatureId.NUMBER_OF_QUEUES: 0,
    FeatureId.HYPERPARAMETERS: CAP_NAMESPACE_SPECIFIC | CAP_CHANGEABLE,
    FeatureId.DEVICE_SETTINGS: CAP_SAVEABLE | CAP_CHANGEABLE,
}
# Why a feature cannot be changed or saved, for the completion's message.
WHY_NOT_CHANGEABLE = {FeatureId.NUMBER_OF_QUEUES: "each open() of .admin is one queue pair"}
WHY_NOT_SAVEABLE = {FeatureId.HYPERPARAMETERS: "hyperparameters are stored with the next committed step"}
DEFAULT_THRESHOLDS = {"over": WARNING_TEMP_KELVIN, "under": 0}

DEFAULT_SETTINGS = {"durability": "plp", "kernel": "auto"}

# Keys of the saved values in superblock.json ("features").
SAVED_KEYS = {FeatureId.TEMPERATURE_THRESHOLD: "04h", FeatureId.DEVICE_SETTINGS: "c1h"}


def _invalid(message: str) -> DeviceError:
    return DeviceError(Status.INVALID_FIELD, message)


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _payload_object(command: Command, allowed: tuple[str, ...]) -> dict[str, Any]:
    """The payload as a non-empty JSON object whose keys are all in `allowed`."""
    value = command.json  # INVALID_FIELD for malformed JSON of any shape (protocol.py)
    if not isinstance(value, dict) or not value:
        raise _invalid(f"payload must be a JSON object with some of: {', '.join(allowed)}")
    unknown = set(value) - set(allowed)
    if unknown:
        raise _invalid(f"unknown key(s) {', '.join(map(repr, sorted(unknown)))[:200]}; "
                       f"this feature takes {', '.join(allowed)}")
    return value


def _checked_thresholds(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or set(value) != {"over", "under"} or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 0xFFFF for v in value.values()):
        raise _invalid(f"temperature thresholds must be {{'over': K, 'under': K}} in 0..65535, got {value!r}")
    return dict(value)


def _checked_settings(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or set(value) - set(DEFAULT_SETTINGS):
        raise _invalid(f"device settings take {', '.join(DEFAULT_SETTINGS)}, got {value!r}")
    if "durability" in value and value["durability"] not in DURABILITY_MODES:
        raise _invalid(f"durability must be one of {', '.join(DURABILITY_MODES)}, got {value['durability']!r}")
    if "kernel" in value and value["kernel"] not in KERNEL_CHOICES:
        raise _invalid(f"kernel must be one of {', '.join(KERNEL_CHOICES)}, got {value['kernel']!r}")
    return dict(value)


def _kernel_from_environment() -> str:
    """The kernel cap COSSD_KERNEL chose at import (cossd.kernels applies it), as a setting."""
    choice = settings.KERNEL.read()
    return choice if choice in KERNEL_CHOICES else "auto"


class Features:
    """The feature values of one device as its controller serves them. Current values live
    where they act (health thresholds, the device's durability, the process's kernel path);
    saved values live in superblock.json and become current when a controller starts."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.kernel = _kernel_from_environment()
        self._load_saved()

    # ------------------------------------------------------------------ saved values

    def _saved(self, fid: FeatureId) -> dict[str, Any] | None:
        """The saved value of a saveable feature, or None when none (or a corrupt one) is saved."""
        stored = self.device.saved_features.get(SAVED_KEYS[fid])
        if stored is None:
            return None
        try:
            if fid == FeatureId.TEMPERATURE_THRESHOLD:
                return _checked_thresholds(stored)
            return DEFAULT_SETTINGS | _checked_settings(stored)
        except DeviceError as exc:
            log.warning("ignoring the saved value of feature %#04x: %s", fid, exc.message)
            return None

    def _load_saved(self) -> None:
        """A controller start (a mount) makes the saved values current, as an NVMe reset does.
        A device opened with sync durability (mount --sync) stays sync."""
        thresholds = self._saved(FeatureId.TEMPERATURE_THRESHOLD)
        if thresholds is not None:
            self._apply_thresholds(thresholds)
        settings = self._saved(FeatureId.DEVICE_SETTINGS)
        if settings is not None:
            if self.device.config.sync:
                settings["durability"] = "sync"
            try:
                self._apply_settings(settings)
            except DeviceError as exc:
                log.error("could not apply the saved device settings: %s", exc.message)

    def _save(self, fid: FeatureId, value: dict[str, Any]) -> None:
        self.device.save_features(self.device.saved_features | {SAVED_KEYS[fid]: value})

    # ------------------------------------------------------------------ 04h temperature threshold

    def _thresholds(self) -> dict[str, int]:
        health = self.device.health
        return {"over": health.over_temp_threshold_kelvin, "under": health.under_temp_threshold_kelvin}

    def _apply_thresholds(self, value: dict[str, int]) -> None:
        self.device.health.over_temp_threshold_kelvin = value["over"]
        self.device.health.under_temp_threshold_kelvin = value["under"]

    @staticmethod
    def _threshold_select(cdw11: int, *, setting: bool) -> tuple[int, int]:
        """(TMPSEL, THSEL) of cdw11; only the composite temperature exists."""
        tmpsel, thsel = (cdw11 >> 16) & 0xF, (cdw11 >> 20) & 0x3
        allowed = (TMPSEL_COMPOSITE, TMPSEL_ALL) if setting else (TMPSEL_COMPOSITE,)
        if tmpsel not in allowed:
            raise _invalid(f"TMPSEL {tmpsel:#x}: this device has the composite temperature (0h) only")
        if thsel not in (THSEL_OVER, THSEL_UNDER):
            raise _invalid(f"THSEL {thsel} is reserved: 0 selects the over, 1 the under threshold")
        return tmpsel, thsel

    # ------------------------------------------------------------------ C1h device settings

    def _settings(self) -> dict[str, str]:
        return {"durability": "sync" if self.device.config.sync else "plp", "kernel": self.kernel}

    def _apply_settings(self, value: dict[str, str]) -> None:
        """Make `value` current; on a failure nothing has changed."""
        self._apply_durability(value["durability"] == "sync")
        kernels.use_kernel(value["kernel"])
        self.kernel = value["kernel"]

    def _set_namespace_durability(self, sync: bool) -> None:
        for namespace in list(self.device.namespaces.values()):
            # Each kind is one of the two: an nvm namespace writes through, or caches; an
            # optimizer namespace fsyncs at every commit, or only at flushes.
            nvm, optimizer = namespace.as_nvm(), namespace.as_optimizer()
            if nvm is not None:
                nvm.write_through = sync
            if optimizer is not None:
                optimizer.sync_commits = sync

    def _flush_all(self) -> None:
        for namespace in list(self.device.namespaces.values()):
            namespace.flush()

    def _apply_durability(self, sync: bool) -> None:
        device = self.device
        if sync == device.config.sync:
            return
        if sync:
            # What plp mode acknowledged must be durable before sync mode promises it is.
            self._flush_all()
        device.config = dataclasses.replace(device.config, sync=sync)
        self._set_namespace_durability(sync)
        if sync:
            try:
                self._flush_all()  # a commit may have slipped in between
            except DeviceError:
                device.config = dataclasses.replace(device.config, sync=False)
                self._set_namespace_durability(False)
                raise

    # ------------------------------------------------------------------ C0h hyperparameters

    def _optimizer_namespace(self, command: Command) -> Any:
        if command.nsid in (0, NSID_ALL):
            raise DeviceError(Status.INVALID_NAMESPACE,
                              f"feature {FeatureId.HYPERPARAMETERS:#04x} is namespace specific: "
                              f"nsid must name a namespace, not {command.nsid:#x}")
        return self.device.optimizer_namespace(command.nsid, "the hyperparameters feature")

    @staticmethod
    def _groups(hypers: Any) -> tuple[int, bytes]:
        groups = [dataclasses.asdict(h) for h in hypers]
        return len(groups), _json({"groups": groups})

    # ------------------------------------------------------------------ commands

    def _feature(self, command: Command) -> FeatureId:
        fid = command.cdw10 & 0xFF
        try:
            feature = FeatureId(fid)
        except ValueError:
            raise _invalid(f"feature identifier {fid:#04x} is not supported") from None
        if not CAPABILITIES[feature] & CAP_NAMESPACE_SPECIFIC and command.nsid not in (0, NSID_ALL):
            raise DeviceError(Status.FEATURE_NOT_NAMESPACE_SPECIFIC,
                              f"feature {fid:#04x} is controller wide: nsid must be 0 or 0xffffffff, "
                              f"not {command.nsid:#x}")
        return feature

    def get(self, command: Command) -> Completion:
        """Get Features: the value SEL selects, in the result dword (and JSON data for C0h, C1h)."""
        select = (command.cdw10 >> 8) & 0x7
        if select == Select.SUPPORTED_CAPABILITIES:
            fid = command.cdw10 & 0xFF
            if fid not in CAPABILITIES.keys():
                raise _invalid(f"feature identifier {fid:#04x} is not supported")
            return Completion(command.cid, Status.SUCCESS, result=CAPABILITIES[FeatureId(fid)])
        if select not in (Select.CURRENT, Select.DEFAULT, Select.SAVED):
            raise _invalid(f"SEL {select} is reserved (0 current, 1 default, 2 saved, 3 capabilities)")
        feature = self._feature(command)
        result, data = 0, b""
        if feature == FeatureId.TEMPERATURE_THRESHOLD:
            tmpsel, thsel = self._threshold_select(command.cdw11, setting=False)
            value = {Select.CURRENT: self._thresholds, Select.DEFAULT: lambda: DEFAULT_THRESHOLDS,
                     Select.SAVED: lambda: self._saved(feature) or DEFAULT_THRESHOLDS}[Select(select)]()
            result = value["under" if thsel == THSEL_UNDER else "over"] | tmpsel << 16 | thsel << 20
        elif feature == FeatureId.NUMBER_OF_QUEUES:
            result = QUEUE_PAIRS_0S_BASED | QUEUE_PAIRS_0S_BASED << 16  # NSQA, NCQA
        elif feature == FeatureId.HYPERPARAMETERS:
            namespace = self._optimizer_namespace(command)
            # Not saveable: SEL 2 returns the default, as NVMe has it (the creation values).
            hypers = namespace.hypers if select == Select.CURRENT else namespace.spec.group_hypers
            result, data = self._groups(hypers)
        else:
            if select == Select.CURRENT:
                value = self._settings() | {"kernel_in_use": kernels.simd_level(),
                                            "kernels_available": list(kernels.available_kernels())}
            elif select == Select.DEFAULT:
                value = dict(DEFAULT_SETTINGS)
            else:
                value = self._saved(feature) or dict(DEFAULT_SETTINGS)
            data = _json(value)
        return Completion(command.cid, Status.SUCCESS, result=result, data=data)

    def set(self, command: Command) -> Completion:
        """Set Features: every field is checked first; nothing changes unless all pass. With SV
        the value is saved too (superblock.json), and a failed save undoes the change."""
        feature = self._feature(command)
        save = bool(command.cdw10 & SAVE_BIT)
        if not CAPABILITIES[feature] & CAP_CHANGEABLE:
            raise DeviceError(Status.FEATURE_NOT_CHANGEABLE,
                              f"feature {feature:#04x} ({feature.name.lower()}) is not changeable: "
                              f"{WHY_NOT_CHANGEABLE.get(feature, 'read only')}")
        if save and not CAPABILITIES[feature] & CAP_SAVEABLE:
            raise DeviceError(Status.FEATURE_ID_NOT_SAVEABLE,
                              f"feature {feature:#04x} ({feature.name.lower()}) is not saveable: "
                              f"{WHY_NOT_SAVEABLE.get(feature, 'it lasts until the next mount')}")
        if feature == FeatureId.HYPERPARAMETERS:
            return self._set_hyperparameters(command)
        if feature == FeatureId.TEMPERATURE_THRESHOLD:
            tmpsel, thsel = self._threshold_select(command.cdw11, setting=True)
            old = self._thresholds()
            new = old | {"under" if thsel == THSEL_UNDER else "over": command.cdw11 & 0xFFFF}
            self._change(feature, old, new, self._apply_thresholds, save)
            result = new["under" if thsel == THSEL_UNDER else "over"] | tmpsel << 16 | thsel << 20
            return Completion(command.cid, Status.SUCCESS, result=result)
        changes = _checked_settings(_payload_object(command, tuple(DEFAULT_SETTINGS)))
        old_settings = self._settings()
        new_settings = old_settings | changes
        self._change(feature, old_settings, new_settings, self._apply_settings, save)
        return Completion(command.cid, Status.SUCCESS, data=_json(new_settings))

    def _change(self, feature: FeatureId, old: dict[str, Any], new: dict[str, Any],
                apply: Callable[[Any], None], save: bool) -> None:
        apply(new)
        if save:
            try:
                self._save(feature, new)
            except BaseException:
                apply(old)  # the save failed: the command fails, so nothing may have changed
                raise

    def _set_hyperparameters(self, command: Command) -> Completion:
        namespace = self._optimizer_namespace(command)
        changes = _payload_object(command, GROUP_FIELDS)
        group = None if command.cdw11 == ALL_GROUPS else command.cdw11
        if group is not None and group >= len(namespace.hypers):
            raise _invalid(f"group {group} outside 0..{len(namespace.hypers) - 1} "
                           f"(cdw11 {ALL_GROUPS:#x}: every group)")
        namespace.set_hyperparameters(group, **changes)  # validates every group before changing any
        result, data = self._groups(namespace.hypers)
        return Completion(command.cid, Status.SUCCESS, result=result, data=data)


def handlers(controller: Controller) -> dict[int, Callable[[Command], Completion]]:
    features = Features(controller.device)
    return {Opcode.GET_FEATURES: features.get, Opcode.SET_FEATURES: features.set}
