"""Malformed JSON payloads of any shape complete with INVALID_FIELD, never INTERNAL_ERROR: deep
nesting, a top level that is not an object, unknown or odd keys (SET_HYPERPARAMETERS {"self": 1}
used to be an internal error), wrong types, huge numbers, NaN and Infinity, duplicate keys. A
Hypothesis fuzz sends random JSON shapes to every JSON-taking opcode; the two reported cases are
checked through a real mount as well."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, example
from hypothesis import strategies as st

from conftest import Mount
from cossd.protocol.status import Status
from cossd.protocol.entries import MAX_JSON_DEPTH, Opcode, decode_json_payload
from cossd.protocol.status import DeviceError
from cossd.client import AdminClient
from test_control_fuzz import BASELINE, Entry, InProcess, in_process  # noqa: F401 (a fixture)

EXAMPLES = 300

# (opcode, cdw10) of every command that takes a JSON payload: SET_FEATURES C0h and C1h,
# INJECT_ERROR's arm (00h) and corrupt (01h).
JSON_COMMANDS = [(Opcode.CREATE_NAMESPACE, 0), (Opcode.SET_HYPERPARAMETERS, 0), (Opcode.SET_FEATURES, 0xC0),
                 (Opcode.SET_FEATURES, 0xC1), (Opcode.SNAPSHOT_CREATE, 0), (Opcode.SNAPSHOT_DELETE, 0),
                 (Opcode.SNAPSHOT_ROLLBACK, 0), (Opcode.SNAPSHOT_CLONE, 0), (Opcode.EXPORT, 0),
                 (Opcode.INJECT_ERROR, 0), (Opcode.INJECT_ERROR, 1), (Opcode.CMB_WRITE, 0), (Opcode.CMB_READ, 0),
                 # the shared-step forms (a job's ranks on one namespace)
                 (Opcode.BEGIN_STEP, 1), (Opcode.COMMIT_STEP, 0), (Opcode.ABORT_STEP, 0)]
# Keys some command knows, and keys that are odd for all of them (Python parameter names,
# dunder names, empty).
KEYS = ["name", "tensors", "hyperparameters", "groups", "grad_dtype", "param_dtype", "state_dtype",
        "initial_step", "kind", "capacity_bytes", "lr", "beta1", "beta2", "eps", "weight_decay", "mode",
        "durability", "kernel", "tag", "path", "optimizer_state", "overwrite", "opcode", "status", "count",
        "queue", "tensor", "block", "role", "offset", "length", "cmb_offset", "param_cmb_offset",
        "job", "seq", "ranks", "rank", "step", "reason",
        "self", "group", "changes", "__class__", "__dict__", "", "kwargs", "cls"]
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(1 << 70), max_value=1 << 70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6)
           | st.sampled_from(["net", "aux", "w", "t", "s1", "sync", "scalar", "adam", "WRITE_FAULT", "io", "param"]))
VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                      | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=4), children, max_size=4),
                      max_leaves=10)
OBJECTS = st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=5)


def nested(depth: int, rng: random.Random) -> bytes:
    opening = "".join(rng.choice('[{') for _ in range(depth))
    text = "".join('{"a":' if c == "{" else "[" for c in opening) + "1"
    return (text + "".join("}" if c == "{" else "]" for c in reversed(opening))).encode()


# Raw texts no json.dumps of a Python value makes: nesting past the limit, duplicate keys, a
# number of 5000 digits, not UTF-8, empty.
def raw_payloads(rng: random.Random) -> list[bytes]:
    return [nested(MAX_JSON_DEPTH + 1, rng), nested(200, rng), b"[" * 100_000, b'{"lr": 1, "lr": 2}',
            b'{"tag": "s1", "tag": "s1"}', b"9" * 5000, b'{"lr": 1e999}', b'{"lr": NaN}', b"-Infinity",
            b"\xff\xfe", b"", b"null", b"[]", b'"text"']


def test_the_nesting_limit_holds_whether_the_brackets_are_few_or_many() -> None:
    """decode_json_payload skips the nesting count for text with no more opening brackets
    than the limit; the limit is exact either way, and brackets inside strings never count."""
    rng = random.Random(7)
    for depth in (MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH):  # few brackets: no count needed
        assert decode_json_payload(nested(depth, rng)) is not None
    for depth in (MAX_JSON_DEPTH + 1, MAX_JSON_DEPTH + 2, 200):
        with pytest.raises(DeviceError, match="nested deeper"):
            decode_json_payload(nested(depth, rng))
    # Many brackets, shallow: in strings (escaped quotes among them), or side by side.
    in_strings = {"tag": "[" * 100 + '\\"' + "{" * 100, "list": ["[{" * 50]}
    assert decode_json_payload(json.dumps(in_strings).encode()) == in_strings
    assert decode_json_payload(json.dumps([[1]] * 100).encode()) == [[1]] * 100
    # Past the limit by one level, with many brackets elsewhere in the text.
    deep = nested(MAX_JSON_DEPTH + 1, rng).decode()
    with pytest.raises(DeviceError, match="nested deeper"):
        decode_json_payload(f'{{"pad": {json.dumps([[0]] * 50)}, "deep": {deep}}}'.encode())


def payloads() -> st.SearchStrategy[bytes]:
    dumped = (OBJECTS | VALUES).map(lambda value: json.dumps(value).encode())
    raw = st.randoms(use_true_random=True).map(lambda rng: rng.choice(raw_payloads(rng)))
    return st.one_of(dumped, dumped, dumped, raw)


def safe(opcode: int, payload: bytes, directory: Path) -> bytes:
    """An EXPORT's path may only point into the test's directory (the fuzz runs as root)."""
    if opcode != Opcode.EXPORT:
        return payload
    try:
        value = json.loads(payload)
    except (ValueError, RecursionError):
        return payload
    if isinstance(value, dict) and "path" in value:
        value["path"] = str(directory / "export.safetensors")
        return json.dumps(value).encode()
    return payload


def test_random_json_shapes_never_give_internal_error(in_process: InProcess, tmp_path: Path,
                                                      figures: list[str]) -> None:
    env = in_process
    seen: dict[str, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(JSON_COMMANDS), st.sampled_from([*BASELINE, 0]), payloads())
    def check(command: tuple[int, int], nsid: str | int, payload: bytes) -> None:
        opcode, cdw10 = command
        if opcode == Opcode.SET_FEATURES and cdw10 == 0xC1:
            nsid = 0
        entry = Entry(opcode, nsid, (cdw10, 0xFFFFFFFF, 0, 0, 0, 0), safe(opcode, payload, tmp_path))
        try:
            env.run(entry)  # checks: a known status, INTERNAL_ERROR only if injected, failures change nothing
        finally:
            env.reset()
        seen[Opcode(opcode).name] = seen.get(Opcode(opcode).name, 0) + 1

    # Every opcode at least once whatever the random draws (a run once drew no CMB_READ).
    for command in JSON_COMMANDS:
        check = example(command, 0, b"{}")(check)
    check()
    assert set(seen) == {Opcode(opcode).name for opcode, _ in JSON_COMMANDS}
    figures.append(f"JSON payload fuzz: {env.tally.entries} commands to {len(seen)} opcodes, {env.tally.failed} "
                   f"refused, {env.tally.succeeded} succeeded, 0 internal errors")


@pytest.mark.mount
def test_reported_payloads_are_invalid_field_through_a_mount(mount: Mount) -> None:
    with AdminClient(mount.mountpoint) as admin:
        nsid = admin.create_namespace({"name": "net", "tensors": [["w", 8]]})
        cases = {
            "SET_HYPERPARAMETERS {'self': 1}": (Opcode.SET_HYPERPARAMETERS, b'{"self": 1}'),
            "SET_HYPERPARAMETERS {'group': true}": (Opcode.SET_HYPERPARAMETERS, b'{"group": true, "lr": 0.1}'),
            "SET_HYPERPARAMETERS {'group': 5}": (Opcode.SET_HYPERPARAMETERS, b'{"group": 5, "lr": 0.1}'),
            "SET_HYPERPARAMETERS lr 10**400": (Opcode.SET_HYPERPARAMETERS, b'{"lr": 1' + b"0" * 400 + b"}"),
            "deep nesting": (Opcode.SET_HYPERPARAMETERS, b"[" * 100_000),
            "deep nesting, create": (Opcode.CREATE_NAMESPACE, b'{"name": ' * 5000 + b"1" + b"}" * 5000),
            "NaN": (Opcode.SET_HYPERPARAMETERS, b'{"lr": NaN}'),
            "duplicate key": (Opcode.SNAPSHOT_CREATE, b'{"tag": "a", "tag": "b"}'),
            "a list at the top": (Opcode.CMB_WRITE, b"[[[[1]]]]"),
        }
        before = admin.call(Opcode.GET_FEATURES, nsid=nsid, cdw10=0xC0, cdw11=0xFFFFFFFF).data
        for what, (opcode, payload) in cases.items():
            completion = admin.submit(opcode, nsid=nsid, payload=payload)
            assert completion.status == Status.INVALID_FIELD, (what, completion)
        after = admin.call(Opcode.GET_FEATURES, nsid=nsid, cdw10=0xC0, cdw11=0xFFFFFFFF).data
        assert after == before  # nothing changed
        assert [ns["name"] for ns in admin.describe()["namespaces"]] == ["net"]
