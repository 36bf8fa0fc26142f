"""``s3://bucket/key`` URIs, parsed once for the CLI, the run options and the storage tasks.

Pure functions, without Prefect or boto3, so the CLI can check a URI before importing them.
S3 keys keep every character as given (spaces, ``?``, ``#``, any script: S3 and the AWS CLI
take them verbatim, so this is no RFC 3986 URL with a query or fragment); only ``.`` and ``..``
segments are refused, as S3 would keep them in the key rather than resolve them.
Manual: docs/how-to/s3.md.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from prefect_sandbox.sandbox.errors import UnsafePathError

__all__ = ["S3_SCHEME", "S3Uri", "is_s3_uri", "normalised_s3_key", "parse_s3_uri"]

S3_SCHEME = "s3://"
_BUCKET = re.compile(r"[A-Za-z0-9._-]{1,255}")
"""The characters and length botocore accepts in a bucket name (its ``validate_bucket_name``
handler, which allows the legacy names of us-east-1 too)."""


class S3Uri(NamedTuple):
    """A parsed ``s3://`` URI.

    Attributes:
        bucket: the bucket's name.
        key: the key or key prefix (a trailing ``/`` names a prefix), normalised by
            `normalised_s3_key`; ``""`` for the bucket's root.
    """

    bucket: str
    key: str


def is_s3_uri(text: str) -> bool:
    """Whether ``text`` is meant as an ``s3://`` URI (rather than a local path)."""
    return text.startswith(S3_SCHEME)


def normalised_s3_key(key: str, where: str) -> str:
    """``key`` without empty segments (``a//b``, a leading ``/``); a trailing ``/``, which
    names a prefix, is kept. Other characters (spaces, ``?``, ``#``, any script) are kept as
    they are: S3 keys hold them.

    Args:
        key: an S3 key or key prefix.
        where: what it came from (a URI, a block's field), named in the error.

    Raises:
        UnsafePathError: a ``.`` or ``..`` segment, which S3 would keep in the key verbatim.
    """
    parts = key.split("/")
    if "." in parts or ".." in parts:
        raise UnsafePathError(
            f"{where} has a '.' or '..' segment, which S3 would keep verbatim in its keys",
            path=key,
        )
    kept = [part for part in parts if part]
    return "/".join(kept) + ("/" if kept and key.endswith("/") else "")


def parse_s3_uri(uri: str) -> S3Uri:
    """Split ``s3://bucket/some/key`` into ``S3Uri("bucket", "some/key")``, the key normalised
    by `normalised_s3_key` (``s3://b//double//`` gives ``("b", "double/")``).

    Raises:
        ValueError: not an ``s3://`` URI, no bucket named, or a bucket name botocore would
            refuse; the message starts with the URI's repr.
        UnsafePathError: the key has a ``.`` or ``..`` segment (also a ValueError).
    """
    if not is_s3_uri(uri):
        raise ValueError(f"{uri!r} is not an s3://bucket/key URI")
    bucket, _, key = uri.removeprefix(S3_SCHEME).partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} names no bucket")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"{uri!r} names no valid bucket: {bucket!r} has characters other than letters, "
            "digits, '.', '-' and '_', or is over 255 long"
        )
    return S3Uri(bucket, normalised_s3_key(key, repr(uri)))
