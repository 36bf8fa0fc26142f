"""S3 storage through prefect-aws against moto's real S3 API over HTTP (no mock_aws)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket

from prefect_sandbox.flows import PipelineFailedError, amodeling_pipeline
from prefect_sandbox.testing.s3 import FaultProxy, MotoServer, access_denied
from tests.conftest import ROOT

pytestmark = pytest.mark.usefixtures("prefect_api")


def _credentials(endpoint: str) -> AwsCredentials:
    return AwsCredentials(
        aws_access_key_id="testing",
        aws_secret_access_key="testing-secret",
        region_name="us-east-1",
        aws_client_parameters=AwsClientParameters(endpoint_url=endpoint),
    )


@pytest.fixture
def bucket(moto: MotoServer) -> S3Bucket:
    name = f"bucket-{uuid.uuid4().hex[:12]}"
    moto.client().create_bucket(Bucket=name)
    return S3Bucket(
        bucket_name=name, bucket_folder="results", credentials=_credentials(moto.endpoint)
    )


def _fresh_download(moto: MotoServer, bucket: str, key: str) -> bytes:
    body = moto.client().get_object(Bucket=bucket, Key=key)["Body"]
    return bytes(body.read())


def _stored_notebook(moto: MotoServer, location: str) -> Any:
    import nbformat

    bucket_name, _, prefix = location[len("s3://") :].partition("/")
    notebook = nbformat.reads(
        _fresh_download(moto, bucket_name, f"{prefix}/executed.ipynb").decode(), as_version=4
    )
    nbformat.validate(notebook)
    return notebook


def _cli_env(moto: MotoServer) -> dict[str, str]:
    """This process's environment for the CLI: the session's Prefect API, moto's S3 in the
    standard AWS variables."""
    from prefect.settings import PREFECT_API_URL

    return {
        **os.environ,
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto.endpoint,
    }


def _use_moto_in_the_aws_environment(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard AWS variables of this process, for this test, pointed at moto."""
    for name, value in _cli_env(moto).items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)


def _keys(moto: MotoServer, bucket: str) -> set[str]:
    listing = moto.client().list_objects_v2(Bucket=bucket)
    return {item["Key"] for item in listing.get("Contents", [])}


async def test_inputs_from_s3_and_odd_artifacts_round_trip(
    moto: MotoServer, bucket: S3Bucket, tmp_path: Path
) -> None:
    client: Any = moto.client()
    client.put_object(Bucket=bucket.bucket_name, Key="data/raw/données 1.csv", Body=b"a,b\n1,2\n")
    client.put_object(Bucket=bucket.bucket_name, Key="data/raw/sub/empty.txt", Body=b"")
    client.put_object(Bucket=bucket.bucket_name, Key="data/single.json", Body=b'{"k": 1}')
    result = await amodeling_pipeline(
        stages={
            "read": [
                "import os\n"
                "print(sorted(os.path.join(d, f) for d, _, fs in os.walk('.') for f in fs))",
                "open('zero.bin', 'wb').close()\n"
                "open('résumé plot.png', 'wb').write(b'\\x89PNG' + bytes(50))\n"
                "os.makedirs('out dir', exist_ok=True)\n"
                "open('out dir/年 report.txt', 'w').write(open('raw/données 1.csv').read())",
            ]
        },
        inputs=[
            f"s3://{bucket.bucket_name}/data/raw/",
            f"s3://{bucket.bucket_name}/data/single.json",
        ],
        artifacts=["*.bin", "*.png", "out dir/*"],
        storage=bucket,
    )
    notebook = _stored_notebook(moto, result.output_dir)
    listing = notebook.cells[0].outputs[0]["text"]
    for name in ["./raw/données 1.csv", "./raw/sub/empty.txt", "./single.json"]:
        assert repr(name) in listing
    prefix = f"results/modeling-pipeline/{result.output_dir.rsplit('/', 1)[1]}"
    assert result.output_dir == f"s3://{bucket.bucket_name}/{prefix}"
    assert prefix.split("/")[-1].startswith(f"{result.flow_run_name}-")
    expected = {"zero.bin", "résumé plot.png", "out dir/年 report.txt", "executed.ipynb"}
    assert {a.path for a in result.artifacts} == expected
    keys = _keys(moto, bucket.bucket_name)
    assert {f"{prefix}/{p}" for p in [*expected, "summary.json"]} <= keys
    assert not [key for key in keys if ".." in key.split("/")]
    for artifact in result.artifacts:
        data = _fresh_download(moto, bucket.bucket_name, f"{prefix}/{artifact.path}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (
            artifact.size_bytes,
            artifact.sha256,
        )
    assert (
        _fresh_download(moto, bucket.bucket_name, f"{prefix}/out dir/年 report.txt")
        == b"a,b\n1,2\n"
    )
    summary = json.loads(_fresh_download(moto, bucket.bucket_name, f"{prefix}/summary.json"))
    assert summary["status"] == "completed" and len(summary["artifacts"]) == 4
    # Each object carries its Content-Type (a browser shows a presigned PNG, not a download).
    content_types = {
        path: client.head_object(Bucket=bucket.bucket_name, Key=f"{prefix}/{path}")["ContentType"]
        for path in ["résumé plot.png", "executed.ipynb", "summary.json", "out dir/年 report.txt"]
    }
    assert content_types == {
        "résumé plot.png": "image/png",
        "executed.ipynb": "application/x-ipynb+json",
        "summary.json": "application/json",
        "out dir/年 report.txt": "text/plain",
    }

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    async with get_client() as prefect:
        artifacts = await prefect.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["stored-artifacts"]))
        )
    mine = [a for a in artifacts if str(a.flow_run_id) == result.flow_run_id]
    assert len(mine) == 1 and mine[0].type == "table"
    rows = json.loads(str(mine[0].data))
    assert {row["sha256"] for row in rows} == {a.sha256 for a in result.artifacts}


async def test_failure_mid_upload_leaves_no_partial_object(
    moto: MotoServer, bucket: S3Bucket
) -> None:
    def deny_second_part_of_doomed(method: str, target: str) -> bytes | None:
        if method == "PUT" and "doomed.bin" in target and "partNumber=2" in target:
            return access_denied()
        return None

    proxy = FaultProxy(moto.port, deny_second_part_of_doomed)
    try:
        flaky = S3Bucket(
            bucket_name=bucket.bucket_name,
            bucket_folder="results",
            credentials=_credentials(proxy.endpoint),
        )
        with pytest.raises(PipelineFailedError) as info:
            await amodeling_pipeline(
                stages={
                    "write": [
                        "open('doomed.bin', 'wb').write(bytes(20 * 2**20))\n"
                        "open('fine.txt', 'w').write('kept')"
                    ]
                },
                artifacts=["doomed.bin", "fine.txt"],
                storage=flaky,
            )
    finally:
        proxy.stop()
    assert "'doomed.bin'" in str(info.value)
    prefix = info.value.output_dir.removeprefix(f"s3://{bucket.bucket_name}/")  # type: ignore[union-attr]
    keys = _keys(moto, bucket.bucket_name)
    assert f"{prefix}/doomed.bin" not in keys
    assert {f"{prefix}/fine.txt", f"{prefix}/executed.ipynb", f"{prefix}/summary.json"} <= keys
    uploads = moto.client().list_multipart_uploads(Bucket=bucket.bucket_name)
    assert uploads.get("Uploads", []) == []
    summary = json.loads(_fresh_download(moto, bucket.bucket_name, f"{prefix}/summary.json"))
    assert summary["status"] == "failed" and "doomed.bin" in summary["error"]


def test_main_job_stores_everything_in_s3_from_the_cli(
    moto: MotoServer, bucket: S3Bucket, tmp_path: Path
) -> None:
    example = ROOT / "examples" / "co2"
    env = _cli_env(moto)
    done = subprocess.run(
        [
            sys.executable, "-m", "prefect_sandbox.cli", "run", str(example / "forecast.ipynb"),
            "--input", str(example / "co2.csv"),
            "--artifact", "figures/*.png", "--artifact", "forecast.csv",
            "--artifact", "metrics.json",
            "--out", f"s3://{bucket.bucket_name}/co2-runs",
        ],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    keys = _keys(moto, bucket.bucket_name)
    (summary_key,) = [k for k in keys if k.endswith("/summary.json")]
    prefix = summary_key.removesuffix("/summary.json")
    assert prefix.startswith("co2-runs/run-notebook/")
    summary = json.loads(_fresh_download(moto, bucket.bucket_name, summary_key))
    stored = {a["path"]: a for a in summary["artifacts"]}
    assert {"forecast.csv", "metrics.json", "executed.ipynb"} <= set(stored)
    assert len([p for p in stored if p.startswith("figures/")]) >= 2
    for path, artifact in stored.items():
        data = _fresh_download(moto, bucket.bucket_name, f"{prefix}/{path}")
        assert (len(data), hashlib.sha256(data).hexdigest()) == (
            artifact["size_bytes"],
            artifact["sha256"],
        )
    metrics = json.loads(_fresh_download(moto, bucket.bucket_name, f"{prefix}/metrics.json"))
    assert metrics["mae_ppm"] < 2
    _stored_notebook(moto, f"s3://{bucket.bucket_name}/{prefix}")


def test_cli_takes_an_s3_object_or_prefix_as_its_only_input(
    moto: MotoServer, bucket: S3Bucket, tmp_path: Path
) -> None:
    import nbformat

    client: Any = moto.client()
    client.put_object(Bucket=bucket.bucket_name, Key="data/single.json", Body=b'{"k": 1}')
    client.put_object(Bucket=bucket.bucket_name, Key="data/raw/a.csv", Body=b"a\n1\n")
    client.put_object(Bucket=bucket.bucket_name, Key="data/raw/sub/b.txt", Body=b"bee")
    client.put_object(Bucket=bucket.bucket_name, Key="data/raw/sub/", Body=b"")
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(
            "import json, os\n"
            "found = {os.path.join(d, f): open(os.path.join(d, f)).read()\n"
            "         for d, _, fs in os.walk('.') for f in fs}\n"
            "json.dump(found, open('found.json', 'w'))"
        )
    ]
    nbformat.write(notebook, tmp_path / "list.ipynb")
    env = _cli_env(moto)
    cases = {
        "data/single.json": {"./single.json": '{"k": 1}'},
        "data/raw/": {"./raw/a.csv": "a\n1\n", "./raw/sub/b.txt": "bee"},
    }
    for key, expected in cases.items():
        out = tmp_path / f"out-{len(expected)}"
        done = subprocess.run(
            [
                sys.executable, "-m", "prefect_sandbox.cli", "run", "list.ipynb",
                "--input", f"s3://{bucket.bucket_name}/{key}", "--artifact", "found.json",
                "--out", str(out),
            ],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        (run_dir,) = out.iterdir()
        found = json.loads((run_dir / "found.json").read_text())
        found.pop("./found.json", None)
        assert found == expected, key


@pytest.mark.slow
async def test_one_gibibyte_artifact_round_trips_in_bounded_memory(
    moto: MotoServer, bucket: S3Bucket
) -> None:
    import threading

    import psutil

    me = psutil.Process()
    baseline = me.memory_info().rss
    peak = baseline
    sampling = True

    def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, me.memory_info().rss)
            threading.Event().wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = await amodeling_pipeline(
            stages={
                "make": [
                    "import hashlib, os\n"
                    "digest = hashlib.sha256()\n"
                    "with open('big.bin', 'wb') as f:\n"
                    "    for _ in range(1024):\n"
                    "        block = os.urandom(2**20); digest.update(block); f.write(block)\n"
                    "print(digest.hexdigest())"
                ]
            },
            artifacts=["big.bin"],
            storage=bucket,
            cell_timeout_s=300,
        )
    finally:
        sampling = False
        sampler.join()
    growth_mib = (peak - baseline) / 2**20
    print(f"peak RSS growth during the 1 GiB pipeline: {growth_mib:.1f} MiB")
    assert growth_mib < 64
    (big,) = [a for a in result.artifacts if a.path == "big.bin"]
    assert big.size_bytes == 2**30
    prefix = result.output_dir.removeprefix(f"s3://{bucket.bucket_name}/")
    body = moto.client().get_object(Bucket=bucket.bucket_name, Key=f"{prefix}/big.bin")["Body"]
    digest = hashlib.sha256()
    for chunk in iter(lambda: body.read(1 << 20), b""):
        digest.update(chunk)
    assert digest.hexdigest() == big.sha256
    notebook = _stored_notebook(moto, result.output_dir)
    assert notebook.cells[0].outputs[0]["text"].strip() == big.sha256


def test_s3_keys_are_normalised_or_refused() -> None:
    from prefect_sandbox.sandbox.errors import UnsafePathError
    from prefect_sandbox.tasks.storage import parse_s3_uri

    assert parse_s3_uri("s3://b//double//") == ("b", "double/")
    assert parse_s3_uri("s3://b/a b/ü/x?y#z") == ("b", "a b/ü/x?y#z")
    assert parse_s3_uri("s3://b") == ("b", "")
    assert parse_s3_uri("s3://b///") == ("b", "")
    for uri in ["s3://b/a b/ü/../../x?y#z", "s3://b/./x", "s3://b/x/.."]:
        with pytest.raises(UnsafePathError, match=r"has a '\.' or '\.\.' segment"):
            parse_s3_uri(uri)


async def test_storage_keys_have_no_empty_or_dot_segments(
    moto: MotoServer, bucket: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect_sandbox.sandbox.errors import UnsafePathError

    _use_moto_in_the_aws_environment(moto, monkeypatch)
    name = bucket.bucket_name
    result = await amodeling_pipeline(
        stages={"s": ["open('a.txt', 'w').write('a')"]},
        artifacts=["a.txt"],
        storage=f"s3://{name}//double//",
    )
    assert result.output_dir.startswith(f"s3://{name}/double/modeling-pipeline/")
    slashed = bucket.model_copy(update={"bucket_folder": "/lead//in/"})
    await amodeling_pipeline(stages={"s": ["print(1)"]}, storage=slashed)
    keys = _keys(moto, name)
    assert len(keys) == 5
    for key in keys:
        assert key.startswith(("double/modeling-pipeline/", "lead/in/modeling-pipeline/")), key
        assert "" not in key.split("/") and "." not in key.split("/"), key
    for storage in [
        f"s3://{name}/a b/ü/../../x?y#z",
        bucket.model_copy(update={"bucket_folder": "x/../y"}),
    ]:
        with pytest.raises(UnsafePathError, match=r"has a '\.' or '\.\.' segment"):
            await amodeling_pipeline(stages={"s": ["print(1)"]}, storage=storage)
    assert _keys(moto, name) == keys
    # '?' and '#' are a key's characters, as for the AWS CLI: no query or fragment is cut off,
    # and boto3's encoding of them on the wire reaches S3 as the very same key.
    verbatim = await amodeling_pipeline(
        stages={"s": ["open('a.txt', 'w').write('a')"]},
        artifacts=["a.txt"],
        storage=f"s3://{name}/a b/ü/x?y#z",
    )
    assert verbatim.output_dir.startswith(f"s3://{name}/a b/ü/x?y#z/modeling-pipeline/")
    stored = _keys(moto, name) - keys
    assert {key.rsplit("/", 1)[1] for key in stored} == {"a.txt", "executed.ipynb", "summary.json"}
    assert all(key.startswith("a b/ü/x?y#z/modeling-pipeline/") for key in stored), stored


def test_cli_refuses_an_out_whose_keys_would_climb(
    moto: MotoServer, bucket: S3Bucket, tmp_path: Path
) -> None:
    import nbformat

    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "empty.ipynb")
    out = f"s3://{bucket.bucket_name}/a b/ü/../../x?y#z"
    done = subprocess.run(
        [sys.executable, "-m", "prefect_sandbox.cli", "run", "empty.ipynb", "--out", out],
        env=_cli_env(moto), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"prefect-sandbox: --out {out!r} has a '.' or '..' segment, which S3 would keep "
        "verbatim in its keys"
    )
    assert _keys(moto, bucket.bucket_name) == set()


async def test_an_s3_prefix_whose_keys_clash_as_file_and_folder_is_refused_with_a_summary(
    moto: MotoServer, bucket: S3Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect_sandbox.sandbox.errors import FileTransferError
    from tests.conftest import kernel_processes

    _use_moto_in_the_aws_environment(moto, monkeypatch)

    client: Any = moto.client()
    client.put_object(Bucket=bucket.bucket_name, Key="clash/a", Body=b"a file")
    client.put_object(Bucket=bucket.bucket_name, Key="clash/a/b", Body=b"inside a folder")
    uri = f"s3://{bucket.bucket_name}/clash/"
    before = {p.pid for p in kernel_processes()}
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={"s": ["print('never runs')"]}, inputs=[uri], storage=str(tmp_path)
        )
    message = (
        f"inputs {uri!r} (its 'clash/a') and {uri!r} (its 'clash/a/b') clash in the sandbox: "
        "'clash/a' would be a file and the folder of 'clash/a/b'"
    )
    assert str(info.value) == message
    assert isinstance(info.value.__cause__, FileTransferError)
    summary = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
    assert (summary["status"], summary["error"], summary["sandbox_id"]) == ("failed", message, None)
    assert {p.pid for p in kernel_processes()} == before
    missing = f"s3://{bucket.bucket_name}/no-such-object.csv"
    with pytest.raises(PipelineFailedError) as info:
        await amodeling_pipeline(
            stages={"s": ["print('runs')"]}, inputs=[missing], storage=str(tmp_path)
        )
    cause = info.value.__cause__
    assert isinstance(cause, FileTransferError) and "\n" not in str(cause)
    assert str(cause).startswith(f"input {missing!r}: object 'no-such-object.csv' could not be")
    summary = json.loads((Path(info.value.output_dir or "") / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == str(cause)


async def test_a_flow_retry_empties_its_s3_prefix_first(moto: MotoServer, bucket: S3Bucket) -> None:
    neighbour = "results/modeling-pipeline/kept.txt"
    moto.client().put_object(Bucket=bucket.bucket_name, Key=neighbour, Body=b"not this run's")
    state = await amodeling_pipeline.with_options(retries=1)(
        stages={
            "s": [
                "import uuid; open(uuid.uuid4().hex + '.txt', 'w').write('once')\n"
                "raise RuntimeError('flaky')"
            ]
        },
        artifacts=["*.txt"],
        storage=bucket,
        return_state=True,
    )
    assert state.is_failed()
    keys = _keys(moto, bucket.bucket_name)
    (summary_key,) = [k for k in keys if k.endswith("/summary.json")]
    prefix = summary_key.removesuffix("summary.json")
    summary = json.loads(_fresh_download(moto, bucket.bucket_name, summary_key))
    assert summary["attempt"] == 2
    listed = {f"{prefix}{a['path']}" for a in summary["artifacts"]}
    assert len(listed) == 2  # one .txt and the notebook
    assert keys == {*listed, summary_key, neighbour}
