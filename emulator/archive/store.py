"""The archive tier's object store: S3 locations (s3://BUCKET/PREFIX), the boto3 client
that counts the device's network bytes, and the store's errors as device statuses. boto3 is
optional (the `tiers` extra). The objects of a version: docs/tiers.md."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from ...protocol.manifest_seal import SEAL_FIELD
from ...protocol.status import DeviceError, Status

log = logging.getLogger("cossd.emulator.archive")

MANIFEST_OBJECT = "manifest.json"
STATE_OBJECT = "state"
SUPERBLOCK_OBJECT = "sb"
META_OBJECT = "meta.json"
MANIFEST_FORMAT = "cossd-archive"
# 2: the manifest carries `manifest_crc32c`, its own checksum (format 1 had none).
MANIFEST_VERSION = 2
UNCHECKED_MANIFEST_VERSION = 1
# 3: version 2 whose objects lie under a generation (a replaced version, `generation` field).
# A cossd that reads only 1 and 2 then refuses it by its version, saying so, rather than
# failing on objects it looks for under the plain names.
GENERATION_MANIFEST_VERSION = 3
MANIFEST_CHECKSUM = SEAL_FIELD  # "manifest_crc32c", the trainer's tiered manifests' field too
MIB = 1 << 20
# S3 refuses parts under 5 MiB (the last excepted) and more than 10 000 parts.
MIN_CHUNK_BYTES = 5 * MIB
MAX_CHUNK_BYTES = 1 << 30
MAX_PARTS = 10_000
DEFAULT_CHUNK_BYTES = 8 * MIB
# The most chunk bytes an upload or a restore holds at once, whatever the namespace's size.
DEFAULT_MEMORY_BYTES = 64 * MIB
MAX_MEMORY_BYTES = 16 << 30
PAYLOAD_KEYS = {"tag", "url", "endpoint_url", "chunk_bytes", "memory_bytes", "overwrite"}
LIST_KEYS = {"url", "endpoint_url"}
BOTO3_MISSING = ("the archive tier needs boto3, which is not installed on the device's node "
                 "(pip install 'cossd[tiers]')")
# A bucket name as S3 allows it (3-63 lowercase letters, digits, dots and hyphens).
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


# ---------------------------------------------------------------------- locations


@dataclasses.dataclass(frozen=True)
class Location:
    """A bucket and a key prefix (no leading or trailing '/')."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, *parts: str) -> "Location":
        return Location(self.bucket, self.key(*parts))

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


# A replaced version's objects carry a generation (random hex) before their names: the new
# objects go beside the old ones, the new manifest names them, and only then do the old go.
GENERATION_CHARS = frozenset("0123456789abcdef")


def object_key(version: Location, manifest: Any, name: str) -> str:
    """The key of object `name` (STATE_OBJECT, ...) of the version whose manifest (or listing)
    is `manifest`: `<generation>.<name>` where it names a generation (a version replaced by
    an overwrite), else `name`."""
    generation = manifest.get("generation") if manifest is not None else None
    return version.key(f"{generation}.{name}" if generation else name)


def parse_url(url: object) -> Location:
    """s3://BUCKET[/PREFIX] as a Location; anything else is INVALID_FIELD."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise DeviceError(Status.INVALID_FIELD, f"an archive location is s3://BUCKET/PREFIX, got {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise DeviceError(Status.INVALID_FIELD, f"{bucket!r} is not a bucket name (3-63 of a-z 0-9 . -)")
    parts = [p for p in prefix.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise DeviceError(Status.INVALID_FIELD, f"{url!r}: '.' and '..' are not key components")
    return Location(bucket, "/".join(parts))


# ---------------------------------------------------------------------- the store


@dataclasses.dataclass
class Traffic:
    """Bytes the device moved over its own network link (never the host link)."""

    network_bytes_sent: int = 0
    network_bytes_received: int = 0
    requests: int = 0
    archives_completed: int = 0
    archives_failed: int = 0
    parts_uploaded: int = 0
    parts_resumed: int = 0
    # The uploads' AIMD window of parts in flight (protocol/pacing.py): each part back within
    # its latency target opened it by one, each slow or failed part halved it.
    window_increases: int = 0
    window_decreases: int = 0

    def add(self, other: "Traffic") -> None:
        with _TRAFFIC:
            for field in dataclasses.fields(self):
                setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


# Held while a Traffic's counters change (several jobs' threads count into one namespace's).
_TRAFFIC = threading.Lock()


# The holder of the device's own clients: the process `cossd mount` started.
DAEMON = "the device's daemon"
# Where a process finds S3 credentials, for the error that says none were found.
CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in its environment, "
                      "or ~/.aws/credentials of the user it runs as")


def no_credentials(holder: str, endpoint: str, what: str) -> DeviceError:
    """The error for boto3's NoCredentialsError: which process looked, where it looks, and how
    the daemon gets them (it reads its environment once, when `cossd mount` starts it)."""
    daemon = holder.startswith(DAEMON)
    how = ("set them in the environment of `cossd mount` (e.g. `AWS_ACCESS_KEY_ID=... "
           "AWS_SECRET_ACCESS_KEY=... cossd mount BACKING MOUNTPOINT`; with sudo, `sudo -E` or "
           "/root/.aws/credentials) and mount again: the daemon uploads, not the `cossd archive` "
           "that asked it" if daemon else "set them where this command runs")
    return DeviceError(Status.DATA_TRANSFER_ERROR,
                       f"object store: {what}{'' if endpoint in what else ' at ' + endpoint}: {holder} has no S3 "
                       f"credentials; it reads "
                       f"{CREDENTIAL_SOURCES}: {how}. docs/tiers.md#a-store-to-try-seaweedfs")


@contextlib.contextmanager
def store_errors(what: str, holder: str = "this process", endpoint: str = "") -> Iterator[None]:
    """A failure of the store or of the way to it, as DATA_TRANSFER_ERROR naming `what`;
    missing credentials as an error naming `holder`, the process that needs them."""
    import botocore.exceptions as errors

    try:
        yield
    except errors.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404", "NotFound"):
            raise DeviceError(Status.SNAPSHOT_NOT_FOUND, f"object store: {what}: not found") from None
        if code == "NoSuchBucket":
            raise DeviceError(Status.INVALID_FIELD, f"object store: {what}: no such bucket") from None
        raise DeviceError(Status.DATA_TRANSFER_ERROR, f"object store: {what}: {exc}") from None
    except errors.NoCredentialsError:
        raise no_credentials(holder, endpoint, what) from None
    except errors.BotoCoreError as exc:  # no route, a timeout
        raise DeviceError(Status.DATA_TRANSFER_ERROR, f"object store: {what}: {exc}") from None


class Store:
    """One S3 client. Endpoint and credentials are found as boto3 finds them
    (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws),
    unless `endpoint_url` overrides the endpoint. `holder` names the process for the error
    that says it has no credentials."""

    def __init__(self, endpoint_url: str | None = None, connections: int = 10,
                 traffic: Traffic | None = None, holder: str = "this process") -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise DeviceError(Status.INVALID_FIELD, BOTO3_MISSING) from None
        session = boto3.session.Session()
        config = Config(
            region_name=session.region_name or "us-east-1",
            # Every chunk carries the archive's own CRC32C; the flexible checksums' aws-chunked
            # bodies are not understood by every S3-compatible server.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": 4, "mode": "standard"},
            connect_timeout=5, read_timeout=60,
            max_pool_connections=max(10, connections + 2),
            s3={"addressing_style": "path"},
        )
        with store_errors("connecting", f"{holder} (pid {os.getpid()})", endpoint_url or "(as boto3 finds it)"):
            self.client = session.client("s3", endpoint_url=endpoint_url or None, config=config)
        self.endpoint = self.client.meta.endpoint_url
        self.holder = f"{holder} (pid {os.getpid()})"
        if endpoint_url is None and "AWS_ENDPOINT_URL" not in os.environ and "amazonaws.com" in self.endpoint:
            # Said in the errors: an endpoint nobody chose is AWS's, not the store the user meant.
            self.endpoint += (" (AWS's public endpoint: neither --endpoint-url nor AWS_ENDPOINT_URL "
                              f"was given to {self.holder})")
        self.traffic = traffic if traffic is not None else Traffic()

    def errors(self, what: str) -> contextlib.AbstractContextManager[None]:
        """store_errors, naming this client's process and endpoint."""
        return store_errors(what, self.holder, self.endpoint)

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with _TRAFFIC:
            self.traffic.network_bytes_sent += sent
            self.traffic.network_bytes_received += received
            self.traffic.requests += 1

    def bump(self, counter: str, by: int = 1) -> None:
        with _TRAFFIC:
            setattr(self.traffic, counter, getattr(self.traffic, counter) + by)

    def check_bucket(self, location: Location) -> None:
        try:
            with self.errors(f"bucket {location.bucket!r} at {self.endpoint}"):
                self.client.head_bucket(Bucket=location.bucket)
        except DeviceError as exc:
            if exc.status != Status.SNAPSHOT_NOT_FOUND:
                raise
            raise DeviceError(Status.INVALID_FIELD, f"object store {self.endpoint} has no bucket "
                                                    f"{location.bucket!r}") from None
        finally:
            self._count()

    def exists(self, bucket: str, key: str) -> bool:
        try:
            with self.errors(f"s3://{bucket}/{key}"):
                self.client.head_object(Bucket=bucket, Key=key)
        except DeviceError as exc:
            if exc.status == Status.SNAPSHOT_NOT_FOUND:
                return False
            raise
        finally:
            self._count()
        return True

    def put(self, bucket: str, key: str, data: bytes) -> None:
        with self.errors(f"writing s3://{bucket}/{key}"):
            self.client.put_object(Bucket=bucket, Key=key, Body=data)
        self._count(sent=len(data))

    def get(self, bucket: str, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """An object's bytes, or [start, stop) of them."""
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
        with self.errors(f"reading s3://{bucket}/{key}"):
            data = self.client.get_object(Bucket=bucket, Key=key, **extra)["Body"].read()
        self._count(received=len(data))
        return data

    def size(self, bucket: str, key: str) -> int:
        with self.errors(f"s3://{bucket}/{key}"):
            size = int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        self._count()
        return size

    def delete(self, bucket: str, key: str) -> None:
        with self.errors(f"deleting s3://{bucket}/{key}"):
            self.client.delete_object(Bucket=bucket, Key=key)
        self._count()

    def keys(self, location: Location) -> Iterator[str]:
        prefix = location.key() + "/" if location.prefix else ""
        with self.errors(f"listing {location.url}"):
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=location.bucket, Prefix=prefix):
                self._count()
                for entry in page.get("Contents", []):
                    yield entry["Key"]

    # ------------------------------------------------------------------ multipart

    def pending_upload(self, bucket: str, key: str) -> tuple[str | None, dict[int, tuple[str, int]]]:
        """The newest unfinished multipart upload of `key` (an upload cut short) and its
        parts {number: (etag, size)}; older ones are aborted. (None, {}) if there is none."""
        with self.errors(f"listing the uploads of s3://{bucket}/{key}"):
            uploads = [u for u in self.client.list_multipart_uploads(Bucket=bucket, Prefix=key)
                       .get("Uploads", []) if u["Key"] == key]
        self._count()
        if not uploads:
            return None, {}
        uploads.sort(key=lambda u: u["Initiated"])
        for stale in uploads[:-1]:
            self.abort(bucket, key, stale["UploadId"])
        upload_id = uploads[-1]["UploadId"]
        parts: dict[int, tuple[str, int]] = {}
        with self.errors(f"listing the parts of s3://{bucket}/{key}"):
            for page in self.client.get_paginator("list_parts").paginate(
                    Bucket=bucket, Key=key, UploadId=upload_id):
                self._count()
                for part in page.get("Parts", []):
                    parts[int(part["PartNumber"])] = (part["ETag"], int(part["Size"]))
        return upload_id, parts

    def start_upload(self, bucket: str, key: str) -> str:
        with self.errors(f"starting the upload of s3://{bucket}/{key}"):
            upload_id = self.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        self._count()
        return str(upload_id)

    def put_part(self, bucket: str, key: str, upload_id: str, number: int, data: bytes) -> str:
        with self.errors(f"uploading part {number} of s3://{bucket}/{key}"):
            etag = self.client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id,
                                           PartNumber=number, Body=data)["ETag"]
        self._count(sent=len(data))
        return str(etag)

    def finish_upload(self, bucket: str, key: str, upload_id: str, etags: dict[int, str]) -> None:
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        with self.errors(f"completing the upload of s3://{bucket}/{key}"):
            self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        self._count()

    def abort_uploads(self, location: Location, keep: str | None = None) -> None:
        """Abort every unfinished multipart upload under `location`'s folder (a replacement's
        cut short: its generation is never resumed), but those of key `keep`."""
        prefix = location.key() + "/" if location.prefix else ""
        with self.errors(f"listing the uploads under {location.url}"):
            uploads = self.client.list_multipart_uploads(Bucket=location.bucket, Prefix=prefix).get("Uploads", [])
        self._count()
        for upload in uploads:
            if upload["Key"] != keep:
                self.abort(location.bucket, upload["Key"], upload["UploadId"])

    def abort(self, bucket: str, key: str, upload_id: str) -> None:
        with contextlib.suppress(DeviceError), self.errors(f"aborting an upload of s3://{bucket}/{key}"):
            self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        self._count()


def parse_endpoint(endpoint: object) -> str | None:
    """An endpoint override: None (boto3's own), or an http(s):// URL."""
    if endpoint is None:
        return None
    if not (isinstance(endpoint, str) and re.match(r"https?://[^/\s]", endpoint)):
        raise DeviceError(Status.INVALID_FIELD, f"endpoint_url must be an http(s):// URL, got {endpoint!r}")
    return endpoint
