"""Where a flow's inputs come from and its artifacts go: a local folder, or S3 via prefect-aws.

S3 goes through a `prefect_aws.S3Bucket` block's own methods and client (so a non-AWS endpoint
set on its credentials is honoured): boto3's managed transfer streams files from disk, multipart
above `MULTIPART_THRESHOLD_BYTES` with concurrent parts, and asks S3 for SHA-256 checksums. An
object counts as stored only once its size and checksum, read back with ``HeadObject``, match
the local file. s3transfer aborts a multipart upload that fails, so no half object is left.
Manual: docs/how-to/s3.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import mimetypes
import os
import shutil
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import BotoCoreError, ClientError
from prefect import get_run_logger, task
from prefect.artifacts import acreate_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect_aws import AwsCredentials, MinIOCredentials, S3Bucket
from s3transfer.utils import ChunksizeAdjuster

from prefect_sandbox._compat import called_blocking, join_bucket_folder
from prefect_sandbox.markdown_text import table_cell
from prefect_sandbox.results import StoredArtifact
from prefect_sandbox.s3uri import is_s3_uri, normalised_s3_key, parse_s3_uri
from prefect_sandbox.sandbox.errors import FileTransferError, SandboxError
from prefect_sandbox.sandbox.paths import (
    checked_relative_path,
    path_segment,
    resolve_inside,
    run_folder_name,
)
from prefect_sandbox.sandbox.retries import sync_retrying

__all__ = [
    "MULTIPART_THRESHOLD_BYTES",
    "ArtifactStore",
    "LocalFolderStore",
    "PlannedInput",
    "S3Store",
    "content_type_of",
    "fetch_inputs",
    "input_credentials",
    "normalised_s3_key",
    "parse_s3_uri",
    "plan_inputs",
    "resolve_storage",
    "store_artifacts",
    "stored_table_rows",
]

MULTIPART_THRESHOLD_BYTES = 8 << 20
MULTIPART_CHUNK_BYTES = 8 << 20
_MAX_CONCURRENCY = 4
_READ_CHUNK_BYTES = 1 << 20
_ATTEMPTS = 4
_TRANSIENT_CODES = frozenset(
    {"InternalError", "RequestTimeout", "SlowDown", "ServiceUnavailable", "Throttling"}
)
S3_BLOCK_PREFIX = "s3-bucket/"
PRESIGNED_URL_LIFETIME_S = 7 * 24 * 3600  # S3's maximum for signature v4
TABLE_ROWS_SHOWN = 500
"""Stored files listed in the run's table artifact at most (10,000 rows weigh about 2 MB)."""

S3Credentials = AwsCredentials | MinIOCredentials


def _sha256_digests(path: Path, part_bytes: int) -> tuple[int, bytes, list[bytes]]:
    """Size, whole-file SHA-256 and per-part SHA-256s of a file, in one streaming pass."""
    whole = hashlib.sha256()
    parts: list[bytes] = []
    part = hashlib.sha256()
    in_part = size = 0
    with path.open("rb") as reader:
        while chunk := reader.read(_READ_CHUNK_BYTES):
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


class ArtifactStore(ABC):
    """A destination for one flow run's files."""

    @property
    @abstractmethod
    def output_dir(self) -> str:
        """Where the run's files go: a folder path or an ``s3://`` URI (a result's
        ``output_dir``)."""

    @abstractmethod
    def view_url(self, artifact: StoredArtifact) -> str | None:
        """An https or http URL a browser can open to view a stored file, or None."""

    @abstractmethod
    def prepare(self) -> None:
        """Check, before any work, that files can be stored here.

        Raises:
            FileTransferError: they cannot (names the destination).
        """

    @abstractmethod
    def clear(self) -> int:
        """Remove every file stored under the run's ``output_dir`` (an earlier attempt's, when the
        flow run is retried: its folder is the same), so that ``summary.json`` lists exactly
        the files there.

        Returns:
            How many files were removed.

        Raises:
            FileTransferError: a file could not be removed (names the folder).
        """

    @abstractmethod
    def store(self, source: Path, relative: str) -> StoredArtifact:
        """Store one local file under ``relative``, verified.

        Args:
            source: the local file.
            relative: its POSIX path relative to the run's ``output_dir``.

        Returns:
            What was stored: path, size_bytes, sha256 (hex) and location.

        Raises:
            UnsafePathError: ``relative`` climbs out with ``..`` or is absolute.
            FileTransferError: it could not be stored, or the stored copy does not match.
        """

    @abstractmethod
    def read(self, relative: str) -> bytes:
        """Read back one stored file.

        Args:
            relative: its POSIX path relative to the run's ``output_dir``.

        Returns:
            Its content.

        Raises:
            UnsafePathError: ``relative`` climbs out with ``..`` or is absolute.
            FileTransferError: it is not there, or could not be read (names it).
        """

    @abstractmethod
    def nested_storage(self) -> S3Bucket | str:
        """The ``storage`` argument under which another flow run's folder lands inside this
        run's ``output_dir`` (a sweep's branches do so).

        Returns:
            This run's folder (local), or a copy of the `S3Bucket` block whose folder is this
            run's prefix (its credentials kept).
        """


class LocalFolderStore(ArtifactStore):
    """Files under one run's folder, e.g. ``<folder>/<run-folder>/``."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder

    @property
    def output_dir(self) -> str:
        return str(self._folder.resolve())

    def view_url(self, artifact: StoredArtifact) -> str | None:
        return None

    def prepare(self) -> None:
        try:
            self._folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FileTransferError(
                f"output folder {str(self._folder)!r} cannot be made: {exc.strerror}",
                path=str(self._folder),
            ) from exc

    def clear(self) -> int:
        removed = 0
        try:
            for entry in list(self._folder.iterdir()):
                if entry.is_dir() and not entry.is_symlink():
                    removed += sum(1 for p in entry.rglob("*") if not p.is_dir())
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                    removed += 1
        except FileNotFoundError:
            return removed
        except OSError as exc:
            raise FileTransferError(
                f"output folder {self.output_dir!r} cannot be emptied: {exc}", path=self.output_dir
            ) from exc
        return removed

    def store(self, source: Path, relative: str) -> StoredArtifact:
        target = resolve_inside(self._folder, relative)
        digest = hashlib.sha256()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with source.open("rb") as reader, target.open("wb") as writer:
                while chunk := reader.read(_READ_CHUNK_BYTES):
                    digest.update(chunk)
                    writer.write(chunk)
        except OSError as exc:
            raise FileTransferError(
                f"artifact {relative!r} could not be stored in {self.output_dir}: {_one_line(exc)}",
                path=relative,
            ) from exc
        return StoredArtifact(
            path=relative,
            size_bytes=target.stat().st_size,
            sha256=digest.hexdigest(),
            location=str(target),
        )

    def read(self, relative: str) -> bytes:
        source = resolve_inside(self._folder, relative)
        try:
            return source.read_bytes()
        except OSError as exc:
            raise FileTransferError(
                f"stored file {relative!r} cannot be read from {self.output_dir}: {exc.strerror}",
                path=relative,
            ) from exc

    def nested_storage(self) -> str:
        return self.output_dir


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


def input_credentials(store: ArtifactStore | None) -> S3Credentials | None:
    """The credentials ``s3://`` inputs are read with: an S3 store's; else None (the standard
    AWS environment)."""
    return store.credentials if isinstance(store, S3Store) else None


def resolve_storage(
    storage: S3Bucket | str,
    flow_name: str,
    flow_run_name: str,
    flow_run_id: str,
    *,
    folder_suffix: str = "",
) -> ArtifactStore:
    """Turn a flow's ``storage`` argument into a store for this run.

    Each run gets its own folder (or key prefix), one path segment named by `run_folder_name`:
    unique even for runs with equal names, and never outside ``storage``.

    Args:
        storage: an `S3Bucket` block; ``"s3-bucket/<name>"``, a saved block's name;
            ``"s3://bucket/prefix"``, with credentials from the standard AWS environment; or
            a local folder.
        flow_name: the flow's name (part of S3 keys).
        flow_run_name: the flow run's name.
        flow_run_id: the flow run's UUID as a string.
        folder_suffix: added to the run's folder name, for a run's second store and later
            (a flow run's second sandbox session: ``"-session-2"``).

    Returns:
        The store; S3 keys are ``<bucket_folder>/<flow-name>/<run-folder>/<path>``, local
        files ``<folder>/<run-folder>/<path>``, where ``<run-folder>`` is e.g.
        ``happy-cat-1f2e3d4c`` (and ``happy-cat-1f2e3d4c-session-2``).

    Raises:
        ValueError: a malformed ``s3://`` URI.
        UnsafePathError: an ``s3://`` URI's key or a block's ``bucket_folder`` has a ``.`` or
            ``..`` segment (`normalised_s3_key`; empty segments are dropped instead).
    """
    run_folder = run_folder_name(flow_run_name, flow_run_id) + folder_suffix
    if isinstance(storage, str) and storage.startswith(S3_BLOCK_PREFIX):
        storage = S3Bucket.load(storage[len(S3_BLOCK_PREFIX) :])  # type: ignore[assignment]
    elif isinstance(storage, str) and is_s3_uri(storage):
        bucket_name, folder = parse_s3_uri(storage)
        storage = S3Bucket(
            bucket_name=bucket_name, bucket_folder=folder, credentials=AwsCredentials()
        )
    if isinstance(storage, S3Bucket):
        folder = normalised_s3_key(
            storage.bucket_folder, f"bucket_folder {storage.bucket_folder!r}"
        )
        storage = storage.model_copy(update={"bucket_folder": folder})
        return S3Store(storage, f"{path_segment(flow_name) or 'flow'}/{run_folder}")
    return LocalFolderStore(Path(storage) / run_folder)


def stored_table_rows(stored: list[StoredArtifact]) -> list[dict[str, str | int]]:
    """Rows of the stored-files table artifact: the first `TABLE_ROWS_SHOWN` files, then one
    row saying how many more there are (and their bytes), all of them being in summary.json.

    Returns:
        ``{"key": location, "bytes": size, "sha256": hex digest}`` rows; the UI renders a cell
        as markdown, so the location, whose file name a cell chose, is escaped (`table_cell`).
    """
    rows: list[dict[str, str | int]] = [
        {"key": table_cell(a.location), "bytes": a.size_bytes, "sha256": a.sha256}
        for a in stored[:TABLE_ROWS_SHOWN]
    ]
    rest = stored[TABLE_ROWS_SHOWN:]
    if rest:
        rows.append(
            {
                "key": f"… and {len(rest)} more file(s), all listed in summary.json",
                "bytes": sum(a.size_bytes for a in rest),
                "sha256": "",
            }
        )
    return rows


@task(name="store-artifacts", cache_policy=NO_CACHE, retries=0)
async def store_artifacts(
    staging_dir: str, paths: list[str], store: ArtifactStore
) -> tuple[list[StoredArtifact], list[str]]:
    """Store staged files, verified, and list them in a table artifact on the flow run.

    Every file is tried; transient S3 errors are retried with backoff, and a file that still
    fails is logged and reported without stopping the others.

    Args:
        staging_dir: the local folder holding the files.
        paths: their relative paths.
        store: where they go.

    Returns:
        The stored files, and one line per file that could not be stored, naming it.
    """
    logger = get_run_logger()
    staging = Path(staging_dir)
    stored: list[StoredArtifact] = []
    failures: list[str] = []
    for path in paths:
        try:
            source = resolve_inside(staging, path)
            stored.append(await asyncio.to_thread(store.store, source, path))
        except (SandboxError, ClientError, BotoCoreError, OSError) as exc:
            logger.error("Artifact %r was not stored: %s", path, exc)
            failures.append(f"{path!r} ({exc})")
    if stored:
        await acreate_table_artifact(
            key="stored-artifacts",
            table=stored_table_rows(stored),
            description=f"Files stored under {store.output_dir}",
        )
    return stored, failures


@dataclass(frozen=True)
class PlannedInput:
    """One file an input puts in the sandbox (`plan_inputs`).

    Attributes:
        origin: the input as given: a local path or an ``s3://`` URI.
        dest: its POSIX path in the sandbox, relative to the working directory.
        local: the local file; None for an S3 object.
        key: the S3 object's key, in the bucket ``origin`` names; None for a local file.
    """

    origin: str
    dest: str
    local: Path | None = None
    key: str | None = None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


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


def _shown(planned: PlannedInput) -> str:
    if PurePosixPath(planned.dest).name == planned.dest:
        return repr(planned.origin)
    return f"{planned.origin!r} (its {planned.dest!r})"


def _checked_one_path_each(planned: list[PlannedInput]) -> None:
    """Refuse inputs that would land on one path, or need one path as a file and a folder.

    Raises:
        FileTransferError: names both inputs and the path.
    """
    files: dict[str, PlannedInput] = {}
    folders: dict[str, PlannedInput] = {}
    for item in planned:
        parts = item.dest.split("/")
        above = ["/".join(parts[:n]) for n in range(1, len(parts))]
        other = files.get(item.dest)
        if other is not None:
            raise FileTransferError(
                f"inputs {_shown(other)} and {_shown(item)} would both land on "
                f"{item.dest!r} in the sandbox",
                path=item.dest,
            )
        clash = folders.get(item.dest) or next((files[a] for a in above if a in files), None)
        if clash is not None:
            file, inside = (
                (item, clash) if clash.dest.startswith(f"{item.dest}/") else (clash, item)
            )
            raise FileTransferError(
                f"inputs {_shown(file)} and {_shown(inside)} clash in the sandbox: "
                f"{file.dest!r} would be a file and the folder of {inside.dest!r}",
                path=file.dest,
            )
        files[item.dest] = item
        for folder in above:
            folders.setdefault(folder, item)


def _link_problem(link: Path, root: Path, shown_root: str) -> str | None:
    """Why the link ``link`` is not followed, or None when it leads to a file inside ``root``
    (a real folder, named to people as ``shown_root``)."""
    target = link.resolve()
    if not target.is_relative_to(root):
        return f"a link that leaves {shown_root}"
    if target.is_dir():
        return "a link to a folder"
    if not target.is_file():
        return "a link to no file"
    return None


def _folder_inputs(item: str, name: str) -> tuple[list[tuple[Path, str]], list[str]]:
    """A local folder's files, and the links in it that are skipped, each with why.

    A link to a file inside the folder is followed; a link that leaves the folder, a link to a
    folder (never descended: its target, if inside, is uploaded already) and a broken link are
    skipped, so a link to ``/etc`` or to a key file never uploads what it points at.
    """
    source = Path(item)
    root = source.resolve()
    pairs: list[tuple[Path, str]] = []
    skipped: list[str] = []
    for folder, dirs, files in os.walk(source):  # followlinks=False
        here = Path(folder)
        for entry in sorted([*dirs, *files]):
            path = here / entry
            shown = (Path(item) / path.relative_to(source)).as_posix()
            if path.is_symlink():
                problem = _link_problem(path, root, repr(item))
                if problem is not None:
                    skipped.append(f"{shown!r} ({problem})")
                    continue
            if entry in files and path.is_file():
                pairs.append((path, (Path(name) / path.relative_to(source)).as_posix()))
    return sorted(pairs, key=lambda pair: pair[1]), skipped


def plan_inputs(
    inputs: list[str], credentials: S3Credentials | None
) -> tuple[list[PlannedInput], list[str]]:
    """The files the inputs put in the sandbox, and where, checked before any is copied.

    Local files keep their name; local folders their name and tree, where links that leave
    the folder, links to folders and broken links are skipped; an ``s3://`` object keeps its
    name, a ``s3://.../`` prefix is listed and keeps its last segment and tree. An input that
    is itself a link is followed only to a file in the link's own folder.

    Args:
        inputs: local paths or ``s3://`` URIs.
        credentials: AWS credentials for ``s3://`` inputs; None for the standard environment.

    Returns:
        The planned files, and one line per skipped link naming it and why.

    Raises:
        FileTransferError: an input does not exist, cannot be read or listed, or is a link to
            a folder, out of its own folder or to nothing; or two would land on one path, or
            need one path as a file and as a folder (names both).
        UnsafePathError: an S3 key would leave its folder (``..``).
    """
    planned: list[PlannedInput] = []
    skipped: list[str] = []
    for item in inputs:
        try:
            if is_s3_uri(item):
                planned.extend(_s3_plan(item, credentials or AwsCredentials()))
                continue
            source = Path(item)
            if source.is_symlink():
                # As a link in a folder: followed only to a file in its own folder, so a link
                # to "/etc" or to a key file never uploads what it points at.
                parent = source.absolute().parent.resolve()
                problem = _link_problem(source, parent, "its folder")
                if problem is not None:
                    raise FileTransferError(f"input {item!r} is {problem}", path=item)
            # Resolved, so that "." or "../data" land under the folder's real name.
            name = source.resolve().name
            if source.is_dir():
                found, refused = _folder_inputs(item, name)
                planned.extend(PlannedInput(item, dest, local=path) for path, dest in found)
                skipped.extend(refused)
            elif source.is_file():
                planned.append(PlannedInput(item, name, local=source))
            else:
                raise FileTransferError(f"input {item!r} is neither a file nor a folder", path=item)
        except (ClientError, BotoCoreError, OSError) as exc:
            raise FileTransferError(
                f"input {item!r} could not be read: {_one_line(exc)}", path=item
            ) from exc
    _checked_one_path_each(planned)
    return planned, skipped


def fetch_inputs(
    inputs: list[str], staging: Path, credentials: S3Credentials | None
) -> tuple[list[tuple[Path, str]], list[str]]:
    """Resolve inputs (`plan_inputs`) to local files and the paths they get inside the
    sandbox, streaming ``s3://`` objects to ``staging`` on disk first.

    Args:
        inputs: local paths or ``s3://`` URIs.
        staging: a local folder for downloaded objects; made when needed.
        credentials: AWS credentials for ``s3://`` inputs; None for the standard environment.

    Returns:
        ``(local file, path inside the sandbox)`` pairs, and one line per skipped link naming
        it and why.

    Raises:
        FileTransferError: as `plan_inputs`, or an object could not be downloaded (names it).
        UnsafePathError: as `plan_inputs`.
    """
    planned, skipped = plan_inputs(inputs, credentials)
    pairs: list[tuple[Path, str]] = []
    buckets: dict[str, S3Bucket] = {}
    for item in planned:
        if item.local is not None:
            pairs.append((item.local, item.dest))
            continue
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
                f"{_one_line(exc)}",
                path=item.origin,
            ) from exc
        pairs.append((target, item.dest))
    return pairs, skipped
