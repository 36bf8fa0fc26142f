"""Artifact upload of a 1 GiB file: our verified S3 store against raw boto3 ``upload_file``,
side by side in one process, to the same moto server (in its own process) on 127.0.0.1.

Ours hashes the file (whole and per part) while uploading it with boto3's managed transfer
asking S3 for SHA-256 checksums, then reads the checksum back with HeadObject. Raw is
``upload_file`` with boto3's defaults (CRC32 checksums) and the same transfer settings;
raw-sha256 adds ``ChecksumAlgorithm=SHA256``, like for like. Target: ours >= 0.9x raw.
moto's multipart handling is slow (a moto artefact), so both run multipart, like for like.

    python bench/bench_s3.py [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from boto3.s3.transfer import TransferConfig
from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

from prefect_sandbox.tasks.s3_storage import (
    MULTIPART_CHUNK_BYTES,
    MULTIPART_THRESHOLD_BYTES,
    S3Store,
)
from prefect_sandbox.testing.s3 import MotoServer

RESULTS = Path(__file__).parent / "results"
ROUNDS = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    size_mib = parser.parse_args().size_mib
    server = MotoServer()
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "big.bin"
        with source.open("wb") as writer:
            for _ in range(size_mib):
                writer.write(os.urandom(1 << 20))
        try:
            client = server.client()
            client.create_bucket(Bucket="bench")
            bucket = S3Bucket(
                bucket_name="bench",
                credentials=AwsCredentials(
                    aws_access_key_id="testing",
                    aws_secret_access_key="testing-secret",
                    region_name="us-east-1",
                    aws_client_parameters=AwsClientParameters(endpoint_url=server.endpoint),
                ),
            )
            store = S3Store(bucket, "bench-run")
            config = TransferConfig(
                multipart_threshold=MULTIPART_THRESHOLD_BYTES,
                multipart_chunksize=MULTIPART_CHUNK_BYTES,
                max_concurrency=4,
            )
            best = {"raw": float("inf"), "raw-sha256": float("inf"), "ours": float("inf")}
            sha256 = {"ChecksumAlgorithm": "SHA256"}
            for _ in range(ROUNDS):
                for name in best:
                    start = time.perf_counter()
                    if name == "ours":
                        store.store(source, "ours.bin")
                    else:
                        extra = sha256 if name == "raw-sha256" else None
                        client.upload_file(
                            str(source), "bench", name, ExtraArgs=extra, Config=config
                        )
                    best[name] = min(best[name], time.perf_counter() - start)
                    key = "bench-run/ours.bin" if name == "ours" else name
                    client.delete_object(Bucket="bench", Key=key)
        finally:
            server.stop()
    size_mb = size_mib * (1 << 20) / 1e6
    rows = {name: {"seconds": s, "mb_per_s": size_mb / s} for name, s in best.items()}
    ratio = rows["ours"]["mb_per_s"] / rows["raw"]["mb_per_s"]
    print(f"| {size_mib} MiB upload to moto | seconds (best of {ROUNDS}) | MB/s |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.2f} | {row['mb_per_s']:.1f} |")
    like_for_like = rows["ours"]["mb_per_s"] / rows["raw-sha256"]["mb_per_s"]
    print(f"throughput ratio ours/raw: {ratio:.2f} (target >= 0.9)")
    print(f"throughput ratio ours/raw-sha256: {like_for_like:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "s3.json").write_text(
        json.dumps({"rows": rows, "ratio": ratio, "ratio_sha256": like_for_like}, indent=2)
    )


if __name__ == "__main__":
    main()
