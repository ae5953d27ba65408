"""The tiered checkpointer's S3 store (boto3): a version's multipart upload, its manifest written last, listing, verified download."""
from __future__ import annotations

import contextlib
import json
import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import crc32c

from ...protocol import manifest_seal

MANIFEST_FORMAT = "cossd-tiered"
# 2: the manifest (and the spill dir's sidecar) carries `manifest_crc32c`, its own checksum
# over its canonical bytes (protocol/manifest_seal.py, the device's archive's seal too).
MANIFEST_VERSION = 2
UNCHECKED_MANIFEST_VERSION = 1  # the same fields without a checksum of their own
MANIFEST_CHECKSUM = manifest_seal.SEAL_FIELD
DATA_OBJECT = "data"
MANIFEST_OBJECT = "manifest.json"
MIB = 1 << 20
# S3 refuses parts under 5 MiB (the last excepted) and more than 10 000 parts.
MIN_CHUNK_BYTES = 5 * MIB
MAX_CHUNK_BYTES = 1 << 30
MAX_PARTS = 10_000
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_VERSION_DIR = re.compile(r"v(\d{12})")


class StoreError(RuntimeError):
    """The store failed or could not be reached; the message names the object and the endpoint."""


class CorruptVersionError(RuntimeError):
    """A version whose bytes do not match its manifest's checksums, or whose manifest fails its
    own (in the store or the spill dir)."""


class UncheckedManifestError(CorruptVersionError):
    """A version whose manifest is format 1 (no checksum of its own), refused unless accepted."""


def parse_url(url: object) -> tuple[str, str]:
    """(bucket, prefix) of s3://BUCKET[/PREFIX]; ValueError for anything else."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"a store location is s3://BUCKET/PREFIX, got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not a bucket name (3-63 of a-z 0-9 . -)")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(f"{url!r}: '.' and '..' are not key components")
    return bucket, "/".join(parts)


def version_dir(step: int) -> str:
    # Zero-padded, so the store lists versions in step order.
    return f"v{step:012d}"


def manifest(step: int, payload_bytes: int, chunk_bytes: int, crcs: list[int], created: str) -> dict[str, Any]:
    """A version's manifest, not yet sealed (the spill dir's sidecar has the same form); each
    writer seals it (`manifest_seal.sealed`) once its last field is in."""
    return {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "step": step,
            "payload_bytes": payload_bytes, "chunk_bytes": chunk_bytes, "chunks_crc32c": crcs,
            "created": created}


def check_manifest(data: Any, step: int, where: str, accept_unchecked: bool = False) -> dict[str, Any]:
    """A manifest read back from `where` (the store or the spill dir), checked: its own
    checksum first, then its form. CorruptVersionError saying what is wrong; a format-1
    manifest is refused (UncheckedManifestError) unless `accept_unchecked`, and then warned of."""
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and version == UNCHECKED_MANIFEST_VERSION:
        if not accept_unchecked:
            raise UncheckedManifestError(
                f"version {step} in {where}: its manifest is format {UNCHECKED_MANIFEST_VERSION}, which carries no "
                "checksum of its own, so a flipped bit in it would go unnoticed; it is not used. Restore it only "
                "if you trust it: TieredCheckpointer(..., accept_unchecked_manifests=True) (its chunks are still "
                "verified)")
        warnings.warn(f"TieredCheckpointer: version {step} in {where} has a format-{UNCHECKED_MANIFEST_VERSION} "
                      "manifest (no checksum of its own), used as accept_unchecked_manifests asks",
                      RuntimeWarning, stacklevel=3)
    elif isinstance(data, dict) and data.get("format") == MANIFEST_FORMAT and version == MANIFEST_VERSION:
        problem = manifest_seal.seal_problem(data, MANIFEST_CHECKSUM)
        if problem is not None:
            raise CorruptVersionError(f"version {step} in {where}: its manifest {problem}: it was altered or "
                                      "damaged; the version is not used")
    try:
        ok = (data["format"] == MANIFEST_FORMAT and data["version"] in (UNCHECKED_MANIFEST_VERSION, MANIFEST_VERSION)
              and data["step"] == step and data["chunk_bytes"] > 0
              and len(data["chunks_crc32c"]) == -(-data["payload_bytes"] // data["chunk_bytes"]))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise CorruptVersionError(f"version {step} in {where}: its manifest is not a {MANIFEST_FORMAT} "
                                  f"v{MANIFEST_VERSION} manifest that matches its step")
    return data


class ObjectStore:
    """One S3 client for one s3://BUCKET/PREFIX. Endpoint and credentials are found as boto3
    finds them (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE,
    ~/.aws), unless `endpoint_url` overrides the endpoint. Versions are PREFIX/vSTEP/."""

    def __init__(self, url: str, endpoint_url: str | None = None, connections: int = 10,
                 accept_unchecked: bool = False) -> None:
        self.bucket, self.prefix = parse_url(url)
        self.url = url
        self.accept_unchecked = accept_unchecked  # format-1 manifests (no checksum of their own)
        if endpoint_url is not None and not re.match(r"https?://[^/\s]", str(endpoint_url)):
            raise ValueError(f"endpoint_url must be an http(s):// URL, got {endpoint_url!r}")
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("the tiered checkpointer's object store needs boto3 "
                              "(pip install 'cossd[tiers]')") from None
        session = boto3.session.Session()
        config = Config(
            region_name=session.region_name or "us-east-1",
            # Each part carries our own CRC32C in the manifest; the flexible checksums'
            # aws-chunked bodies are not understood by every S3-compatible server.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # One retry at boto3's level: the policy sees every slow or failed part itself.
            retries={"max_attempts": 2, "mode": "standard"},
            connect_timeout=5, read_timeout=60,
            max_pool_connections=max(10, connections + 2),
            s3={"addressing_style": "path"},
        )
        with self.errors("connecting"):
            self.client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.endpoint = self.client.meta.endpoint_url

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """boto3's failures as StoreError naming what was being done, and where."""
        import botocore.exceptions as boto_errors

        try:
            yield
        except boto_errors.ClientError as exc:
            raise StoreError(f"object store {self.endpoint}: {what}: {exc}") from None
        except boto_errors.BotoCoreError as exc:  # no route, no credentials, a timeout
            raise StoreError(f"object store {self.endpoint}: {what}: {exc}") from None

    def key(self, step: int, name: str) -> str:
        return "/".join(p for p in (self.prefix, version_dir(step), name) if p)

    def check_bucket(self) -> None:
        with self.errors(f"bucket {self.bucket!r}"):
            self.client.head_bucket(Bucket=self.bucket)

    # ------------------------------------------------------------------ listing

    def complete_steps(self) -> list[int]:
        """The steps of the complete versions under the prefix (those with a manifest), ascending."""
        base = self.prefix + "/" if self.prefix else ""
        steps = []
        with self.errors(f"listing s3://{self.bucket}/{base}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base):
                for entry in page.get("Contents", []):
                    rest = entry["Key"][len(base):].split("/")
                    if len(rest) == 2 and rest[1] == MANIFEST_OBJECT and (m := _VERSION_DIR.fullmatch(rest[0])):
                        steps.append(int(m.group(1)))
        return sorted(steps)

    def read_manifest(self, step: int) -> dict[str, Any]:
        key = self.key(step, MANIFEST_OBJECT)
        with self.errors(f"reading s3://{self.bucket}/{key}"):
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        try:
            data = json.loads(body)
        except ValueError:
            raise CorruptVersionError(f"version {step} in {self.url}: its manifest is not JSON") from None
        return check_manifest(data, step, self.url, self.accept_unchecked)

    def abort_stale_uploads(self) -> int:
        """Abort every unfinished multipart upload of a version under the prefix (a process
        killed mid-upload leaves one); their versions have no manifest, so they were never
        listed. A prefix belongs to one checkpointer at a time. Returns how many were aborted."""
        base = self.prefix + "/" if self.prefix else ""
        aborted = 0
        with self.errors(f"listing the unfinished uploads under s3://{self.bucket}/{base}"):
            uploads = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=base).get("Uploads", [])
        for upload in uploads:
            # Only this checkpointer's own objects (PREFIX/vSTEP/data): a bucket may be shared.
            rest = upload["Key"][len(base):].split("/")
            if len(rest) == 2 and rest[1] == DATA_OBJECT and _VERSION_DIR.fullmatch(rest[0]):
                self.abort(upload["Key"], upload["UploadId"])
                aborted += 1
        return aborted

    # ------------------------------------------------------------------ one version's upload

    def begin(self, step: int) -> str:
        """Start the upload of a version: its old manifest (a step saved again) deleted first,
        so the version never looks complete while its data is being replaced."""
        with self.errors(f"replacing version {step}"):
            self.client.delete_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_OBJECT))
        key = self.key(step, DATA_OBJECT)
        with self.errors(f"starting the upload of s3://{self.bucket}/{key}"):
            return str(self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"])

    def put_part(self, step: int, upload_id: str, number: int, data: bytes) -> str:
        key = self.key(step, DATA_OBJECT)
        with self.errors(f"uploading part {number} of s3://{self.bucket}/{key}"):
            return str(self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                               PartNumber=number, Body=data)["ETag"])

    def finish(self, step: int, upload_id: str, etags: dict[int, str], record: dict[str, Any]) -> None:
        """Complete the data object, check its size, then write the manifest: last, so a
        version is listed exactly when all of it is in the store."""
        key = self.key(step, DATA_OBJECT)
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        with self.errors(f"completing the upload of s3://{self.bucket}/{key}"):
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
            size = int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        if size != record["payload_bytes"]:
            raise StoreError(f"s3://{self.bucket}/{key} holds {size} bytes after its upload, not "
                             f"{record['payload_bytes']}")
        # Sealed once complete: the seal covers every field, `archived` included.
        body = json.dumps(manifest_seal.sealed({**record, "archived": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                      time.gmtime())},
                                               MANIFEST_CHECKSUM)).encode()
        with self.errors(f"writing the manifest of version {step}"):
            self.client.put_object(Bucket=self.bucket, Key=self.key(step, MANIFEST_OBJECT), Body=body)

    def abort(self, key: str, upload_id: str) -> None:
        # Best effort: an upload left unaborted is aborted by the next checkpointer on the prefix.
        with contextlib.suppress(StoreError), self.errors(f"aborting an upload of s3://{self.bucket}/{key}"):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)

    # ------------------------------------------------------------------ download

    def read_version(self, step: int, into: bytearray | None = None) -> tuple[dict[str, Any], bytearray]:
        """A complete version's manifest and bytes, every chunk checked against its CRC32C
        (CorruptVersionError naming the chunk where one does not match)."""
        record = self.read_manifest(step)
        key = self.key(step, DATA_OBJECT)
        total, chunk = record["payload_bytes"], record["chunk_bytes"]
        data = into if into is not None else bytearray(total)
        view = memoryview(data)
        for index, expected in enumerate(record["chunks_crc32c"]):
            start, stop = index * chunk, min(total, (index + 1) * chunk)
            with self.errors(f"reading chunk {index} of s3://{self.bucket}/{key}"):
                body = self.client.get_object(Bucket=self.bucket, Key=key,
                                              Range=f"bytes={start}-{stop - 1}")["Body"].read()
            if len(body) != stop - start or crc32c.crc32c(body) != expected:
                raise CorruptVersionError(f"version {step} in {self.url}: chunk {index} (bytes {start}-{stop - 1} "
                                          f"of {key}) does not match its CRC32C")
            view[start:stop] = body
        return record, data
