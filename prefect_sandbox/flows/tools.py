"""A sandbox session as an LLM's tool, with no LLM SDK as a dependency.

- `openai_tool` and `anthropic_tool`: the ``execute_python(code)`` tool's definition in the
  shapes OpenAI's Chat Completions ``tools`` list (``{"type": "function", "function": {...}}``)
  and Anthropic's Messages ``tools`` list (``{"name", "description", "input_schema"}``) take,
  as plain dicts; `dispatch_tool_call` runs a call's arguments (OpenAI's JSON string, or
  Anthropic's ``input`` dict) and returns the text the model should see.
- `SandboxCodeInterpreter`: MathModelAgent's code-interpreter contract (its
  ``backend/app/tools/base_interpreter.py`` and ``e2b_interpreter.py``), so such an agent can
  swap its interpreter for a session: ``await create(task_id, work_dir, ...)``, ``await
  initialize(timeout)``, ``await execute_code(code) -> (text, error_occurred, error_message)``,
  ``await get_created_images(section)``, ``await cleanup()``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

from prefect_aws import S3Bucket

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.session import (
    SandboxSession,
    SyncSandboxSession,
    sandbox_session,
)
from prefect_sandbox.sandbox.outputs import cap_text, strip_ansi

__all__ = [
    "INTERPRETER_ERROR_CHARS",
    "TOOL_NAME",
    "SandboxCodeInterpreter",
    "anthropic_tool",
    "dispatch_tool_call",
    "dispatch_tool_call_sync",
    "openai_tool",
    "tool_call_code",
]

TOOL_NAME = "execute_python"
_DESCRIPTION = (
    "Run Python code as the next cell of a Jupyter kernel that keeps its state (variables, "
    "imports, files) between calls. Returns stdout, stderr, the value of the last expression, "
    "the names of figures shown, and any error with its traceback. Save files to the working "
    "directory to keep them."
)
_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "The Python code to run, as one cell."}
    },
    "required": ["code"],
    "additionalProperties": False,
}
INTERPRETER_ERROR_CHARS = 1000
"""Characters of ``error_message`` the interpreter adapter returns at most, as MathModelAgent's
``_truncate_text`` keeps (1,000 by default, head and tail)."""
_INTERPRETER_IMAGES = (".png", ".jpg")
# MathModelAgent uploads a work folder's tables only.
_INTERPRETER_INPUTS = (".csv", ".xlsx")


def openai_tool() -> dict[str, Any]:
    """The ``execute_python`` tool for OpenAI's Chat Completions ``tools`` (strict mode: every
    property required, no others)."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": _DESCRIPTION,
            "parameters": copy.deepcopy(_PARAMETERS),
            "strict": True,
        },
    }


def anthropic_tool() -> dict[str, Any]:
    """The ``execute_python`` tool for Anthropic's Messages API ``tools``."""
    return {
        "name": TOOL_NAME,
        "description": _DESCRIPTION,
        "input_schema": copy.deepcopy(_PARAMETERS),
    }


def tool_call_code(arguments: str | Mapping[str, Any]) -> str:
    """The code of an ``execute_python`` call.

    Args:
        arguments: OpenAI's ``function.arguments`` (a JSON string) or Anthropic's ``input``
            (a dict).

    Returns:
        The ``code`` argument.

    Raises:
        ValueError: not JSON, not an object, or without a string ``code`` (says which).
    """
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the arguments are not valid JSON: {exc}") from None
    if not isinstance(arguments, Mapping):
        raise ValueError(f"the arguments must be an object, not {type(arguments).__name__}")
    code = arguments.get("code")
    if not isinstance(code, str):
        raise ValueError('the arguments must have "code", the Python code as a string')
    return code


async def dispatch_tool_call(session: SandboxSession, arguments: str | Mapping[str, Any]) -> str:
    """Run an ``execute_python`` call in the session and return what the model should read.

    Arguments the model got wrong are answered, not raised, so that it can call again.

    Returns:
        The cell's `CellRun.text` (an error's name, message and traceback included), or a line
        starting ``Error:`` saying what is wrong with the arguments.
    """
    try:
        code = tool_call_code(arguments)
    except ValueError as exc:
        return f"Error: {exc}"
    return (await session.run_cell(code)).text


def dispatch_tool_call_sync(session: SyncSandboxSession, arguments: str | Mapping[str, Any]) -> str:
    """`dispatch_tool_call` for a sync flow's session."""
    try:
        code = tool_call_code(arguments)
    except ValueError as exc:
        return f"Error: {exc}"
    return session.run_cell(code).text


class SandboxCodeInterpreter:
    """MathModelAgent's code interpreter contract over a sandbox session; use it inside a flow.

    Facts from MathModelAgent's ``E2BCodeInterpreter``: ``initialize`` starts the sandbox, runs
    set-up code and uploads the work folder's ``.csv`` and ``.xlsx`` files (top level);
    ``execute_code`` returns ``(text, error_occurred, error_message)`` with ``error_message``
    ``"Error: <name>: <value>\\n<traceback>"`` cut to 1,000 characters, head and tail kept, and
    copies the sandbox's top-level files back to the work folder after each call;
    ``get_created_images(section)`` lists the ``.png`` and ``.jpg`` files not listed before;
    ``cleanup`` copies the files back and kills the sandbox. Here the error message also has no
    colour codes, and ``cleanup`` also stores the notebook, artifacts and summary.

    Args:
        task_id: the agent's task id (kept, for its logs).
        work_dir: the local work folder.
        notebook_serializer: MathModelAgent's notebook writer, kept and unused (the session
            writes the executed notebook).
        backend, storage, artifacts: as for `sandbox_session`.
        setup_code: code run first, as MathModelAgent's ``_pre_execute_code`` does; None for
            none.
    """

    def __init__(
        self,
        task_id: str,
        work_dir: str,
        notebook_serializer: Any = None,
        *,
        backend: SandboxBackend | None = None,
        storage: S3Bucket | str | None = None,
        artifacts: list[str] | None = None,
        setup_code: str | None = "import matplotlib\nmatplotlib.use('Agg')",
    ) -> None:
        self.task_id = task_id
        self.work_dir = work_dir
        self.notebook_serializer = notebook_serializer
        self._options: dict[str, Any] = {
            "backend": backend,
            "storage": storage,
            "artifacts": artifacts,
        }
        self._setup_code = setup_code
        self._stack = AsyncExitStack()
        self._session: SandboxSession | None = None
        self._images_seen: set[str] = set()

    @classmethod
    async def create(
        cls, task_id: str, work_dir: str, notebook_serializer: Any = None, **options: Any
    ) -> SandboxCodeInterpreter:
        """Make an interpreter (no sandbox yet: `initialize` starts it)."""
        return cls(task_id, work_dir, notebook_serializer, **options)

    @property
    def session(self) -> SandboxSession:
        """The session, once `initialize` ran.

        Raises:
            RuntimeError: `initialize` has not run, or `cleanup` has.
        """
        if self._session is None:
            raise RuntimeError("the interpreter is not initialized: await initialize() first")
        return self._session

    async def initialize(self, timeout: int = 3000) -> None:
        """Start the sandbox, upload the work folder's tables and run the set-up code.

        Args:
            timeout: MathModelAgent's sandbox lifetime in seconds; here the backend block's
                own lifetime setting (``lifetime_s``) governs, and this is not used.

        Raises:
            FileNotFoundError: the work folder does not exist.
        """
        folder = Path(self.work_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"work folder {self.work_dir!r} does not exist")
        inputs = sorted(
            str(path)
            for path in folder.iterdir()
            if path.is_file() and path.suffix.lower() in _INTERPRETER_INPUTS
        )
        self._session = await self._stack.enter_async_context(
            sandbox_session(inputs=inputs, **self._options)
        )
        if self._setup_code:
            await self.execute_code(self._setup_code)

    async def execute_code(self, code: str) -> tuple[str, bool, str]:
        """Run a cell, then copy the sandbox's top-level files to the work folder.

        Returns:
            ``(text, error_occurred, error_message)``: the model's reading of the cell
            (`CellRun.text`), whether it failed (an error or a timeout), and
            ``"Error: <name>: <value>\\n<traceback>"`` without colour codes, capped at
            `INTERPRETER_ERROR_CHARS` (empty when it did not fail).

        Raises:
            RuntimeError: not initialized.
        """
        done = await self.session.run_cell(code)
        message = ""
        error = done.cell.error
        if error is not None:
            traceback = "\n".join(error.traceback)
            message = cap_text(
                strip_ansi(f"Error: {error.ename}: {error.evalue}\n{traceback}"),
                INTERPRETER_ERROR_CHARS,
            )
        await self.session.download(["*"], self.work_dir)
        return done.text, error is not None, message

    async def get_created_images(self, section: str) -> list[str]:
        """The ``.png`` and ``.jpg`` files in the sandbox's working directory (top level) that no
        earlier call returned.

        Args:
            section: the paper's section asking (MathModelAgent files images under it).

        Returns:
            Their names.
        """
        names = [
            remote.path
            for remote in await self.session.list_files("*")
            if remote.path.lower().endswith(_INTERPRETER_IMAGES)
        ]
        created = [name for name in names if name not in self._images_seen]
        self._images_seen.update(created)
        return created

    async def cleanup(self) -> None:
        """Copy the sandbox's files to the work folder, then end the session: the sandbox is
        killed and the notebook, artifacts and summary are stored. Safe to call twice."""
        if self._session is None:
            return
        try:
            await self._session.download(["*"], self.work_dir)
        finally:
            self._session = None
            await self._stack.aclose()
