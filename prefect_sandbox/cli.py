"""The ``prefect-sandbox`` command.

``prefect-sandbox run NOTEBOOK [--backend local] [--input PATH]... [--artifact GLOB]...
[--out DIR] [-p NAME=VALUE]... [--cell-timeout SECONDS]`` runs the ``run-notebook`` flow and
writes ``DIR/<flow-run-name>/``: ``executed.ipynb``, the artifacts and ``summary.json``. Exit
status 0 on success, 1 on a failed pipeline (with a one-line reason on stderr), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

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
    run.add_argument("--backend", choices=["local"], default="local", help="sandbox backend")
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
    if args.cell_timeout is not None and args.cell_timeout <= 0:
        print("prefect-sandbox: --cell-timeout must be positive", file=sys.stderr)
        return 2
    os.environ.setdefault(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", _EPHEMERAL_STARTUP_TIMEOUT_S
    )
    # Imported here: importing Prefect costs seconds, and --help should not pay it.
    from prefect_sandbox.flows import run_notebook
    from prefect_sandbox.sandbox.errors import PipelineFailedError, SandboxError
    from prefect_sandbox.sandbox.notebook import parse_parameter

    try:
        parameters = dict(parse_parameter(item) for item in args.parameter)
        result = run_notebook(
            notebook=args.notebook,
            inputs=args.input,
            artifacts=args.artifact,
            parameters=parameters,
            output_dir=args.out,
            cell_timeout_s=args.cell_timeout,
        )
    except PipelineFailedError as exc:
        print(
            f"prefect-sandbox: pipeline failed: {exc} (partial results in {exc.output_dir})",
            file=sys.stderr,
        )
        return 1
    except SandboxError as exc:
        print(f"prefect-sandbox: {exc}", file=sys.stderr)
        return 1
    print(f"Stored {len(result.artifacts)} file(s) and summary.json in {result.output_dir}")
    for stage in result.stages:
        cells = f"{stage.cell_count:>3} cell(s)"
        print(f"  {stage.name:<12} {stage.status:<8} {cells} {stage.duration_s:8.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
