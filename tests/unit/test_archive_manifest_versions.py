"""The archive's manifest versions: a replaced version's (3, naming its generation) reads back; a generation field on the wrong version, or a version this cossd does not know, is refused."""
from __future__ import annotations

from typing import Any

import pytest
from cossd.emulator import DeviceError, Status
from cossd.emulator.archive import versions as archive

URL = "s3://bucket/prefix/m/t1"


def manifest(version: int, **more: Any) -> dict[str, Any]:
    return {"format": "cossd-archive", "version": version, "namespace": "m", "tag": "t1", "step": 4,
            "spec": {}, "archived": "2026-12-07T00:00:00Z", "state_bytes": 10, "chunk_bytes": 5,
            "chunks_crc32c": [1, 2], "objects": {"state": {"bytes": 10}, "sb": {"bytes": 3, "crc32c": 7},
                                                 "meta.json": {"bytes": 5, "crc32c": 9}}} | more


def test_a_replaced_versions_manifest_is_version_3_and_reads_back() -> None:
    read = archive.decode_manifest(archive.encode_manifest(manifest(3, generation="0123abcd")), URL)
    assert read["generation"] == "0123abcd" and read["manifest_checked"]
    assert archive.object_key(archive.parse_url(URL), read, archive.STATE_OBJECT).endswith("/0123abcd.state")
    plain = archive.decode_manifest(archive.encode_manifest(manifest(2)), URL)
    assert "generation" not in plain and plain["manifest_checked"]


def test_a_version_2_naming_a_generation_stays_readable() -> None:
    """The build before version 3 wrote replaced versions as version 2 with a generation."""
    read = archive.decode_manifest(archive.encode_manifest(manifest(2, generation="0123abcd")), URL)
    assert read["generation"] == "0123abcd" and read["manifest_checked"]


@pytest.mark.parametrize("fields,expect", [
    (manifest(1, generation="0123abcd"), "version 1 with a generation field"),
    (manifest(3), "version 3 without a generation field"),
    (manifest(4, generation="0123abcd"), "this cossd reads 1, 2 and 3"),
], ids=["v1-with-generation", "v3-without", "v4"])
def test_a_generation_on_the_wrong_version_is_refused(fields: dict[str, Any], expect: str) -> None:
    """Only the version rule refuses them (version 1 is read only where accepted unchecked):
    a reader must never look for a version's objects under names its manifest does not give."""
    with pytest.raises(DeviceError) as refused:
        archive.decode_manifest(archive.encode_manifest(fields), URL, accept_unchecked=True)
    assert refused.value.status == Status.UNRECOVERED_READ_ERROR and expect in refused.value.message
