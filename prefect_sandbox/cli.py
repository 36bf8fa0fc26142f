"""The ``prefect-sandbox`` command: ``run`` (the ``run-notebook`` flow), ``sweep``
(``sweep-notebook``) and ``deploy`` (a ``run-notebook`` deployment of one notebook).

Arguments are checked by `prefect_sandbox.options`' rules before Prefect is imported, so a bad
flag, parameter, grid file or ``PREFECT_SANDBOX_*`` setting exits 2 before any flow starts, and
``--help`` and ``--version`` import no Prefect. Exit status: 0 completed; 1 failed (the last
stderr line says why); 2 bad usage; 3 cancelled through the API or UI; 130 and 143 on SIGINT
and SIGTERM, which stop the run, kill its sandbox and store what it made. ``--json`` leaves
stdout to one JSON object. Manual: docs/reference/cli.md, whose flag list is this parser's
``--help``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from prefect_sandbox.sandbox.outputs import strip_ansi

if TYPE_CHECKING:
    from pydantic import ValidationError

    from prefect_sandbox.blocks import BackendBlock
    from prefect_sandbox.flows.stopping import SignalStop
    from prefect_sandbox.local_server import ServerState
    from prefect_sandbox.options import RunOptions
    from prefect_sandbox.results import PipelineResult, SweepResult

__all__ = ["EXIT_CANCELLED", "main"]

EXIT_CANCELLED = 3
"""The exit status of a run cancelled through the Prefect API or UI."""


_EXAMPLES = """examples:
  prefect-sandbox run analysis.ipynb -p alpha=0.5 --out results
  prefect-sandbox run analysis.ipynb -f params.yaml -p alpha=0.6 --artifact 'figures/*.png'
  prefect-sandbox run analysis.ipynb --help-notebook
  prefect-sandbox run analysis.ipynb --backend e2b --out s3://bucket/runs
  prefect-sandbox sweep analysis.ipynb --grid grid.yaml --max-live-sandboxes 4
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefect-sandbox",
        description="Run notebooks in a sandbox, one per flow run.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = _add_run_command(commands, "run", "run a notebook stage by stage and store its outputs")
    run.add_argument(
        "-f",
        "--parameters-file",
        metavar="FILE",
        default=None,
        help="notebook parameters from a .json or .yaml mapping; -p wins over it",
    )
    run.add_argument(
        "--help-notebook",
        action="store_true",
        help="show the notebook's parameters (its cell tagged 'parameters') and run nothing",
    )
    run.add_argument(
        "-p",
        "--parameter",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="notebook parameter, typed as papermill's -p does; papermill's '-p NAME VALUE' "
        "works too",
    )
    sweep = _add_run_command(
        commands, "sweep", "run a notebook once per parameter set, each in its own sandbox"
    )
    sweep.add_argument(
        "--grid",
        required=True,
        metavar="FILE",
        help="a .json or .yaml file: a list of parameter sets, or a mapping of name to a list "
        "of values (their cartesian product)",
    )
    sweep.add_argument(
        "--max-live-sandboxes",
        type=int,
        default=None,
        metavar="N",
        help="the sweep's sandboxes alive at once at most (default: the backend's cap)",
    )
    sweep.add_argument(
        "--deployment",
        metavar="NAME",
        default=None,
        help="run the branches as runs of this run-notebook deployment, on its workers "
        "(default: subflows in this process)",
    )
    sweep.add_argument(
        "--task-runner",
        metavar="dask[:ADDRESS]",
        default=None,
        help="run the branches as tasks on Dask: 'dask' starts a local cluster of worker "
        "processes, 'dask:tcp://HOST:PORT' uses a running scheduler (default: subflows in this "
        "process)",
    )
    sweep.add_argument(
        "--metrics-artifact",
        metavar="PATH",
        default="metrics.json",
        help="the JSON file each branch's key metrics are read from, collected as an artifact "
        "(default: metrics.json; '' for none)",
    )
    _add_deploy_command(commands)
    _add_server_command(commands)
    return parser


def _add_server_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``server status|start|stop``: the local Prefect server kept for the user."""
    server = commands.add_parser(
        "server",
        help="the local Prefect server kept for runs with no PREFECT_API_URL: status, start, stop",
    )
    server.add_argument(
        "action",
        choices=["status", "start", "stop"],
        help="status: whether it runs, where, since when, its memory; start: start it now (or "
        "find it) and wait until it answers; stop: stop it",
    )


def _add_deploy_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``deploy``: a ``run-notebook`` deployment for one notebook, its parameters typed."""
    deploy = commands.add_parser(
        "deploy",
        help="deploy run-notebook for one notebook, its parameters typed fields of the Run form",
        epilog="example:\n  prefect-sandbox deploy analysis.ipynb --pool sandbox-process "
        "--input data.csv --out s3://bucket/runs",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deploy.add_argument("notebook", help="the .ipynb to deploy")
    deploy.add_argument(
        "--pool", required=True, metavar="POOL", help="the work pool whose workers run it"
    )
    deploy.add_argument(
        "--name",
        default=None,
        metavar="NAME",
        help="the deployment's name, run-notebook/NAME (default: the notebook's file name)",
    )
    deploy.add_argument(
        "--input", action="append", default=[], metavar="PATH", help="file or folder to upload"
    )
    deploy.add_argument(
        "--artifact", action="append", default=[], metavar="GLOB", help="files to collect"
    )
    deploy.add_argument(
        "--out", default=None, metavar="DIR", help="output folder, or s3://bucket/prefix"
    )
    deploy.add_argument(
        "--cell-timeout", type=float, default=None, metavar="SECONDS", help="per-cell timeout"
    )


def _add_output_options(command: argparse.ArgumentParser) -> None:
    """Add what a run prints to a subcommand: ``-q``, ``-v`` and ``--json``."""
    loudness = command.add_mutually_exclusive_group()
    loudness.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no log lines on the console (warnings and errors still show); stdout holds only "
        "where the results are",
    )
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="with --json, still show progress and log lines on stderr",
    )
    command.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout, and nothing else there: the run's summary.json "
        "(status, output_dir, stages, artifacts with size_bytes and sha256, parameters, "
        "metrics) and exit_status; stderr is as quiet as with -q, unless -v",
    )


def _add_run_command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str
) -> argparse.ArgumentParser:
    """Add the subcommand ``name`` (``run`` or ``sweep``) with the examples as its epilog and
    the options both share: notebook, backend, files, storage, timeout.

    Returns:
        The subcommand's parser, for the options of its own.
    """
    command = commands.add_parser(
        name,
        help=help_text,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("notebook", help="the .ipynb to run")
    _add_output_options(command)
    command.add_argument(
        "--backend",
        choices=["local", "e2b", "daytona", "docker"],
        default=None,
        help="sandbox backend (default: the block $PREFECT_SANDBOX_BACKEND_BLOCK, else local)",
    )
    command.add_argument(
        "--backend-block",
        metavar="NAME",
        help="a saved backend block of that kind (local when no --backend) to use",
    )
    command.add_argument(
        "--docker-image", metavar="IMAGE", help="the image of --backend docker (without a block)"
    )
    command.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="PATH",
        help="file or folder to upload, or s3://bucket/key or s3://bucket/prefix/",
    )
    command.add_argument(
        "--artifact", action="append", default=[], metavar="GLOB", help="files to collect"
    )
    command.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output folder, or s3://bucket/prefix (default: $PREFECT_SANDBOX_STORAGE, else "
        "prefect-sandbox-output)",
    )
    command.add_argument(
        "--aws-credentials",
        metavar="NAME",
        default=None,
        help="saved AwsCredentials block for s3:// (default: the standard AWS environment)",
    )
    command.add_argument(
        "--stage-heading-level",
        type=int,
        choices=range(1, 7),
        default=1,
        metavar="N",
        help="without stage tags, markdown headings of level 1 to N open stages (default 1: "
        "'# ' headings only; 2: '## ' ones too)",
    )
    command.add_argument(
        "--cell-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-cell timeout; -1 for none (default: the backend block's, "
        "$PREFECT_SANDBOX_CELL_TIMEOUT_S)",
    )
    return command


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    SIGINT and SIGTERM end ``run`` and ``sweep`` at any moment: before the flow run begins at
    once (``128 + N``), during it as `SignalStop` says; with ``argv`` None (the command itself)
    also after it, at once. As the command, ``run`` and ``sweep`` end the process after its exit
    handlers, without the interpreter's teardown (`_exit_without_teardown`).

    Args:
        argv: the arguments after the program name; None for ``sys.argv[1:]``, as the command.

    Returns:
        The exit status: 0 success, 1 failed pipeline (or sweep branch), 2 bad usage, 130 / 143
        when SIGINT / SIGTERM stopped the run (it ends Cancelled, its sandboxes killed, what
        it made stored), `EXIT_CANCELLED` when it was cancelled through the API or UI (the
        same way).
    """
    args = _parser().parse_args(_joined_parameters(sys.argv[1:] if argv is None else argv))
    if args.command == "server":
        return _server_command(args.action)
    if getattr(args, "help_notebook", False):
        return _help_notebook(args.notebook, args.stage_heading_level)
    if args.command == "deploy":
        return _deploy(args)
    if args.json and not args.verbose:
        args.quiet = True  # stderr as -q has it; stdout is the JSON object's alone anyway
    if argv is None:
        # Registered before Prefect is imported, so it runs after Prefect's exit handlers.
        atexit.register(_exit_without_teardown)
    _signals_received.clear()
    previous = {signum: signal.signal(signum, _interrupt) for signum in _STOP_SIGNALS}
    try:
        status = _run_command(args)
    except _Interrupted as exc:
        status = _interrupted_before_the_flow_run(exc.signum)
    except Exception:
        # A library our handler's raise went through may hand it on as an error of its own
        # (pydantic wraps one raised in a serializer: Prefect's settings, as it is imported).
        if not _signals_received:
            raise
        status = _interrupted_before_the_flow_run(_signals_received[0])
    finally:
        # As the command (argv None), Prefect's exit may follow (its log and event workers
        # draining): a signal then ends the process at once, with the status a shell expects.
        # Called as a function, the caller's handlers come back.
        for signum in _STOP_SIGNALS:
            signal.signal(signum, _exit_at_once if argv is None else previous[signum])
    if argv is None:
        _exit_status.append(status)
    return status


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Interrupted(BaseException):
    """SIGINT or SIGTERM before the flow run began (a BaseException, as KeyboardInterrupt:
    no ``except Exception`` on the way takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_signals_received: list[int] = []
"""The signals `_interrupt` took, first first: what ended the command even where the exception
it raised was caught or changed on its way out."""


def _interrupt(signum: int, frame: object) -> None:
    _signals_received.append(signum)
    raise _Interrupted(signum)


def _interrupted_before_the_flow_run(signum: int) -> int:
    """End the kernel started ahead, say why the command ends; its exit status."""
    _end_kernel_started_ahead()
    name = signal.Signals(signum).name
    print(f"prefect-sandbox: interrupted by {name} before the flow run began", file=sys.stderr)
    return 128 + signum


_exit_status: list[int] = []
"""The status `main` returned, as the command: what `_exit_without_teardown` exits with."""


def _exit_without_teardown() -> None:
    """The command's last exit handler: end the process without the interpreter's teardown of
    its modules and objects, about 0.5 s of CPU after a run with Prefect imported (measured
    with strace: no system call between the last exit handler and ``exit_group``).

    Prefect's log and event workers have drained by now (``threading``'s exit hooks run before
    ``atexit``'s), and so has every handler registered after this one; of those registered
    before it, only logging's shutdown is known (and called here). Does nothing where `main`
    did not return (an error's traceback, ``SystemExit`` from argparse): Python ends those."""
    if not _exit_status:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or file: nothing to add
            stream.flush()
    os._exit(_exit_status[-1])


def _exit_at_once(signum: int, frame: object) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


def _run_command(args: argparse.Namespace) -> int:
    """``run`` or ``sweep``: check the arguments, run the flow, print how it ended.

    Returns:
        The exit status (see `main`).
    """
    # Imported here: importing Prefect costs seconds, and --help should not pay it.
    from pydantic import ValidationError

    from prefect_sandbox.options import CLI_FLAGS, one_line
    from prefect_sandbox.sandbox.errors import NotebookError
    from prefect_sandbox.sandbox.notebook import parse_parameter, read_notebook, split_stages
    from prefect_sandbox.settings import PrefectSandboxSettings

    try:
        settings = PrefectSandboxSettings()
    except ValidationError as exc:
        return _usage_error(_settings_problem(exc))
    if args.out is None:
        args.out = settings.storage
    try:
        _options(args)
    except ValidationError as exc:
        return _usage_error(one_line(exc, CLI_FLAGS))
    try:
        flags = dict(parse_parameter(item) for item in getattr(args, "parameter", []))
        if not _on_workers(args):
            split_stages(read_notebook(Path(args.notebook)), args.stage_heading_level)
    except NotebookError as exc:
        return _usage_error(str(exc))
    # Before Prefect is imported (seconds): a local server that must start overlaps it.
    args.local_server = _early_local_server(settings.local_server, args.quiet)
    if args.command == "run" and not args.backend_block:
        _start_local_kernel_ahead(args.backend, settings.backend_block)
    from prefect_sandbox.flows.errors import GridError

    parameters: dict[str, Any] = {}
    grid: list[dict[str, Any]] = []
    try:
        if args.command == "run" and args.parameters_file is not None:
            from prefect_sandbox.flows.sweep import read_parameters_file

            parameters = read_parameters_file(args.parameters_file)
        elif args.command == "sweep":
            from prefect_sandbox.flows.sweep import read_grid

            grid = read_grid(args.grid)
    except (NotebookError, GridError) as exc:
        return _usage_error(str(exc))
    parameters.update(flags)  # -p wins over -f
    # Registered before the flow starts Prefect's temporary API server, whose own exit handler
    # logs its shutdown: handlers run last-in first-out, so our reason still comes last.
    atexit.register(_print_reason)
    if args.quiet:
        _quiet_prefect_console(logging.WARNING)
    from prefect_sandbox.flows.stopping import SignalStop

    if _signals_received:  # raised, and swallowed on the way
        raise _Interrupted(_signals_received[0])
    stop = SignalStop(on_signal=_quiet_prefect_console)
    with _stdout_to_stderr(args.json), stop as stopper, _console_filter(args):
        outcome = _run_flow(args, parameters, grid, stopper)
    if outcome.usage_problem is not None:
        return _usage_error(outcome.usage_problem)
    if outcome.where is not None and not args.quiet:
        _say_last(outcome.where)
    if outcome.error is not None:
        _say_last(outcome.error)
    _print_outcome(args, outcome)
    return outcome.exit_status


def _verbose(args: argparse.Namespace) -> bool:
    """``-v``, or Prefect's log level at DEBUG: show Prefect's engine tracebacks too."""
    return bool(args.verbose) or logging.getLogger("prefect").getEffectiveLevel() <= logging.DEBUG


def _console_filter(args: argparse.Namespace) -> contextlib.AbstractContextManager[None]:
    """What Prefect's console leaves out during the run: with ``-q`` every error record of the
    run (`quiet_run_errors`); else, unless verbose (`_verbose`), the engine's tracebacks and
    everything after the run began to fail (`engine_tracebacks_hidden`)."""
    from prefect_sandbox.progress import engine_tracebacks_hidden, quiet_run_errors

    if args.quiet:
        return quiet_run_errors()
    if _verbose(args):
        return contextlib.nullcontext()
    return engine_tracebacks_hidden()


def _joined_parameters(argv: Sequence[str]) -> list[str]:
    """The arguments with papermill's ``-p NAME VALUE`` written as ``-p NAME=VALUE``: a ``-p``
    (``--parameter``) whose next argument has no ``=`` and is followed by another takes that
    one as its value (``-p alpha -0.5`` too). Arguments after ``--`` are left alone."""
    joined: list[str] = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if item == "--":
            return joined + list(argv[index:])
        joined.append(item)
        index += 1
        if item in ("-p", "--parameter") and index + 1 < len(argv) and "=" not in argv[index]:
            joined.append(f"{argv[index]}={argv[index + 1]}")
            index += 2
    return joined


@dataclass
class _Outcome:
    """How a run ended, for the CLI's output.

    Attributes:
        exit_status: the command's exit status.
        result: what the flow returned, or (a failed pipeline) what its ``summary.json`` says.
        error: the one line that stderr ends with; None on success.
        output_dir: where the results are, when known.
        usage_problem: a usage error found as the flow started (exit status 2, no output).
        where: for a failed cell, the line before ``error``: the cell and its line of code.
    """

    exit_status: int
    result: PipelineResult | SweepResult | None = None
    error: str | None = None
    output_dir: str | None = None
    usage_problem: str | None = None
    where: str | None = None


def _call_flow(
    args: argparse.Namespace,
    parameters: dict[str, Any],
    grid: list[dict[str, Any]],
    stopper: SignalStop,
    backend: BackendBlock | None,
    storage: Any,
) -> PipelineResult | SweepResult:
    """Call the command's flow (a run with its progress shown) under ``stopper``; it raises
    what the flow raises."""
    if args.command == "run":
        from prefect_sandbox.progress import progress_mode, shown_progress

        if isinstance(storage, str):
            # run-notebook with text storage: a run to a folder imports no prefect-aws.
            from prefect_sandbox.flows.notebook_run import (
                arun_notebook_text_storage as run_notebook_flow,
            )
        else:
            from prefect_sandbox.flows import arun_notebook as run_notebook_flow

        mode = progress_mode(args.quiet, sys.stderr)
        plan = _cell_plan(args.notebook, parameters, args.stage_heading_level)
        with shown_progress(mode, plan, sys.stderr):
            return stopper.run(
                lambda: run_notebook_flow(
                    notebook=args.notebook,
                    inputs=args.input,
                    artifacts=args.artifact,
                    parameters=parameters,
                    storage=storage,
                    cell_timeout_s=args.cell_timeout,
                    backend=backend,
                    stage_heading_level=args.stage_heading_level,
                )
            )

    from prefect_sandbox.flows import asweep_notebook

    return stopper.run(
        lambda: asweep_notebook(
            notebook=args.notebook,
            grid=grid,
            inputs=args.input,
            artifacts=args.artifact,
            storage=storage,
            cell_timeout_s=args.cell_timeout,
            backend=backend,
            max_live_sandboxes=args.max_live_sandboxes,
            deployment=args.deployment,
            metrics_artifact=args.metrics_artifact or None,
            task_runner=args.task_runner,
            stage_heading_level=args.stage_heading_level,
        )
    )


def _run_flow(
    args: argparse.Namespace,
    parameters: dict[str, Any],
    grid: list[dict[str, Any]],
    stopper: SignalStop,
) -> _Outcome:
    """Run the command's flow with the checked arguments, and say how it ended."""
    from prefect.exceptions import CancelledRun

    # Only the flow it runs: `prefect_sandbox.flows` imports each on first use.
    from prefect_sandbox.flows import PipelineFailedError, SweepFailedError
    from prefect_sandbox.sandbox.errors import SandboxError

    # The flows' import gave the temporary server its start-up allowance.
    problem = _api_problem(args)
    if problem:
        return _Outcome(1, error=problem)
    try:
        # A sweep on workers with no backend named uses the deployment's.
        backend = None if _on_workers(args) and not args.backend_block else _backend(args)
    except ValueError as exc:  # Prefect's answer to a block name it does not know
        where = f"--backend-block {args.backend_block!r}: " if args.backend_block else ""
        return _Outcome(2, usage_problem=f"{where}{exc}")
    # Workers get a folder or s3:// URI as text, with their own AWS environment.
    storage = args.out if _on_workers(args) else _storage(args.out, args.aws_credentials)
    try:
        result = _call_flow(args, parameters, grid, stopper, backend, storage)
    except (CancelledRun, asyncio.CancelledError) as exc:
        if stopper.signum is None and isinstance(exc, CancelledRun):
            return _Outcome(EXIT_CANCELLED, error=f"cancelled through the Prefect API or UI: {exc}")
        if stopper.signum is None:
            raise
        what = str(exc) or "stopped before the flow run began"
        name = signal.Signals(stopper.signum).name
        return _Outcome(128 + stopper.signum, error=f"interrupted by {name}: {what}")
    except PipelineFailedError as exc:
        return _Outcome(
            1,
            result=exc.result,
            error=f"pipeline failed: {exc} (partial results in {exc.output_dir})",
            output_dir=exc.output_dir,
            where=_failing_code(args.notebook, exc.result),
        )
    except SweepFailedError as exc:
        return _Outcome(1, error=f"sweep failed: {exc}", output_dir=exc.output_dir)
    except SandboxError as exc:
        return _Outcome(1, error=str(exc))
    except ValueError as exc:  # the sweep's deployment or blocks, found as it starts
        return _Outcome(2, usage_problem=str(exc))
    return _Outcome(0, result=result, output_dir=result.output_dir)


def _failing_code(notebook: str, result: PipelineResult | None) -> str | None:
    """``cell 3 of NOTEBOOK (counting from 0), line 4: c = f(0)``: the failing cell by its
    number and the line of its code its error points at (`StageSummary`); None when no
    stage says both."""
    from prefect_sandbox.sandbox.notebook import cell_label

    stages = result.stages if result else []
    failed = next((s for s in stages if s.failed_line is not None), None)
    if failed is None:
        return None
    where = f"{cell_label(failed.failed_cell_index)} of {notebook}"
    if failed.failed_cell_index is not None:
        where += " (counting from 0)"
    return f"{strip_ansi(where)}, line {failed.failed_line}: {strip_ansi(failed.failed_code or '')}"


def _cell_plan(
    notebook: str, parameters: dict[str, Any], heading_level: int
) -> list[tuple[str, int | None]] | None:
    """The code cells a run of ``notebook`` runs, in order, its injected parameters cell
    included, each as its stage's name and its number (`CellSpec.number`); None when that
    cannot be told here."""
    from prefect_sandbox.sandbox.errors import NotebookError
    from prefect_sandbox.sandbox.notebook import inject_parameters, read_notebook, split_stages

    try:
        source = inject_parameters(read_notebook(Path(notebook)), parameters)
        stages = split_stages(source, heading_level)
        return [(stage.name, cell.number) for stage in stages for cell in stage.cells]
    except NotebookError:
        return None


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """Within, when ``enabled``, whatever this process and its children write to stdout (file
    descriptor 1) goes to stderr, so that ``--json`` leaves stdout to the one JSON object."""
    if not enabled:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _print_outcome(args: argparse.Namespace, outcome: _Outcome) -> None:
    """What stdout holds: with ``--json`` one JSON object (`_json_outcome`); with ``-q`` the
    results' folder or URL, when the run completed; else where the results are, and a line
    per stage (a failed run's too) or per sweep branch."""
    if args.json:
        print(json.dumps(_json_outcome(outcome)))
        return
    if args.quiet:
        if outcome.exit_status == 0 and outcome.output_dir:
            print(outcome.output_dir)
        return
    from prefect_sandbox.results import PipelineResult, SweepResult

    if isinstance(outcome.result, SweepResult):
        _print_sweep(outcome.result)
    elif isinstance(outcome.result, PipelineResult) and (outcome.exit_status == 0 or args.verbose):
        # A failure's own lines (stderr) say where its files are; -v adds the stage table.
        _print_stages(outcome.result)


def _json_outcome(outcome: _Outcome) -> dict[str, Any]:
    """The ``--json`` object: the run's ``summary.json`` (a sweep's ``sweep.json``) when it
    was written, else ``status``, ``error`` and ``output_dir``; with ``exit_status``."""
    if outcome.result is not None:
        data = outcome.result.model_dump(mode="json")
    else:
        status = "completed" if outcome.exit_status == 0 else "failed"
        if outcome.exit_status not in (0, 1):
            status = "cancelled"
        data = {"status": status, "error": outcome.error, "output_dir": outcome.output_dir}
    return {**data, "exit_status": outcome.exit_status}


def _print_stages(result: PipelineResult) -> None:
    """Where a run's files are, then its stages: status, cells, seconds, and the failing cell."""
    print(
        f"Stored {len(result.artifacts)} file(s) and summary.json in "
        f"{strip_ansi(result.output_dir)}"
    )
    for stage in result.stages:
        cells = f"{stage.cell_count:>3} cell(s)"
        line = f"  {strip_ansi(stage.name):<12} {stage.status:<8} {cells} {stage.duration_s:8.2f} s"
        if stage.ename:
            line += f"  cell {stage.failed_cell_index}: {strip_ansi(stage.ename)}"
        print(line)


def _version() -> str:
    """This distribution's installed version, or "unknown" when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefect-sandbox")
    except PackageNotFoundError:
        return "unknown"


def _help_notebook(path: str, heading_level: int) -> int:
    """Print the notebook's parameters as papermill's ``--help-notebook`` does, then the
    stages a run would have (`_print_stage_plan`); run nothing.

    Returns:
        0 (a notebook with no cell tagged ``parameters`` has none, and says so); 2 when the
        notebook cannot be read or split into stages.
    """
    from prefect_sandbox.sandbox.errors import NotebookError
    from prefect_sandbox.sandbox.notebook import notebook_parameters, read_notebook, split_stages

    try:
        notebook = read_notebook(Path(path))
        found = notebook_parameters(notebook)
        stages = split_stages(notebook, heading_level)
    except NotebookError as exc:
        return _usage_error(str(exc))
    _print_parameters(path, found)
    _print_stage_plan(notebook, stages, heading_level)
    return 0


def _print_stage_plan(notebook: Any, stages: list[Any], heading_level: int) -> None:
    """The stages a run splits the notebook into, each with its code cells' indices (0-based,
    as a failing cell is named), and what split them: stage tags or headings."""
    from prefect_sandbox.sandbox.notebook import STAGE_TAG_PREFIX

    tagged = any(
        tag.startswith(STAGE_TAG_PREFIX)
        for cell in notebook.cells
        for tag in cell.get("metadata", {}).get("tags", [])
    )
    marks = " or ".join("#" * level for level in range(1, heading_level + 1))
    how = "its cells' stage tags" if tagged else f"markdown headings ({marks})"
    print(f"\nStages, split by {how}:")
    if not stages:
        print("  none: the notebook has no code cells to run")
    for stage in stages:
        cells = ", ".join(str(cell.index) for cell in stage.cells)
        print(f"  {strip_ansi(stage.name):<24} cell(s) {cells}")


def _print_parameters(path: str, found: list[Any] | None) -> None:
    """The parameters as papermill's ``--help-notebook`` prints them."""
    print(f"Parameters inferred for notebook {strip_ansi(path)!r}:")
    if found is None:
        print("\n  No cell tagged 'parameters': this notebook takes no parameters.")
        return
    if not found:
        print("\n  Can't infer anything about this notebook's parameters.")
    for parameter in found:
        definition = (
            f"  {parameter.name}: {parameter.type_name or 'Unknown type'} "
            f"(default {parameter.default})"
        )
        if len(definition) <= 30:
            print(f"{definition:<34}{parameter.help}".rstrip())
        elif parameter.help:
            print(f"{definition}\n{' ' * 34}{parameter.help}")
        else:
            print(definition)


def _deploy(args: argparse.Namespace) -> int:
    """Create the ``deploy`` command's deployment (`adeploy_notebook`) on the API at
    ``PREFECT_API_URL``, and say what its Run form holds.

    Returns:
        0; 2 for a notebook that cannot be read or no ``PREFECT_API_URL``; 1 when the API
        does not answer or refuses the deployment (an unknown work pool).
    """
    from prefect.settings import PREFECT_API_URL

    from prefect_sandbox.sandbox.errors import NotebookError
    from prefect_sandbox.sandbox.notebook import notebook_parameters, read_notebook

    try:
        found = notebook_parameters(read_notebook(Path(args.notebook))) or []
    except NotebookError as exc:
        return _usage_error(str(exc))
    if not PREFECT_API_URL.value():
        return _usage_error(
            "deploy needs a Prefect API: set PREFECT_API_URL (a `prefect server start`, "
            "or Prefect Cloud)"
        )
    from prefect.exceptions import PrefectHTTPStatusError

    from prefect_sandbox.flows.notebook_deployment import default_deployment_name, deploy_notebook

    name = args.name or default_deployment_name(args.notebook)
    problem = _api_problem(args)
    if problem:
        print(f"prefect-sandbox: {problem}", file=sys.stderr)
        return 1
    try:
        deployment_id = deploy_notebook(
            args.notebook,
            args.pool,
            name=name,
            inputs=args.input,
            artifacts=args.artifact,
            storage=args.out,
            cell_timeout_s=args.cell_timeout,
        )
    except PrefectHTTPStatusError as exc:
        detail = exc.response.text or str(exc)
        print(f"prefect-sandbox: the API refused the deployment: {detail}", file=sys.stderr)
        return 1
    names = ", ".join(parameter.name for parameter in found) or "none"
    print(f"Deployed run-notebook/{name} ({deployment_id}) on work pool {args.pool!r}")
    print(f"  Run form fields for the notebook's parameters: {names}")
    return 0


def _on_workers(args: argparse.Namespace) -> bool:
    """Whether the notebook runs elsewhere: a sweep's branches on a deployment's workers,
    where the notebook and inputs are paths on the workers' machines."""
    return getattr(args, "deployment", None) is not None


def _print_sweep(result: SweepResult) -> None:
    """A sweep's outcome on stdout: where ``sweep.json`` is, then a table of the branches with
    their parameters and metrics (`sweep_text_table`, the UI table's columns)."""
    from prefect_sandbox.flows.sweep.table import sweep_text_table

    done = sum(branch.status == "completed" for branch in result.branches)
    print(
        f"Stored sweep.json in {result.output_dir}: "
        f"{done} of {len(result.branches)} branch(es) completed"
    )
    for line in sweep_text_table(result):
        print(f"  {line}".rstrip())


def _api_problem(args: argparse.Namespace) -> str | None:
    """Get the run an API: the one at ``PREFECT_API_URL`` when set (checked that it answers);
    else the local server kept for the user (`_local_server_problem`), or Prefect's temporary
    one with ``PREFECT_SANDBOX_LOCAL_SERVER=never`` (`_start_temporary_server`).

    Returns:
        What is wrong, in one line; None when the API is ready.
    """
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    from prefect_sandbox.settings import PrefectSandboxSettings

    url = PREFECT_API_URL.value()
    if not url and PrefectSandboxSettings().local_server != "never":
        return _local_server_problem(args)
    if not url:
        try:
            _start_temporary_server()
        except RuntimeError as exc:  # it timed out or exited; the message holds its output
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return f"Prefect's temporary API server did not start: {first}"
        return None
    with get_client(sync_client=True) as client:
        failure = client.api_healthcheck()
    if failure is None:
        return None
    reason = str(failure).splitlines()[0] if str(failure) else type(failure).__name__
    return f"the Prefect API at PREFECT_API_URL={url} does not answer: {reason}"


def _early_local_server(mode: str, quiet: bool) -> ServerState | None:
    """Find or start the local server now, before Prefect is imported, when the run will need
    it: no ``PREFECT_API_URL`` where the environment, the working directory's files or the
    active profile would set one (`configured_api_url`), and ``mode``
    (``PREFECT_SANDBOX_LOCAL_SERVER``) not ``never``. Prefect's own settings decide later
    (`_api_problem`); a server started for nothing stops once idle.

    Returns:
        The server's state (not waited for); None when none is wanted or it could not start.
    """
    from prefect_sandbox.local_server import LocalServer, configured_api_url

    if mode == "never" or configured_api_url():
        return None
    server = LocalServer()
    try:
        state, started = server.find_or_start()
    except OSError:
        return None  # `_local_server_problem` tries again and says why
    if started and not quiet:
        _say_now(
            f"starting the local Prefect server at {state.url.removesuffix('/api')} (kept for "
            "later runs; `prefect-sandbox server stop` stops it; log: "
            f"{server.log_path})"
        )
    return state


def _start_local_kernel_ahead(backend: str | None, backend_block: str | None) -> None:
    """Start the run's local kernel now, while Prefect is still being imported and the flow run
    created (most of a second), when the run will use the default local backend: ``--backend
    local``, or no ``--backend`` and no ``PREFECT_SANDBOX_BACKEND_BLOCK``. Its create takes it
    (`LocalKernelBackend.start_kernel_ahead`)."""
    if backend not in (None, "local") or (backend is None and backend_block is not None):
        return
    from prefect_sandbox.blocks.local import LocalKernelBackend

    LocalKernelBackend().start_kernel_ahead()


def _end_kernel_started_ahead() -> None:
    """End the kernel `_start_local_kernel_ahead` started, if it has started, without the exit's
    wait for one still starting: a signal ends the command within a second or two. One still
    starting dies with this process (as every local kernel does), and the next run that starts
    one sweeps its folders (`kill_orphaned_pool_kernels`)."""
    if "prefect_sandbox.sandbox.backends.kernel.warm_pool" in sys.modules:
        from prefect_sandbox.sandbox.backends.kernel.warm_pool import close_warm_pools

        close_warm_pools(timeout_s=0)


def _local_server_problem(args: argparse.Namespace) -> str | None:
    """Wait for the local server (found or started by `_early_local_server`, else now), saying
    how it goes unless ``-q``, and point this process and its children at it.

    Returns:
        Why it is not ready, in one line naming the fix; None when it is.
    """
    import time

    from prefect_sandbox.flows.startup import point_prefect_at
    from prefect_sandbox.local_server import LocalServer, LocalServerError

    server = LocalServer()
    began = time.monotonic()
    say = None if args.quiet else (lambda line: _say_now(f"the local Prefect server is {line}"))
    try:
        state = args.local_server or server.find_or_start()[0]
        server.wait_until_ready(state, say)
    except (LocalServerError, OSError) as exc:
        return f"the local Prefect server did not start: {exc}"
    waited_s = time.monotonic() - began
    if waited_s > 1 and say is not None:
        say(f"ready at {state.url.removesuffix('/api')} (waited {waited_s:.0f} s)")
    point_prefect_at(state.url)
    return None


def _say_now(line: str) -> None:
    print(f"prefect-sandbox: {line}", file=sys.stderr, flush=True)


def _server_command(action: str) -> int:
    """``server status|start|stop``: the local Prefect server of this ``PREFECT_HOME``.

    Returns:
        0; 1 for ``status`` when none runs, or ``start`` when it did not start.
    """
    from prefect_sandbox.local_server import LocalServer, LocalServerError, describe

    server = LocalServer()
    if action == "stop":
        stopped = server.stop()
        if stopped is None:
            print(f"No local Prefect server was running (PREFECT_HOME={server.home}).")
        else:
            print(f"Stopped the local Prefect server (pid {stopped.pid}, {stopped.url}).")
        return 0
    if action == "start":
        try:
            state, _ = server.find_or_start()
            server.wait_until_ready(state, lambda line: _say_now(f"the server is {line}"))
        except (LocalServerError, OSError) as exc:
            print(
                f"prefect-sandbox: the local Prefect server did not start: {exc}", file=sys.stderr
            )
            return 1
    lines = describe(server)
    print("\n".join(lines))
    return 0 if server.running() is not None else 1


def _start_temporary_server() -> None:
    """Start Prefect's temporary API server now, when no API URL is set, deaf to SIGINT.

    Prefect starts it in the terminal's process group, where Ctrl-C would stop it before the
    interrupted run is recorded as Cancelled. A blocked signal stays blocked across ``exec``,
    so the server never sees SIGINT; the flow reuses this instance, and Prefect's exit handler
    stops it with SIGTERM.
    """
    from prefect.settings import PREFECT_API_URL

    from prefect_sandbox._compat import temporary_api_server_url

    if PREFECT_API_URL.value():
        return
    # The server's telemetry service writes to its SQLite database while the run does, and
    # prints a "database is locked" traceback on the user's terminal; the user's choice wins.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        temporary_api_server_url()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _quiet_prefect_console(level: int = logging.CRITICAL + 1) -> None:
    """Show only Prefect's log lines at ``level`` or above on the console (all still reach the
    API): after a signal none, so the user gets one line, ours, not the cancelled task runs'
    "Crash detected!" noise; with ``--quiet`` warnings and errors."""
    from prefect_sandbox.progress import prefect_console_handlers

    for handler in prefect_console_handlers():
        handler.setLevel(level)


def _options(args: argparse.Namespace) -> RunOptions:
    """The run's or sweep's options from the arguments, validated with the CLI's context
    (`prefect_sandbox.options`), before any flow starts or Prefect is imported.

    Raises:
        ValidationError: a rule on them is broken (`one_line` says which, naming flags).
    """
    from prefect_sandbox.options import CLI, RunOptions, SweepOptions

    values: dict[str, Any] = {
        "notebook": args.notebook,
        "inputs": args.input,
        "artifacts": args.artifact,
        "storage": args.out,
        "cell_timeout_s": args.cell_timeout,
        "backend": args.backend,
        "backend_block": args.backend_block,
        "docker_image": args.docker_image,
        "aws_credentials": args.aws_credentials,
    }
    if args.command == "run":
        return RunOptions.model_validate(values, context=CLI)
    values.update(
        max_live_sandboxes=args.max_live_sandboxes,
        deployment=args.deployment,
        task_runner=args.task_runner,
        metrics_artifact=args.metrics_artifact,
    )
    return SweepOptions.model_validate(values, context=CLI)


def _settings_problem(error: ValidationError) -> str:
    """Which ``PREFECT_SANDBOX_*`` variables hold bad values, and why, in one line."""
    return "; ".join(
        f"PREFECT_SANDBOX_{'_'.join(map(str, problem['loc'])).upper()}="
        f"{problem['input']!r}: {problem['msg']}"
        for problem in error.errors()
    )


def _backend(args: argparse.Namespace) -> BackendBlock:
    """The backend block the arguments ask for; with no ``--backend``, the flow's default,
    chosen here so that a bad ``PREFECT_SANDBOX_BACKEND_BLOCK`` is a usage error.

    Raises:
        ValueError: a block name that Prefect does not know, or that is no backend block.
    """
    from prefect.utilities.asyncutils import run_coro_as_sync

    from prefect_sandbox.blocks import (
        DaytonaBackend,
        DockerBackend,
        E2BBackend,
        E2BCredentials,
        LocalKernelBackend,
        SandboxBackend,
    )
    from prefect_sandbox.flows.hooks import default_backend

    kinds: dict[str, type[BackendBlock]] = {
        "local": LocalKernelBackend,
        "e2b": E2BBackend,
        "daytona": DaytonaBackend,
        "docker": DockerBackend,
    }
    if args.backend_block:
        loaded = kinds[args.backend or "local"].load(args.backend_block)
        assert isinstance(loaded, SandboxBackend)
        return cast("BackendBlock", loaded)
    if args.backend is None:
        return cast("BackendBlock", run_coro_as_sync(default_backend()))
    if args.backend == "e2b":
        return E2BBackend(credentials=E2BCredentials.from_environment())
    if args.backend == "daytona":
        # With no credentials block, the SDK reads its DAYTONA_* variables.
        return DaytonaBackend()
    if args.backend == "docker":
        return DockerBackend(image=args.docker_image)
    return LocalKernelBackend()


def _storage(out: str, aws_credentials: str | None) -> Any:
    """The flow's ``storage``: an S3Bucket block for ``s3://`` (named credentials or the
    standard AWS environment), else the folder."""
    from prefect_sandbox.s3uri import is_s3_uri, parse_s3_uri

    if not is_s3_uri(out):
        return out
    from prefect_aws import AwsCredentials, S3Bucket

    bucket_name, folder = parse_s3_uri(out)
    credentials = AwsCredentials()
    if aws_credentials:
        credentials = cast(AwsCredentials, AwsCredentials.load(aws_credentials))
    return S3Bucket(bucket_name=bucket_name, bucket_folder=folder, credentials=credentials)


def _usage_error(message: str) -> int:
    print(f"prefect-sandbox: {strip_ansi(message)}", file=sys.stderr)
    return 2


_reason: list[str] = []


def _say_last(message: str) -> None:
    """Print ``message`` to stderr at exit, after Prefect's own shutdown lines; terminal
    controls in it (a file or stage name the notebook chose) are removed."""
    _reason.append(f"prefect-sandbox: {strip_ansi(message)}")


def _print_reason() -> None:
    for line in _reason:
        print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
