"""A manifest's own CRC32C over its canonical JSON bytes: the one seal the device's archive manifests and the trainer's tiered manifests carry."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .wire import crc32c

# The field a sealed manifest keeps its own checksum in (the same name in both manifests).
SEAL_FIELD = "manifest_crc32c"


def canonical_bytes(manifest: Mapping[str, Any], field: str = SEAL_FIELD) -> bytes:
    """The bytes the seal covers: every field but `field`, as compact JSON (sorted keys, no
    whitespace, ASCII escapes, no NaN), so any reader re-derives them from the parsed object
    whatever the stored file's indentation."""
    fields = {key: value for key, value in manifest.items() if key != field}
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def seal_of(manifest: Mapping[str, Any], field: str = SEAL_FIELD) -> int:
    """The CRC32C (Castagnoli) of the manifest's canonical bytes."""
    return crc32c(canonical_bytes(manifest, field))


def sealed(manifest: Mapping[str, Any], field: str = SEAL_FIELD) -> dict[str, Any]:
    """A copy of the manifest with its seal in `field` (an old seal there is replaced)."""
    return {key: value for key, value in manifest.items() if key != field} | {field: seal_of(manifest, field)}


def seal_problem(manifest: Mapping[str, Any], field: str = SEAL_FIELD) -> str | None:
    """None where the manifest's stored seal matches its fields; otherwise why not, in words
    a message about the manifest can carry ("fails its own checksum (...)")."""
    stored = manifest.get(field)
    computed = seal_of(manifest, field)
    if stored == computed and isinstance(stored, int) and not isinstance(stored, bool):
        return None
    return f"fails its own checksum ({field} {stored!r}, its fields give {computed})"
