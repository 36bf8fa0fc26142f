"""S3 storage through prefect-aws: a run's `S3Store`, and ``s3://`` inputs listed and fetched.

S3 goes through a `prefect_aws.S3Bucket` block's own methods and client (so a non-AWS endpoint
set on its credentials is honoured): boto3's managed transfer streams files from disk, multipart
above `MULTIPART_THRESHOLD_BYTES` with concurrent parts, and asks S3 for SHA-256 checksums. An
object counts as stored only once its size and checksum, read back with ``HeadObject``, match
the local file. s3transfer aborts a multipart upload that fails, so no half object is left.
`prefect_sandbox.tasks.storage` imports this module only for S3 storage or an ``s3://`` input:
prefect-aws and boto3 cost about 0.5 s to import, which a run to a local folder does not pay.
Manual: docs/how-to/s3.md.
"""

from __future__ import annotations

import base64
import hashlib
import mimetypes
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, cast

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError
from prefect_aws import AwsCredentials, MinIOCredentials, S3Bucket
from s3transfer.utils import ChunksizeAdjuster

from prefect_sandbox._compat import called_blocking, join_bucket_folder
from prefect_sandbox.results import StoredArtifact
from prefect_sandbox.s3uri import normalised_s3_key, parse_s3_uri
from prefect_sandbox.sandbox.errors import FileTransferError
from prefect_sandbox.sandbox.paths import checked_relative_path, path_segment, resolve_inside
from prefect_sandbox.sandbox.retries import sync_retrying
from prefect_sandbox.tasks.storage import (
    READ_CHUNK_BYTES,
    S3_BLOCK_PREFIX,
    ArtifactStore,
    PlannedInput,
    one_line,
)

__all__ = [
    "MULTIPART_CHUNK_BYTES",
    "MULTIPART_THRESHOLD_BYTES",
    "S3Credentials",
    "S3Store",
    "content_type_of",
    "download_s3_inputs",
    "s3_input_plan",
    "s3_store",
]

MULTIPART_THRESHOLD_BYTES = 8 << 20
MULTIPART_CHUNK_BYTES = 8 << 20
_MAX_CONCURRENCY = 4
_ATTEMPTS = 4
_TRANSIENT_CODES = frozenset(
    {"InternalError", "RequestTimeout", "SlowDown", "ServiceUnavailable", "Throttling"}
)
PRESIGNED_URL_LIFETIME_S = 7 * 24 * 3600  # S3's maximum for signature v4

S3Credentials = AwsCredentials | MinIOCredentials


def _sha256_digests(path: Path, part_bytes: int) -> tuple[int, bytes, list[bytes]]:
    """Size, whole-file SHA-256 and per-part SHA-256s of a file, in one streaming pass."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    part = hashlib.sha256()
    in_part = size = 0
    with path.open("rb") as reader:
        while chunk := reader.read(READ_CHUNK_BYTES):
            whole.update(chunk)
            size += len(chunk)
            while chunk:
                take = chunk[: part_bytes - in_part]
                part.update(take)
                in_part += len(take)
                chunk = chunk[len(take) :]
                if in_part == part_bytes:
                    parts.append(part.digest())
                    part, in_part = hashlib.sha256(), 0
    if in_part:
        parts.append(part.digest())
    return size, whole.digest(), parts


def _is_transient(error: BaseException) -> bool:
    if isinstance(error, S3UploadFailedError):
        # boto3 wraps the failing part's error; judge by that one.
        cause = error.__cause__ or error.__context__
        return cause is not None and _is_transient(cause)
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _TRANSIENT_CODES or status >= 500
    return isinstance(error, BotoCoreError)


_MIME_TYPES = mimetypes.MimeTypes()  # Python's own table only: the same on every machine
_MIME_TYPES.add_type("application/x-ipynb+json", ".ipynb")  # Jupyter's name for notebooks
_COMPRESSED_TYPES = {
    "gzip": "application/gzip",
    "bzip2": "application/x-bzip2",
    "xz": "application/x-xz",
    "br": "application/x-brotli",
}


def content_type_of(key: str) -> str | None:
    """The Content-Type an S3 object is stored with, from its name's extension (Python's
    ``mimetypes`` table, not the machine's): ``image/png``, ``application/json``,
    ``application/x-ipynb+json`` for a notebook; a compressed file's compression
    (``data.csv.gz`` is ``application/gzip``: never a Content-Encoding, so a browser saves
    what was stored); None for an unknown extension (S3 then says ``binary/octet-stream``)."""
    kind, encoding = _MIME_TYPES.guess_type(key, strict=False)
    if encoding is not None:
        return _COMPRESSED_TYPES.get(encoding)
    return kind


class S3Store(ArtifactStore):
    """Objects at ``<bucket_folder>/<prefix>/<relative path>`` of an `S3Bucket` block.

    Args:
        bucket: the prefect-aws block; its credentials (and endpoint) are used as they are.
        prefix: the run's part of the key, e.g. ``run-notebook/happy-cat-1f2e3d4c``.
    """

    def __init__(self, bucket: S3Bucket, prefix: str) -> None:
        self._bucket = bucket
        self._prefix = prefix.strip("/")

    @property
    def credentials(self) -> S3Credentials:
        """The bucket block's credentials."""
        return self._bucket.credentials

    def view_url(self, artifact: StoredArtifact) -> str | None:
        """A presigned GET URL, valid for `PRESIGNED_URL_LIFETIME_S` seconds."""
        bucket_name, _, key = artifact.location.removeprefix("s3://").partition("/")
        url = self.credentials.get_s3_client().generate_presigned_url(
            "get_object",
            Params={"Bucket": bucket_name, "Key": key},
            ExpiresIn=PRESIGNED_URL_LIFETIME_S,
        )
        return str(url)

    def prepare(self) -> None:
        client = self.credentials.get_s3_client()
        try:
            client.head_bucket(Bucket=self._bucket.bucket_name)
        except (ClientError, BotoCoreError) as exc:
            raise FileTransferError(
                f"bucket {self._bucket.bucket_name!r} cannot be reached: {exc}",
                path=self.output_dir,
            ) from exc

    def clear(self) -> int:
        client = self.credentials.get_s3_client()
        bucket = self._bucket.bucket_name
        # The trailing slash keeps a sibling run's prefix that merely starts alike out.
        folder = join_bucket_folder(self._bucket, self._prefix).rstrip("/") + "/"
        removed = 0
        try:
            for page in client.get_paginator("list_objects_v2").paginate(
                Bucket=bucket, Prefix=folder
            ):
                keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
                if not keys:
                    continue
                # One page is 1,000 keys at most, DeleteObjects' own limit.
                answer = client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
                if answer.get("Errors"):
                    first = answer["Errors"][0]
                    raise FileTransferError(
                        f"{len(answer['Errors'])} object(s) under {self.output_dir} could not be "
                        f"removed, e.g. {first['Key']!r}: {first.get('Message', first['Code'])}",
                        path=self.output_dir,
                    )
                removed += len(keys)
        except (ClientError, BotoCoreError) as exc:
            raise FileTransferError(
                f"objects under {self.output_dir} could not be removed: {exc}", path=self.output_dir
            ) from exc
        return removed

    @property
    def output_dir(self) -> str:
        key = join_bucket_folder(self._bucket, self._prefix)
        return f"s3://{self._bucket.bucket_name}/{key}"

    def store(self, source: Path, relative: str) -> StoredArtifact:
        checked_relative_path(relative)
        key_in_folder = f"{self._prefix}/{relative}"
        try:
            # Hash while uploading: hashlib releases the GIL, and the upload waits on I/O.
            with ThreadPoolExecutor(max_workers=1) as hasher:
                digests = hasher.submit(_sha256_digests, source, self._part_bytes(source))
                key = self._upload(source, key_in_folder)
                size, whole, parts = digests.result()
            self._verify(key, size, whole, parts, relative)
        except (ClientError, BotoCoreError, S3UploadFailedError) as exc:
            raise FileTransferError(
                f"artifact {relative!r} could not be stored in {self.output_dir}: {exc}",
                path=relative,
            ) from exc
        return StoredArtifact(
            path=relative,
            size_bytes=size,
            sha256=whole.hex(),
            location=f"s3://{self._bucket.bucket_name}/{key}",
        )

    def read(self, relative: str) -> bytes:
        checked_relative_path(relative)
        try:
            data = cast(
                bytes, called_blocking(self._bucket.read_path, f"{self._prefix}/{relative}")
            )
        except (ClientError, BotoCoreError) as exc:
            raise FileTransferError(
                f"stored file {relative!r} cannot be read from {self.output_dir}: {exc}",
                path=relative,
            ) from exc
        return data

    def nested_storage(self) -> S3Bucket:
        folder = join_bucket_folder(self._bucket, self._prefix)
        return self._bucket.model_copy(update={"bucket_folder": folder})

    @staticmethod
    def _part_bytes(source: Path) -> int:
        # s3transfer grows the part size for huge files (10,000 parts at most); match it.
        return int(
            ChunksizeAdjuster().adjust_chunksize(MULTIPART_CHUNK_BYTES, source.stat().st_size)
        )

    def _upload(self, source: Path, key_in_folder: str) -> str:
        """Upload with boto3's managed transfer; transient S3 errors are tried again."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD_BYTES,
            multipart_chunksize=MULTIPART_CHUNK_BYTES,
            max_concurrency=_MAX_CONCURRENCY,
        )
        extra_args = {"ChecksumAlgorithm": "SHA256"}
        content_type = content_type_of(key_in_folder)
        if content_type is not None:
            extra_args["ContentType"] = content_type
        upload_kwargs: dict[str, Any] = {"ExtraArgs": extra_args, "Config": config}
        bucket = self._bucket
        retrying = sync_retrying(
            attempts=_ATTEMPTS, retry_if=_is_transient, what=f"S3 upload of {key_in_folder!r}"
        )
        for attempt in retrying:
            with attempt:
                key = called_blocking(
                    bucket.upload_from_path, source, key_in_folder, **upload_kwargs
                )
                return str(key)
        raise AssertionError("unreachable: tenacity reraises")

    def _verify(self, key: str, size: int, whole: bytes, parts: list[bytes], relative: str) -> None:
        client = self._bucket.credentials.get_s3_client()
        head = client.head_object(Bucket=self._bucket.bucket_name, Key=key, ChecksumMode="ENABLED")
        stored = str(head.get("ChecksumSHA256", ""))
        checksum, _, part_count = stored.partition("-")
        if size >= MULTIPART_THRESHOLD_BYTES:
            # A multipart object's checksum is the SHA-256 of its parts' SHA-256s ("-N" suffix).
            expected = base64.b64encode(hashlib.sha256(b"".join(parts)).digest()).decode()
            counts_match = part_count in ("", str(len(parts)))
        else:
            expected = base64.b64encode(whole).decode()
            counts_match = part_count == ""
        if head["ContentLength"] != size or checksum != expected or not counts_match:
            client.delete_object(Bucket=self._bucket.bucket_name, Key=key)
            raise FileTransferError(
                f"artifact {relative!r}: stored object s3://{self._bucket.bucket_name}/{key} "
                f"does not match the local file ({head['ContentLength']} bytes, checksum "
                f"{stored!r}; expected {size} bytes, {expected!r}); it was deleted",
                path=relative,
            )


def _s3_plan(uri: str, credentials: S3Credentials) -> list[PlannedInput]:
    """The files an ``s3://`` object, or every object under a ``s3://.../`` prefix, puts in
    the sandbox; a prefix is listed, nothing is downloaded."""
    bucket_name, key = parse_s3_uri(uri)
    if key and not key.endswith("/"):
        return [PlannedInput(uri, PurePosixPath(key).name, key=key)]
    bucket = S3Bucket(bucket_name=bucket_name, credentials=credentials)
    folder = PurePosixPath(key.rstrip("/")).name or bucket_name
    planned = []
    listing = cast(list[dict[str, Any]], called_blocking(bucket.list_objects, key))
    for item in listing:
        if item["Key"].endswith("/"):
            continue  # a console's empty "folder" marker, not a file
        relative = f"{folder}/{PurePosixPath(item['Key']).relative_to(key or '.').as_posix()}"
        checked_relative_path(relative)
        planned.append(PlannedInput(uri, relative, key=item["Key"]))
    if not planned:
        raise FileTransferError(f"input {uri!r} matches no object", path=uri)
    return planned


def s3_store(storage: S3Bucket | str, flow_name: str, run_folder: str) -> S3Store:
    """The store of one run under an S3 ``storage`` (for
    `prefect_sandbox.tasks.storage.resolve_storage`, which documents the forms and the keys).

    Args:
        storage: an `S3Bucket` block, ``"s3-bucket/<name>"`` or ``"s3://bucket/prefix"``.
        flow_name: the flow's name (the first segment of the run's prefix).
        run_folder: the run's own segment, e.g. ``happy-cat-1f2e3d4c``.

    Raises:
        ValueError: a malformed ``s3://`` URI.
        UnsafePathError: the key or ``bucket_folder`` has a ``.`` or ``..`` segment.
    """
    if isinstance(storage, str) and storage.startswith(S3_BLOCK_PREFIX):
        storage = cast(S3Bucket, S3Bucket.load(storage[len(S3_BLOCK_PREFIX) :]))
    elif isinstance(storage, str):
        bucket_name, folder = parse_s3_uri(storage)
        storage = S3Bucket(
            bucket_name=bucket_name, bucket_folder=folder, credentials=AwsCredentials()
        )
    folder = normalised_s3_key(storage.bucket_folder, f"bucket_folder {storage.bucket_folder!r}")
    storage = storage.model_copy(update={"bucket_folder": folder})
    return S3Store(storage, f"{path_segment(flow_name) or 'flow'}/{run_folder}")


def s3_input_plan(uri: str, credentials: S3Credentials | None) -> list[PlannedInput]:
    """The files an ``s3://`` input puts in the sandbox (for
    `prefect_sandbox.tasks.storage.plan_inputs`).

    Raises:
        FileTransferError: the object or prefix cannot be listed, or a prefix matches nothing.
        UnsafePathError: a key would leave its folder (``..``).
    """
    try:
        return _s3_plan(uri, credentials or AwsCredentials())
    except (ClientError, BotoCoreError) as exc:
        raise FileTransferError(
            f"input {uri!r} could not be read: {one_line(exc)}", path=uri
        ) from exc


def download_s3_inputs(
    planned: list[PlannedInput], staging: Path, credentials: S3Credentials | None
) -> list[tuple[Path, str]]:
    """Stream the planned ``s3://`` objects to ``staging`` on disk.

    Returns:
        ``(local file, path inside the sandbox)`` pairs, in ``planned``'s order.

    Raises:
        FileTransferError: an object could not be downloaded (names it).
    """
    pairs: list[tuple[Path, str]] = []
    buckets: dict[str, S3Bucket] = {}
    for item in planned:
        bucket_name, _ = parse_s3_uri(item.origin)
        if bucket_name not in buckets:
            buckets[bucket_name] = S3Bucket(
                bucket_name=bucket_name, credentials=credentials or AwsCredentials()
            )
        target = resolve_inside(staging, item.dest)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            called_blocking(buckets[bucket_name].download_object_to_path, item.key, target)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise FileTransferError(
                f"input {item.origin!r}: object {item.key!r} could not be downloaded: "
                f"{one_line(exc)}",
                path=item.origin,
            ) from exc
        pairs.append((target, item.dest))
    return pairs
