"""One run's lifecycle, shared by the pipeline flows (`prefect_sandbox.flows.pipeline`) and
sandbox sessions (`prefect_sandbox.flows.session`): `new_run` makes a `PipelineRun` for the
current flow run, which holds what the run has made so far (stage results, downloaded and stored
files) and how it ended (`RunOutcome`). Its one lifecycle, `PipelineRun.running`, owns the
staging folder, the live-sandbox slot, the sandbox, every way out (an error, a cancellation, a
lost lease, a passed ``timeout_seconds``) and ``summary.json``; the callers hold only their
stages or steps, and end the run from its outcome. Manual: docs/concepts.md.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from uuid import UUID

from nbformat import NotebookNode
from prefect import get_run_logger
from prefect.artifacts import (
    acreate_markdown_artifact,
    acreate_progress_artifact,
    aupdate_progress_artifact,
)
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext

from prefect_sandbox.blocks.base import SandboxBackend, create_refused
from prefect_sandbox.flows.hooks import default_backend, kill_labelled_sandboxes
from prefect_sandbox.flows.limits import SlotError, live_sandbox_slot, run_limits
from prefect_sandbox.flows.metrics import Metric, read_metrics
from prefect_sandbox.flows.report import summary_markdown
from prefect_sandbox.flows.staging import remove_orphaned_staging_dirs, staging_dir
from prefect_sandbox.flows.stopping import cancelled_from_api, sigint_honoured, take_cancellation
from prefect_sandbox.markdown_text import escape_markdown
from prefect_sandbox.results import PipelineResult, StageResult, StageSummary, StoredArtifact
from prefect_sandbox.sandbox.base import Sandbox, SandboxHandle
from prefect_sandbox.sandbox.errors import (
    FileTransferError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxUnavailableError,
)
from prefect_sandbox.sandbox.labels import flow_run_labels
from prefect_sandbox.sandbox.notebook import (
    INLINE_FIGURES_DIR,
    ExecutedNotebook,
    StageSpec,
    failing_line,
    inline_figures,
)
from prefect_sandbox.sandbox.outputs import cap_text
from prefect_sandbox.sandbox.paths import resolve_inside
from prefect_sandbox.sandbox.retries import async_retrying
from prefect_sandbox.settings import PrefectSandboxSettings
from prefect_sandbox.tasks.sandbox import (
    KeptConnections,
    create_sandbox,
    fetch_artifacts,
    kept_connected,
    kill_sandbox,
    partial_stage_result,
    run_stage,
    stage_progress,
    upload_inputs,
)
from prefect_sandbox.tasks.scopes import deadline_passed, shielded
from prefect_sandbox.tasks.storage import (
    ArtifactStore,
    input_credentials,
    plan_inputs,
    resolve_storage,
    store_artifacts,
)

if TYPE_CHECKING:
    from prefect_aws import S3Bucket

__all__ = [
    "EXECUTED_NOTEBOOK_NAME",
    "INLINE_FIGURES_BYTES",
    "METRICS_NAME",
    "RESERVED_NAMES",
    "SETUP_RETRY_DELAY_S",
    "SUMMARY_NAME",
    "PipelineRun",
    "ProgressArtifact",
    "RunOutcome",
    "RunStatus",
    "SetUp",
    "empty_for_this_attempt",
    "new_run",
    "own_names_kept",
    "set_up_again",
    "timed_out_reason",
    "warnings_note",
]

EXECUTED_NOTEBOOK_NAME = "executed.ipynb"
SUMMARY_NAME = "summary.json"
METRICS_NAME = "metrics.json"
"""The stored artifact whose top-level numbers ``summary.json`` carries as ``metrics``."""
RESERVED_NAMES = (EXECUTED_NOTEBOOK_NAME, SUMMARY_NAME, INLINE_FIGURES_DIR)
"""The top-level names of the run's own files in its folder: an artifact whose path is one of
them, or inside one, is stored under another name (`own_names_kept`)."""
INLINE_FIGURES_BYTES = 2 << 20
"""Bytes of PNGs at most that the run summary embeds when the store has no URL to show them."""
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SETUP_RETRY_DELAY_S = 2.0
"""The first wait before a fresh sandbox after a failed set-up, doubling for each one after
(unless the service named a ``Retry-After``)."""

SetUp = Callable[[SandboxHandle], Awaitable[None]]
"""What is done with a new sandbox before its first cell (`PipelineRun.begin`)."""


def set_up_again(error: BaseException) -> bool:
    """Whether a set-up that failed with ``error`` is worth a fresh sandbox: the service was
    busy or unreachable, or the sandbox or its kernel ended during it; not a refused key, bad
    settings or a missing input, which a fresh sandbox meets again, nor a create still refused
    with 429 once the backend waited ``PREFECT_SANDBOX_CREATE_WAIT_S`` (`create_refused`)."""
    return isinstance(
        error, SandboxUnavailableError | SandboxDiedError | SandboxNotFoundError
    ) and not create_refused(error)


def _after_set_ups(error: SandboxError, set_ups: int) -> SandboxError:
    """A copy of ``error`` (same type and fields) whose message says how many sandboxes were
    set up in vain, when more than one was."""
    if set_ups < 2:
        return error
    told = copy.copy(error)
    told.message = f"{error.message} (set-up failed {set_ups} times, each on a fresh sandbox)"
    told.args = (told.message,)
    return told


def _clashes(path: str, taken: set[str]) -> bool:
    """Whether ``path`` is, holds or sits inside one of the ``taken`` paths."""
    parts = path.split("/")
    above = {"/".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return bool(above & taken) or any(other.startswith(f"{path}/") for other in taken)


def own_names_kept(paths: list[str]) -> dict[str, str]:
    """New paths for the artifacts that would shadow, or be shadowed by, the run's own files.

    An artifact whose top-level name is in `RESERVED_NAMES` (``summary.json``,
    ``inline-figures/cell-000-1.png``) gets that name prefixed ``sandbox-``
    (``sandbox-summary.json``), or ``sandbox-2-``, ``sandbox-3-``... when that clashes with
    another artifact's path.

    Args:
        paths: the artifacts' relative POSIX paths.

    Returns:
        Each renamed artifact's path to its new one; the others are not in it.
    """
    taken = set(paths)
    renamed: dict[str, str] = {}
    for path in paths:
        top, slash, rest = path.partition("/")
        if top not in RESERVED_NAMES:
            continue
        others = taken - {path}
        count = 1
        new = f"sandbox-{path}"
        while _clashes(new, others):
            count += 1
            new = f"sandbox-{count}-{top}{slash}{rest}"
        renamed[path] = new
        taken = others | {new}
    return renamed


def _summaries(stages: list[StageSpec], results: list[StageResult]) -> list[StageSummary]:
    by_name = {result.name: result for result in results}
    summaries = []
    for stage in stages:
        result = by_name.get(stage.name)
        if result is None:
            summaries.append(
                StageSummary(
                    name=stage.name, status="not_run", cell_count=len(stage.cells), duration_s=0.0
                )
            )
            continue
        where = _failing_line(stage, result)
        summaries.append(
            StageSummary(
                name=stage.name,
                status=result.status,
                cell_count=len(stage.cells),
                duration_s=round(result.duration_s, 6),
                failed_cell_index=result.failed_cell_index,
                failed_line=where[0] if where else None,
                failed_code=where[1] if where else None,
                ename=result.error.ename if result.error else None,
                evalue=result.error.evalue if result.error else None,
            )
        )
    return summaries


def _failing_line(stage: StageSpec, result: StageResult) -> tuple[int, str] | None:
    """The line number and code in the failing cell that its error points at, if any."""
    if result.error is None or result.status != "failed":
        return None
    cell = next((c for c in stage.cells if c.number == result.failed_cell_index), None)
    return failing_line(cell.source, result.error.traceback) if cell else None


def _write_notebook_files(
    executed: ExecutedNotebook, stage_results: list[StageResult], staging: Path
) -> list[str]:
    """Record every cell's result, write the notebook and its inline figures into ``staging``.

    Returns:
        The written files' relative paths.
    """
    cell_of_msg: dict[str | None, int] = {}
    for stage_result in stage_results:
        for record in stage_result.cells:
            executed.record(record.index, stage_result.name, record.result)
            cell_of_msg[record.result.msg_id] = record.index
    for stage_result in stage_results:
        for msg_id, outputs in stage_result.late_outputs.items():
            if msg_id in cell_of_msg:
                executed.add_outputs(cell_of_msg[msg_id], outputs)
    logger = get_run_logger()
    for warning in executed.write(staging / EXECUTED_NOTEBOOK_NAME):
        logger.warning("Executed notebook: %s", warning)
    figures, warnings = inline_figures(executed.notebook)
    for warning in warnings:
        logger.warning("Inline figure skipped: %s", warning)
    written = []
    for path, image in figures:
        (staging / path).parent.mkdir(parents=True, exist_ok=True)
        (staging / path).write_bytes(image)
        written.append(path)
    return [*written, EXECUTED_NOTEBOOK_NAME]


class ProgressArtifact:
    """A pipeline's progress artifact, posted beside the run rather than in its way: made
    while the sandbox starts, each stage's update sent while the next one runs, in order.
    The run's summary waits for them (`settled`).

    Args:
        stages: how many stages the pipeline has.

    Must be made inside the flow run, on its event loop.
    """

    def __init__(self, stages: int) -> None:
        self._stages = stages
        self._last: asyncio.Task[UUID] = asyncio.create_task(
            acreate_progress_artifact(progress=0.0, description=f"0 of {stages} stage(s) done")
        )

    def stage_done(self, done: int, name: str) -> None:
        """Post that ``done`` stages are done, the last named ``name``, once the posts before
        are in."""
        before = self._last

        async def update() -> UUID:
            artifact_id = await before
            await aupdate_progress_artifact(
                artifact_id,
                progress=100.0 * done / self._stages,
                description=f"{done} of {self._stages} stage(s) done: {escape_markdown(name)}",
            )
            return artifact_id

        self._last = asyncio.create_task(update())

    async def settled(self) -> None:
        """Wait until every post is in; one that failed is a warning (the run goes on)."""
        try:
            await asyncio.shield(self._last)
        except Exception as exc:
            get_run_logger().warning("Progress artifact not posted: %s", exc)


RunStatus = Literal["completed", "failed", "cancelled"]


@dataclass
class RunOutcome:
    """How a run ended, as its lifecycle (`PipelineRun.running`) records it: the first failure
    wins; a cancellation and a passed ``timeout_seconds`` are flags beside it.

    Attributes:
        failure: the first failure (a stage's, the sandbox's, storing's); the run fails with it.
        raised: what left the caller's block or the run's set-up, for the caller's ending to
            raise again: the first cancellation, else the first other exception.
        cancelled: the run was stopped by a signal or the API's Cancelling (ends Cancelled).
        timed_out: the flow run's ``timeout_seconds`` passed (ends TimedOut, a Failed state).
    """

    failure: SandboxError | None = None
    raised: BaseException | None = None
    cancelled: bool = False
    timed_out: bool = False

    def fail(self, error: SandboxError, *, stopped_by_it: bool = False) -> None:
        """Record ``error`` as the run's failure unless it has one already. ``stopped_by_it``:
        the cancellation the run took was this error's (a lost lease stops the stages so), so
        the run failed rather than was cancelled."""
        if self.failure is None:
            self.failure = error
        if stopped_by_it:
            self.cancelled = False

    def cancel(self) -> None:
        """Record that the run was cancelled (a signal, the API's Cancelling)."""
        self.cancelled = True

    def time_out(self) -> None:
        """Record that the flow run's ``timeout_seconds`` passed."""
        self.timed_out = True

    def keep_raised(self, exc: BaseException) -> None:
        """Keep ``exc`` for the caller's ending to raise: a cancellation before any other."""
        cancellation = isinstance(exc, asyncio.CancelledError)
        if self.raised is None or (
            cancellation and not isinstance(self.raised, asyncio.CancelledError)
        ):
            self.raised = exc

    @property
    def status(self) -> RunStatus:
        """``summary.json``'s status: ``"cancelled"``, ``"failed"`` (a failure or a timeout),
        else ``"completed"``."""
        if self.cancelled:
            return "cancelled"
        if self.failure is not None or self.timed_out:
            return "failed"
        return "completed"


def _failure_of(exc: BaseException) -> SandboxError:
    """What ``summary.json`` says of an exception that left the run's block."""
    if isinstance(exc, SandboxError):
        return exc
    return SandboxError(f"the flow's code raised {type(exc).__name__}: {exc}")


@dataclass
class PipelineRun:
    """One pipeline run: what it has made so far, kept so that a failure still stores it."""

    stages: list[StageSpec]
    backend: SandboxBackend
    store: ArtifactStore
    executed: ExecutedNotebook
    progress: ProgressArtifact | None = None
    """The pipeline's progress artifact; None for runs that post none (sessions)."""
    stage_results: list[StageResult] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    stored: list[StoredArtifact] = field(default_factory=list)
    figures: dict[str, str | None] = field(default_factory=dict)
    outcome: RunOutcome = field(default_factory=RunOutcome)
    """How the run ended so far; set by `running` alone."""
    result: PipelineResult | None = None
    """The run's result, once `running` stored ``summary.json``."""
    started: float = field(default_factory=time.monotonic)
    """`time.monotonic` when the run began, for its ``duration_s``."""
    timeout_seconds: float | None = None
    attempt: int = 1
    """The flow run's attempt, Prefect's ``run_count``."""
    sandbox_id: str | None = None
    sandbox_limits: dict[str, str] = field(default_factory=dict)
    sandbox_created_at: datetime | None = None
    sandbox_killed_at: datetime | None = None
    setup_attempts: int = 0
    """Sandboxes made so far to get one set up (`set_up_sandbox`)."""
    warnings: list[str] = field(default_factory=list)
    """What the run could not do without failing (an artifact not fetched), for
    ``summary.json`` and the flow run's state message."""
    _kept: KeptConnections | None = None
    """The connections the sandbox's create made, while it lives (`_sandbox`)."""

    @asynccontextmanager
    async def running(
        self,
        flow_run: FlowRun,
        *,
        inputs: list[str],
        artifacts: list[str],
        summary: tuple[str, str],
        parameters: dict[str, Any] | None = None,
    ) -> AsyncIterator[SandboxHandle | None]:
        """The run's whole life around the caller's block, which it yields the flow run's
        sandbox to: the inputs checked (before any sandbox starts) and uploaded, the sandbox
        made and set up within the run's live-sandbox slot (`_sandbox`), the block, the
        ``artifacts`` downloaded, the sandbox killed, what was made stored, then ``summary.json``
        stored and posted as the artifact ``summary`` (key, description) names, shielded from a
        passed deadline. What was made is stored while the sandbox is killed, once the block
        is left and the artifacts downloaded; ``summary.json`` waits for both. Within, the task
        is cancelled on the API's Cancelling (`cancelled_from_api`) or a SIGINT inherited as
        ignored (`sigint_honoured`).

        Every way out is recorded in `outcome` and none leaves here: what the block raised
        (`RunOutcome.raised`), a cancellation (taken as handled: `take_cancellation`), a
        `SandboxError`, a passed ``timeout_seconds``. The caller ends the run from `outcome`
        and `result` once the block is left.

        Yields:
            The sandbox's handle; None when there is none (inputs refused, no slot, no
            sandbox made, cancelled before): the run is over, `outcome` says how.
        """
        yielded = False
        with staging_dir() as staging:
            outputs = staging / "outputs"
            try:
                async with (
                    sigint_honoured(),
                    cancelled_from_api(flow_run.id, poll_s=PrefectSandboxSettings().cancel_poll_s),
                ):
                    storing: asyncio.Task[None] | None = None
                    try:
                        if inputs:
                            await asyncio.to_thread(
                                plan_inputs, inputs, input_credentials(self.store)
                            )
                        async with self._sandbox(flow_run, staging, inputs) as handle:
                            yielded = True
                            try:
                                yield handle
                            except GeneratorExit:
                                raise
                            except BaseException as exc:
                                self._record(exc)
                            await self._collect_artifacts(handle, staging, artifacts)
                            # All is made and fetched: it is stored while the sandbox is killed.
                            storing = asyncio.create_task(self._store_made(outputs))
                    except (asyncio.CancelledError, SandboxError) as exc:
                        self._record(exc)  # while the sandbox was made or killed, or no slot
                    finally:
                        with shielded():
                            await (storing or self._store_made(outputs))
            except asyncio.CancelledError as exc:
                self._record(exc)  # while the files were stored
            if not yielded:
                yield None
            if not self.outcome.cancelled and deadline_passed():
                self.outcome.time_out()  # it passed while the files were stored
            with shielded():
                if self.progress is not None:
                    await self.progress.settled()
                result = await self.store_summary(
                    outputs, str(flow_run.id), flow_run.name, parameters
                )
        self.result = result
        with shielded():
            await self.post_summary(result, *summary)

    def _record(self, exc: BaseException) -> None:
        """Record in `outcome` how ``exc`` left the run's block or its set-up."""
        if isinstance(exc, asyncio.CancelledError):
            self.outcome.keep_raised(exc)
            if take_cancellation() == "timed_out":
                self.outcome.time_out()
            else:
                self.outcome.cancel()
            return
        if isinstance(exc, SlotError):
            self.outcome.fail(exc, stopped_by_it=True)  # the stages took its cancellation
            if self.sandbox_id is None:
                get_run_logger().warning("Sandbox not made: %s", exc)
        else:
            self.outcome.fail(_failure_of(exc))
        failure = self.outcome.failure
        self.outcome.keep_raised(failure if failure and isinstance(exc, SandboxError) else exc)

    @asynccontextmanager
    async def _sandbox(
        self, flow_run: FlowRun, staging: Path, inputs: list[str]
    ) -> AsyncIterator[SandboxHandle]:
        """The flow run's sandbox, labelled for it, made by the create-sandbox task and set up
        with ``inputs`` (`begin`; a transient failure meets a fresh sandbox: `set_up_sandbox`),
        killed by kill-sandbox on exit, whatever happened inside, all within a slot of the
        backend's live-sandbox limit when it has one, and of a sweep's limit in a sweep's
        branch (`run_limits`). Records its id and the UTC times bracketing its life. A slot
        that cannot be taken, or whose lease is lost while the sandbox lives (which stops it),
        raises `SlotError`. The tasks inside use the connection the create made
        (`kept_connected`): no attach and handshake per task."""
        flow_run_id = str(flow_run.id)
        labels = flow_run_labels(flow_run_id, flow_run.name)

        async def set_up(handle: SandboxHandle) -> None:
            await self.begin(handle, staging, inputs)

        async with (
            live_sandbox_slot(run_limits(self.backend), flow_run_id),
            kept_connected() as self._kept,
        ):
            self.sandbox_created_at = datetime.now(UTC)
            try:
                handle = await self.set_up_sandbox(flow_run_id, labels, set_up)
                try:
                    yield handle
                finally:
                    with shielded():
                        await self._kill(handle)
            except asyncio.CancelledError:
                # Cancelled while the sandbox was made or killed: none may outlive the run or
                # its slot, even one whose handle never came back.
                with shielded():
                    await kill_labelled_sandboxes(self.backend, flow_run_id, "cancelled")
                self.sandbox_killed_at = datetime.now(UTC)
                raise

    async def set_up_sandbox(
        self, flow_run_id: str, labels: dict[str, str], set_up: SetUp | None
    ) -> SandboxHandle:
        """Make a sandbox and ``set_up`` it; after a transient failure (`set_up_again`) that
        sandbox is killed (what a create left behind is found by its label) and a fresh one
        made, after a back-off (`async_retrying`: the service's ``Retry-After``, else
        `SETUP_RETRY_DELAY_S` doubling), up to setting ``setup_attempts`` set-ups in all.
        `setup_attempts` counts them.

        Returns:
            The set-up sandbox's handle; `sandbox_id` and `sandbox_limits` are its.

        Raises:
            SandboxError: the last set-up's error, saying how many failed; a set-up whose
                sandbox was made leaves `sandbox_id` naming it, killed.
        """
        attempts = PrefectSandboxSettings().setup_attempts
        retrying = async_retrying(
            attempts=attempts,
            retry_if=set_up_again,
            first_delay_s=SETUP_RETRY_DELAY_S,
            what="Sandbox set-up",
        )
        try:
            async for attempt in retrying:
                with attempt:
                    self.setup_attempts = attempt.retry_state.attempt_number
                    return await self._set_up_once(flow_run_id, labels, set_up)
        except SandboxError as exc:
            raise _after_set_ups(exc, self.setup_attempts) from exc
        raise AssertionError("unreachable: tenacity reraises")

    async def _set_up_once(
        self, flow_run_id: str, labels: dict[str, str], set_up: SetUp | None
    ) -> SandboxHandle:
        """One set-up: a sandbox made and ``set_up``; what a failed one made is killed before
        its error is raised."""
        self.sandbox_id = None
        try:
            handle = await create_sandbox(self.backend, labels)
        except SandboxError as exc:
            # The create killed what it made if it could; a sandbox made by a try whose answer
            # was lost is found by its label.
            get_run_logger().warning("Sandbox not made: %s", exc)
            await kill_labelled_sandboxes(self.backend, flow_run_id, "its create failed")
            self.sandbox_killed_at = datetime.now(UTC)
            raise
        self.sandbox_id = handle.sandbox_id
        self.sandbox_limits = handle.limits
        if set_up is None:
            return handle
        try:
            await set_up(handle)
        except SandboxError as exc:
            get_run_logger().warning(
                "Sandbox %s: set-up failed (%s); killing it", handle.sandbox_id, exc
            )
            with shielded():
                await self._kill(handle)
            raise
        return handle

    async def _kill(self, handle: SandboxHandle) -> None:
        """Kill the sandbox (kill-sandbox retries what is transient); a kill that still fails
        is a warning naming the sandbox, never the run's failure: what it made is stored and
        its status stays what its cells made it."""
        try:
            await kill_sandbox(self.backend, handle)
        except SandboxError as exc:
            get_run_logger().warning(
                "Sandbox %s could not be killed (%s); its vendor-side lifetime or the reaper "
                "ends it",
                handle.sandbox_id,
                exc,
            )
        else:
            self.sandbox_killed_at = datetime.now(UTC)

    async def execute(self, handle: SandboxHandle, cell_timeout_s: float | None) -> None:
        """Run the stages in order, posting the progress artifact after each, until one fails
        (raises its `SandboxError`) or the run is cancelled; inside `running`, which records
        either."""
        assert self.progress is not None
        for done, stage in enumerate(self.stages, start=1):
            await self._run_stage(handle, stage, cell_timeout_s)
            self.progress.stage_done(done, stage.name)

    async def connected(self, handle: SandboxHandle) -> Sandbox:
        """The run's sandbox, connected, for the caller to close: the connection its create
        made, taken over from the run (`KeptConnections.take`), else attached now.

        Raises:
            SandboxError: as ``backend.attach`` raises.
        """
        kept = None if self._kept is None else self._kept.take(handle)
        return kept or await self.backend.attach(handle)

    def add_stage(self, name: str) -> tuple[StageSpec, StageResult]:
        """A stage decided as the run goes (a session's step), added to the run with no cells
        yet, and its result so far (status ``"ok"``), which its attempts' results join.

        Returns:
            The stage and its result, both the run's own.
        """
        stage = StageSpec(name=name, cells=[])
        result = StageResult(name=name, status="ok")
        self.stages.append(stage)
        self.stage_results.append(result)
        return stage, result

    async def begin(self, handle: SandboxHandle, staging: Path, inputs: list[str]) -> None:
        """Note the sandbox in the notebook's metadata and upload the inputs into it.

        Raises:
            FileTransferError: an input could not be uploaded (names it).
        """
        self.executed.set_metadata(backend=handle.backend, sandbox_id=handle.sandbox_id)
        if handle.kernel is not None:
            self.executed.set_kernel(handle.kernel)
        if inputs:
            await upload_inputs(self.backend, handle, inputs, str(staging / "inputs"), self.store)

    async def _collect_artifacts(
        self, handle: SandboxHandle, staging: Path, artifacts: list[str]
    ) -> None:
        """Download the files matching ``artifacts`` into ``staging``, unless the sandbox is
        already known to be gone; what could not be fetched is added to `warnings`, a failure
        is the run's unless it has one already."""
        # A sandbox that expired or was killed has no files left to collect.
        if artifacts and not isinstance(self.outcome.failure, SandboxNotFoundError):
            try:
                with shielded():
                    fetched = await fetch_artifacts(
                        self.backend, handle, artifacts, str(staging / "outputs")
                    )
                self.downloaded = fetched.downloaded
                self.warnings.extend(fetched.not_fetched)
            except SandboxError as exc:
                # The notebook and summary.json are still stored; the run fails with this.
                self.outcome.fail(exc)
            self._keep_own_names(staging / "outputs")

    def _keep_own_names(self, outputs: Path) -> None:
        """Move the downloaded artifacts that the run's own files would overwrite to the
        names `own_names_kept` gives them, each named in a warning."""
        renamed = own_names_kept(self.downloaded)
        logger = get_run_logger()
        for old, new in renamed.items():
            target = resolve_inside(outputs, new)
            target.parent.mkdir(parents=True, exist_ok=True)
            resolve_inside(outputs, old).replace(target)
            logger.warning(
                "Artifact %r is stored as %r: %s are the run's own",
                old,
                new,
                ", ".join(RESERVED_NAMES),
            )
        for name in RESERVED_NAMES:
            if (outputs / name).is_dir():
                shutil.rmtree(outputs / name)  # emptied of files above
        self.downloaded = [renamed.get(path, path) for path in self.downloaded]

    async def _run_stage(
        self, handle: SandboxHandle, stage: StageSpec, cell_timeout_s: float | None
    ) -> None:
        # The stage before's result: Prefect draws the stage task runs as the chain they are
        # (it knows the task run that returned that object), not as a fan of parallel ones.
        before = self.stage_results[-1:]
        with stage_progress() as progress:
            try:
                result = await run_stage(
                    self.backend, handle, stage, cell_timeout_s, wait_for=before
                )
            except (SandboxError, asyncio.CancelledError) as exc:
                partial = partial_stage_result(exc, progress)
                if partial is not None:
                    self.stage_results.append(partial)
                raise
        self.stage_results.append(result)

    async def _store_made(self, outputs: Path) -> None:
        """Store the executed notebook, its inline figures and the downloaded artifacts from
        ``outputs``; a file that could not be stored becomes the failure unless there already
        is one."""
        outputs.mkdir(exist_ok=True)
        written = _write_notebook_files(self.executed, self.stage_results, outputs)
        with shielded():
            self.stored, storage_failures = await store_artifacts(
                str(outputs), [*self.downloaded, *written], self.store
            )
            self.figures = await asyncio.to_thread(_figure_urls, self.stored, self.store, outputs)
        if storage_failures:
            self.outcome.fail(
                FileTransferError(
                    f"{len(storage_failures)} artifact(s) could not be stored in "
                    f"{self.store.output_dir}: {'; '.join(storage_failures)}"
                )
            )

    async def store_summary(
        self,
        outputs: Path,
        flow_run_id: str,
        flow_run_name: str,
        parameters: dict[str, Any] | None = None,
    ) -> PipelineResult:
        """The run's result, also written to ``outputs`` as ``summary.json`` and stored, with
        the injected ``parameters`` and the metrics of a stored `METRICS_NAME`."""
        # One line for people; a cell's full exception text is in the notebook only.
        outcome = self.outcome
        error = cap_text(str(outcome.failure)) if outcome.failure else None
        if outcome.cancelled:
            error = f"cancelled {_stopped_where(self.stage_results)}"
        elif outcome.timed_out:
            timed_out = (
                f"{timed_out_reason(self.timeout_seconds)} {_stopped_where(self.stage_results)}"
            )
            error = f"{error}; then {timed_out}" if error else timed_out
        result = PipelineResult(
            flow_run_id=flow_run_id,
            flow_run_name=flow_run_name,
            attempt=self.attempt,
            status=outcome.status,
            stages=_summaries(self.stages, self.stage_results),
            artifacts=self.stored,
            output_dir=self.store.output_dir,
            duration_s=round(time.monotonic() - self.started, 6),
            error=error,
            sandbox_id=self.sandbox_id,
            sandbox_created_at=self.sandbox_created_at,
            sandbox_killed_at=self.sandbox_killed_at,
            sandbox_limits=self.sandbox_limits,
            parameters=parameters or {},
            metrics=self._metrics(outputs),
            setup_attempts=self.setup_attempts,
            warnings=self.warnings,
        )
        (outputs / SUMMARY_NAME).write_text(result.model_dump_json(indent=2))
        await asyncio.to_thread(self.store.store, outputs / SUMMARY_NAME, SUMMARY_NAME)
        return result

    def _metrics(self, outputs: Path) -> dict[str, Metric]:
        """The key metrics of the stored `METRICS_NAME`, read from its staged copy as a sweep
        reads its branches' (`read_metrics`); a file that is no JSON object is a warning."""
        stored = next((a for a in self.stored if a.path == METRICS_NAME), None)
        if stored is None:
            return {}
        metrics, problem = read_metrics(stored.size_bytes, (outputs / METRICS_NAME).read_bytes)
        if problem:
            get_run_logger().warning("No metrics from %r: %s", METRICS_NAME, problem)
        return metrics

    async def post_summary(self, result: PipelineResult, key: str, description: str) -> None:
        """Post the run's summary as a markdown artifact and log where its files are."""
        await acreate_markdown_artifact(
            key=key, markdown=summary_markdown(result, self.figures), description=description
        )
        get_run_logger().info(
            "Stored %d file(s) and %s in %s", len(self.stored), SUMMARY_NAME, self.store.output_dir
        )


def warnings_note(warnings: list[str]) -> str:
    """What a flow run's state message adds for the run's ``warnings``: ``""`` for none, else
    ``"; 1 warning: artifact 'a.csv' not downloaded: ..."`` (capped as one line of text)."""
    if not warnings:
        return ""
    count = f"{len(warnings)} warning{'s' if len(warnings) > 1 else ''}"
    return cap_text(f"; {count}: {'; '.join(warnings)}")


def timed_out_reason(timeout_seconds: float | None) -> str:
    """How a run's error says its flow run's ``timeout_seconds`` (None: not known) passed."""
    limit = f", {timeout_seconds} s" if timeout_seconds else ""
    return f"timed out (the flow run's timeout_seconds{limit})"


async def empty_for_this_attempt(store: ArtifactStore, flow_run: FlowRun) -> None:
    """Remove what an earlier attempt of the flow run stored in its folder, which is the same
    for each attempt of a retried flow run, so that what this attempt lists is all there is;
    a warning says how many files went.

    Args:
        store: the flow run's store, made ready (`ArtifactStore.prepare`).
        flow_run: the flow run; its ``run_count`` is the attempt's number.

    Raises:
        FileTransferError: a file could not be removed (names the folder).
    """
    removed = await asyncio.to_thread(store.clear)
    if removed:
        get_run_logger().warning(
            "Flow run attempt %d: removed the %d file(s) an earlier attempt stored in %s; "
            "each attempt starts afresh",
            flow_run.run_count,
            removed,
            store.output_dir,
        )


async def new_run(
    source: NotebookNode,
    stages: list[StageSpec],
    backend: SandboxBackend | None,
    storage: S3Bucket | str | None,
    what: str,
    *,
    folder_suffix: str = "",
) -> tuple[PipelineRun, FlowRun]:
    """A run of the current flow run: its store made ready, its notebook started.

    Args:
        source: the notebook whose executed copy the run stores.
        stages: the stages it runs (a session adds its steps as it goes).
        backend: the backend block; None for `default_backend`.
        storage: as the pipeline flows take it; None for ``PREFECT_SANDBOX_STORAGE``.
        what: what is run, for the error outside a flow run (``"a pipeline"``).
        folder_suffix: added to the run's folder name (`resolve_storage`), for a flow run's
            second sandbox session and later.

    Returns:
        The run and the flow run it belongs to.

    Raises:
        RuntimeError: not called inside a flow run.
        FileTransferError: files cannot be stored in ``storage``.
    """
    started = time.monotonic()
    context = FlowRunContext.get()
    if context is None or context.flow_run is None or context.flow is None:
        raise RuntimeError(f"{what} runs inside a Prefect flow run; call it from a @flow")
    flow_run = context.flow_run
    if storage is None:
        storage = PrefectSandboxSettings().storage
    if backend is None:
        backend = await default_backend()
    store = resolve_storage(
        storage, context.flow.name, flow_run.name, str(flow_run.id), folder_suffix=folder_suffix
    )
    store.prepare()
    await empty_for_this_attempt(store, flow_run)
    executed = ExecutedNotebook(source)
    executed.set_metadata(flow_run_id=str(flow_run.id), flow_run_name=flow_run.name)
    # Those of SIGKILLed runs on this machine, which could not remove their own.
    await asyncio.to_thread(remove_orphaned_staging_dirs)
    run = PipelineRun(stages, backend, store, executed, started=started)
    run.timeout_seconds = context.flow.timeout_seconds
    run.attempt = max(flow_run.run_count, 1)
    return run, flow_run


def _stopped_where(stage_results: list[StageResult]) -> str:
    """Where a cancelled or timed-out run stopped, e.g. "during stage 'fit', cell 4; its
    sandbox was killed"."""
    stopped = next((r for r in stage_results if r.status != "ok"), None)
    if stopped is not None:
        where = f"during stage {stopped.name!r}, cell {stopped.failed_cell_index}"
    else:
        where = f"after {len(stage_results)} stage(s)"
    return f"{where}; its sandbox was killed"


def _figure_urls(
    stored: list[StoredArtifact], store: ArtifactStore, staged: Path
) -> dict[str, str | None]:
    """Each stored PNG's path to a URL the Prefect UI can show it from, or None.

    The store's own URL when it has one (S3: presigned); otherwise a ``data:`` URI of the staged
    copy, while the PNGs embedded so far stay within `INLINE_FIGURES_BYTES`.
    """
    urls: dict[str, str | None] = {}
    budget = INLINE_FIGURES_BYTES
    for artifact in stored:
        if not artifact.path.lower().endswith(".png"):
            continue
        url = store.view_url(artifact)
        if url is None and artifact.size_bytes <= budget:
            data = resolve_inside(staged, artifact.path).read_bytes()
            if data.startswith(_PNG_SIGNATURE):
                url = f"data:image/png;base64,{base64.b64encode(data).decode()}"
                budget -= artifact.size_bytes
        urls[artifact.path] = url
    return urls
