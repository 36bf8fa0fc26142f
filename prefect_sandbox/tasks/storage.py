"""Where a flow's inputs come from and its artifacts go: a local folder, or S3.

A run's store is an `ArtifactStore`: a `LocalFolderStore` here, or for S3 the `S3Store` of
`prefect_sandbox.tasks.s3_storage`, which this module imports only when a run's storage or an
input is on S3 (prefect-aws and boto3 cost about 0.5 s to import). Every store verifies what it
stored: size and SHA-256. Manual: docs/how-to/s3.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from prefect import get_run_logger, task
from prefect.artifacts import acreate_table_artifact
from prefect.cache_policies import NO_CACHE

from prefect_sandbox.markdown_text import table_cell
from prefect_sandbox.results import StoredArtifact
from prefect_sandbox.s3uri import is_s3_uri, normalised_s3_key, parse_s3_uri
from prefect_sandbox.sandbox.errors import FileTransferError, SandboxError
from prefect_sandbox.sandbox.paths import (
    resolve_inside,
    run_folder_name,
)

if TYPE_CHECKING:
    from prefect_aws import S3Bucket

    from prefect_sandbox.tasks.s3_storage import S3Credentials

__all__ = [
    "READ_CHUNK_BYTES",
    "S3_BLOCK_PREFIX",
    "ArtifactStore",
    "LocalFolderStore",
    "PlannedInput",
    "fetch_inputs",
    "input_credentials",
    "normalised_s3_key",
    "one_line",
    "parse_s3_uri",
    "plan_inputs",
    "resolve_storage",
    "store_artifacts",
    "stored_table_rows",
]

READ_CHUNK_BYTES = 1 << 20
"""Bytes read at a time from a file being hashed or copied."""
S3_BLOCK_PREFIX = "s3-bucket/"
TABLE_ROWS_SHOWN = 500
"""Stored files listed in the run's table artifact at most (10,000 rows weigh about 2 MB)."""


class ArtifactStore(ABC):
    """A destination for one flow run's files."""

    @property
    def credentials(self) -> S3Credentials | None:
        """The AWS credentials the run's ``s3://`` inputs are read with: an S3 store's own;
        None (the standard AWS environment) for a folder."""
        return None

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
                while chunk := reader.read(READ_CHUNK_BYTES):
                    digest.update(chunk)
                    writer.write(chunk)
        except OSError as exc:
            raise FileTransferError(
                f"artifact {relative!r} could not be stored in {self.output_dir}: {one_line(exc)}",
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


def input_credentials(store: ArtifactStore | None) -> S3Credentials | None:
    """The credentials ``s3://`` inputs are read with: an S3 store's; else None (the standard
    AWS environment)."""
    return store.credentials if store is not None else None


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
    if isinstance(storage, str) and not (storage.startswith(S3_BLOCK_PREFIX) or is_s3_uri(storage)):
        return LocalFolderStore(Path(storage) / run_folder)
    from prefect_sandbox.tasks.s3_storage import s3_store

    return s3_store(storage, flow_name, run_folder)


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
        except (SandboxError, OSError) as exc:
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


def one_line(exc: BaseException) -> str:
    """An error's message on one line (its type's name where it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


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
                from prefect_sandbox.tasks.s3_storage import s3_input_plan

                planned.extend(s3_input_plan(item, credentials))
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
        except OSError as exc:
            raise FileTransferError(
                f"input {item!r} could not be read: {one_line(exc)}", path=item
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
    objects = [item for item in planned if item.local is None]
    downloaded: Iterator[tuple[Path, str]] = iter(())
    if objects:
        from prefect_sandbox.tasks.s3_storage import download_s3_inputs

        downloaded = iter(download_s3_inputs(objects, staging, credentials))
    pairs = [
        (item.local, item.dest) if item.local is not None else next(downloaded) for item in planned
    ]
    return pairs, skipped
