"""The ``prefect-sandbox`` command.

``prefect-sandbox run NOTEBOOK [--backend local|daytona] [--backend-block NAME]
[--input PATH]... [--artifact GLOB]... [--out DIR] [-p NAME=VALUE]... [--cell-timeout SECONDS]``
runs the ``run-notebook`` flow and writes ``DIR/<flow-run-name>/``: ``executed.ipynb``, the
artifacts and ``summary.json``. ``--backend-block`` names a saved backend block of the chosen
kind; without one, Daytona is reached through the SDK's ``DAYTONA_API_KEY``, ``DAYTONA_API_URL``
and ``DAYTONA_TARGET`` variables. Exit status 0 on success; 1 on a failed pipeline, with a
one-line reason as the last line on stderr; 2 on bad usage, found before any flow starts.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefect_sandbox.blocks.base import SandboxBackend

__all__ = ["main"]

# Prefect's ephemeral API server takes 6-11 s to start on a 2-core machine; its default
# start-up timeout (20 s) is too tight when the machine is busy.
_EPHEMERAL_STARTUP_TIMEOUT_S = "90"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefect-sandbox", description="Run notebooks in a sandbox, one per flow run."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a notebook stage by stage and store its outputs")
    run.add_argument("notebook", help="the .ipynb to run")
    run.add_argument(
        "--backend", choices=["local", "daytona"], default="local", help="sandbox backend"
    )
    run.add_argument(
        "--backend-block", metavar="NAME", help="a saved backend block of that kind to use"
    )
    run.add_argument(
        "--input", action="append", default=[], metavar="PATH", help="file or folder to upload"
    )
    run.add_argument(
        "--artifact", action="append", default=[], metavar="GLOB", help="files to collect"
    )
    run.add_argument("--out", default="prefect-sandbox-output", metavar="DIR", help="output folder")
    run.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="notebook parameter, typed as papermill's -p does",
    )
    run.add_argument(
        "--cell-timeout", type=float, default=None, metavar="SECONDS", help="per-cell timeout"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program name; None for ``sys.argv[1:]``.

    Returns:
        The exit status: 0 success, 1 failed pipeline, 2 bad usage.
    """
    args = _parser().parse_args(argv)
    # Imported here: importing Prefect costs seconds, and --help should not pay it.
    from prefect_sandbox.sandbox.errors import NotebookError
    from prefect_sandbox.sandbox.notebook import parse_parameter

    try:
        parameters = dict(parse_parameter(item) for item in args.parameter)
    except NotebookError as exc:
        return _usage_error(str(exc))
    problem = _usage_problem(args)
    if problem:
        return _usage_error(problem)
    os.environ.setdefault(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", _EPHEMERAL_STARTUP_TIMEOUT_S
    )
    from prefect_sandbox.flows import run_notebook
    from prefect_sandbox.sandbox.errors import PipelineFailedError, SandboxError

    try:
        backend = _backend(args.backend, args.backend_block)
    except ValueError as exc:
        return _usage_error(str(exc))
    try:
        result = run_notebook(
            notebook=args.notebook,
            inputs=args.input,
            artifacts=args.artifact,
            parameters=parameters,
            backend=backend,
            output_dir=args.out,
            cell_timeout_s=args.cell_timeout,
        )
    except PipelineFailedError as exc:
        _say_last(f"pipeline failed: {exc} (partial results in {exc.output_dir})")
        return 1
    except SandboxError as exc:
        _say_last(str(exc))
        return 1
    print(f"Stored {len(result.artifacts)} file(s) and summary.json in {result.output_dir}")
    for stage in result.stages:
        cells = f"{stage.cell_count:>3} cell(s)"
        print(f"  {stage.name:<12} {stage.status:<8} {cells} {stage.duration_s:8.2f} s")
    return 0


def _backend(kind: str, block_name: str | None) -> SandboxBackend:
    """The backend block to run on: the saved one named, or the kind's defaults.

    Raises:
        ValueError: no block of that kind has that name.
    """
    from prefect_sandbox.blocks import DaytonaBackend, LocalKernelBackend

    block_class: type[SandboxBackend] = DaytonaBackend if kind == "daytona" else LocalKernelBackend
    if block_name is None:
        return block_class()
    backend: SandboxBackend = block_class.load(block_name)  # type: ignore[assignment]
    return backend


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, found before any flow starts; None if nothing."""
    if args.cell_timeout is not None and args.cell_timeout <= 0:
        return "--cell-timeout must be positive"
    if args.backend == "daytona":
        try:
            import daytona  # noqa: F401
        except ImportError:
            return "--backend daytona needs the daytona SDK: pip install 'prefect-sandbox[daytona]'"
    if not os.path.isfile(args.notebook):
        return f"notebook {args.notebook!r} is not a file"
    for item in args.input:
        if not os.path.exists(item):
            return f"--input {item!r} does not exist"
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        return f"--out {args.out!r} is not a folder"
    return None


def _usage_error(message: str) -> int:
    print(f"prefect-sandbox: {message}", file=sys.stderr)
    return 2


def _say_last(message: str) -> None:
    """Print ``message`` to stderr at exit, after Prefect's own shutdown lines.

    Prefect stops its ephemeral API server in an ``atexit`` handler registered when the flow
    started; handlers run last-in first-out, so one registered now runs after it.
    """
    atexit.register(print, f"prefect-sandbox: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
