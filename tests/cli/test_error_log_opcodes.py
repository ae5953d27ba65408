"""`cossd error-log` names an entry's opcode by its queue and, for an I/O command (sqid 1), by
the kind of namespace it went to: 01h is a tensor file's WRITE, a compute namespace's Execute
Program, a memory namespace's Memory Copy."""
from __future__ import annotations

import pytest

from cossd.tools.verbs.logs import _error_entries_text, _opcode_name


@pytest.mark.parametrize("opcode, sqid, kind, name", [
    (0x02, 0, None, "GET_LOG_PAGE"),        # the admin queue
    (0x02, 0, "memory", "GET_LOG_PAGE"),    # the kind names only I/O commands
    (0x01, 1, "optimizer", "WRITE"),
    (0x01, 1, None, "WRITE"),               # a namespace deleted since: the data path's name
    (0x01, 1, "compute", "EXECUTE_PROGRAM"),
    (0x01, 1, "memory", "MEMORY_COPY"),
    (0x02, 1, "memory", "MEMORY_READ"),
    (0x05, 1, "compute", "unknown"),
])
def test_opcode_names(opcode: int, sqid: int, kind: str | None, name: str) -> None:
    assert _opcode_name(opcode, sqid, kind) == name


def test_the_text_names_an_execute_program_by_its_namespace() -> None:
    entry = {"error_count": 1, "sqid": 1, "cmdid": 3, "status_field": 0x2 << 1, "phase_tag": 0,
             "parm_error_location": 0xFFFF, "lba": 0, "nsid": 4, "vs": 0, "cs": 0x01}
    assert "(opcode EXECUTE_PROGRAM)" in _error_entries_text("mnt", [entry], {4: "compute"})
    assert "(opcode WRITE)" in _error_entries_text("mnt", [entry], {4: "optimizer"})
