"""A sandbox session as an LLM's tool, with no LLM SDK as a dependency.

- `openai_tool` and `anthropic_tool`: the ``execute_python(code)`` tool's definition, typed as
  the SDKs' own params (``ChatCompletionToolParam``, ``ToolParam``) where the SDK is installed:
  the types are imported for type checkers only, and are plain dicts at run time.
- `dispatch_tool_call` runs a call's arguments (OpenAI's JSON string, Anthropic's ``input``)
  and returns the text the model should see; `run_tool_call` returns the `CellRun` itself, from
  which `openai_tool_messages` and `anthropic_tool_result` build each API's tool-result message
  (Anthropic's with ``is_error`` and image blocks), and `cell_figures` gives the figures;
  `openai_assistant_message` turns a reply into the param that sends it back.
- `SandboxCodeInterpreter`: MathModelAgent's code interpreter (``BaseCodeInterpreter`` and its
  ``E2BCodeInterpreter`` and ``LocalCodeInterpreter``; facts in docs/how-to/agents.md), so its
  CoderAgent runs unchanged on a session.
"""

from __future__ import annotations

import base64
import binascii
import copy
import inspect
import json
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prefect_aws import S3Bucket

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows.session import (
    CellRun,
    SandboxSession,
    SyncSandboxSession,
    sandbox_session,
)
from prefect_sandbox.sandbox.model_text import (
    MATHMODELAGENT_BLOCK_CHARS,
    mathmodelagent_error,
    mathmodelagent_text,
)
from prefect_sandbox.sandbox.notebook import inline_figure_path
from prefect_sandbox.sandbox.outputs import strip_ansi

if TYPE_CHECKING:
    from anthropic.types import ImageBlockParam, TextBlockParam, ToolParam, ToolResultBlockParam
    from openai.types.chat import (
        ChatCompletionAssistantMessageParam,
        ChatCompletionContentPartParam,
        ChatCompletionMessage,
        ChatCompletionMessageParam,
        ChatCompletionMessageToolCallUnionParam,
        ChatCompletionToolParam,
    )

__all__ = [
    "ANTHROPIC_IMAGE_BYTES",
    "INTERPRETER_ERROR_CHARS",
    "TOOL_NAME",
    "Figure",
    "SandboxCodeInterpreter",
    "anthropic_tool",
    "anthropic_tool_result",
    "cell_figures",
    "create_interpreter",
    "dispatch_tool_call",
    "dispatch_tool_call_sync",
    "openai_assistant_message",
    "openai_tool",
    "openai_tool_messages",
    "run_tool_call",
    "run_tool_call_sync",
    "tool_call_code",
]

TOOL_NAME = "execute_python"
_DESCRIPTION = (
    "Run Python code as the next cell of a Jupyter kernel that keeps its state (variables, "
    "imports, files) between calls. Returns stdout, stderr, the value of the last expression, "
    "the names of figures shown, and any error with its traceback; what the cell printed is "
    "inside code fences, and lines outside fences are the tool's own. Save files to the "
    "working directory to keep them."
)
_PARAMETERS: dict[str, object] = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "description": "The Python code to run, as one cell."}
    },
    "required": ["code"],
    "additionalProperties": False,
}
INTERPRETER_ERROR_CHARS = MATHMODELAGENT_BLOCK_CHARS
"""Characters of ``error_message`` the interpreter adapter returns at most, as MathModelAgent's
``_truncate_text`` keeps (1,000 by default, head and tail)."""
ANTHROPIC_IMAGE_BYTES = 3_750_000
"""Bytes of one image `anthropic_tool_result` attaches at most: its base64 is then within the
5 MB Anthropic's Messages API accepts per image (its vision guide)."""
_ANTHROPIC_IMAGE_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
_INTERPRETER_IMAGES = (".png", ".jpg", ".jpeg")
# MathModelAgent uploads a work folder's tables and fonts only.
_INTERPRETER_INPUTS = (".csv", ".xlsx", ".ttf", ".otf", ".ttc")


def openai_tool() -> ChatCompletionToolParam:
    """The ``execute_python`` tool for OpenAI's Chat Completions ``tools`` (strict mode: every
    property required, no others); a fresh dict each call."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": _DESCRIPTION,
            "parameters": copy.deepcopy(_PARAMETERS),
            "strict": True,
        },
    }


def anthropic_tool() -> ToolParam:
    """The ``execute_python`` tool for Anthropic's Messages API ``tools``; a fresh dict each
    call."""
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


async def run_tool_call(
    session: SandboxSession, arguments: str | Mapping[str, Any]
) -> CellRun | str:
    """Run an ``execute_python`` call in the session.

    Args:
        session: the session.
        arguments: OpenAI's ``function.arguments`` (a JSON string) or Anthropic's ``input``
            (a dict).

    Returns:
        The cell's `CellRun`, or, for arguments the model got wrong (answered, not raised, so
        that it can call again), a line starting ``Error:`` saying what is wrong.
    """
    try:
        code = tool_call_code(arguments)
    except ValueError as exc:
        return f"Error: {exc}"
    return await session.run_cell(code)


async def dispatch_tool_call(session: SandboxSession, arguments: str | Mapping[str, Any]) -> str:
    """Run an ``execute_python`` call in the session and return what the model should read:
    the cell's `CellRun.text`, or `run_tool_call`'s ``Error:`` line."""
    done = await run_tool_call(session, arguments)
    return done if isinstance(done, str) else done.text


def run_tool_call_sync(
    session: SyncSandboxSession, arguments: str | Mapping[str, Any]
) -> CellRun | str:
    """`run_tool_call` for a sync flow's session."""
    try:
        code = tool_call_code(arguments)
    except ValueError as exc:
        return f"Error: {exc}"
    return session.run_cell(code)


def dispatch_tool_call_sync(session: SyncSandboxSession, arguments: str | Mapping[str, Any]) -> str:
    """`dispatch_tool_call` for a sync flow's session."""
    done = run_tool_call_sync(session, arguments)
    return done if isinstance(done, str) else done.text


@dataclass(frozen=True)
class Figure:
    """An image a cell displayed, readable while the session goes on.

    Attributes:
        name: for a PNG, the name the model read (``inline-figures/cell-004-1.png``), under
            which the flow stores it at the end; None for other types.
        mime_type: ``image/png``, ``image/jpeg`` or ``image/svg+xml``.
        data: the image's bytes (an SVG's UTF-8 text).
    """

    name: str | None
    mime_type: str
    data: bytes


def cell_figures(run: CellRun) -> list[Figure]:
    """The images the cell displayed, in order, named as `CellRun.text` names them.

    An image whose base64 does not decode is left out (the flow warns of it when storing)."""
    figures = []
    pngs = 0
    for output in run.cell.outputs:
        data = output.get("data", {}) if output["output_type"] != "stream" else {}
        for mime in _FIGURE_TYPES:
            if mime not in data:
                continue
            value = data[mime] if isinstance(data[mime], str) else "".join(data[mime])
            name = None
            if mime == "image/png":
                pngs += 1
                name = inline_figure_path(run.cell_index, pngs)
            if mime == "image/svg+xml":
                figures.append(Figure(name, mime, value.encode()))
                continue
            try:
                figures.append(Figure(name, mime, base64.b64decode(value, validate=True)))
            except (binascii.Error, ValueError):
                continue
    return figures


def openai_assistant_message(reply: ChatCompletionMessage) -> ChatCompletionAssistantMessageParam:
    """The assistant's reply (``answer.choices[0].message``) as the param to send it back in
    ``messages``: its content and tool calls (the SDK's response model is not a param)."""
    message: ChatCompletionAssistantMessageParam = {"role": "assistant", "content": reply.content}
    calls: list[ChatCompletionMessageToolCallUnionParam] = []
    for call in reply.tool_calls or []:
        if call.type == "function":
            function = call.function
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": function.name, "arguments": function.arguments},
                }
            )
        else:
            custom = call.custom
            calls.append(
                {
                    "id": call.id,
                    "type": "custom",
                    "custom": {"name": custom.name, "input": custom.input},
                }
            )
    if calls:
        message["tool_calls"] = calls
    return message


def openai_tool_messages(
    outcomes: Mapping[str, CellRun | str], *, images: bool = False
) -> list[ChatCompletionMessageParam]:
    """The messages that answer one OpenAI Chat Completions turn's tool calls.

    A ``role: tool`` message per call, with its text (a tool message may hold text only, by
    the API's ``ChatCompletionToolMessageParam``); then, with ``images`` and when the cells
    showed PNG or JPEG figures, one ``role: user`` message holding them as ``image_url`` parts
    (data URLs), the way the API takes images, after every tool message (the API wants the tool
    messages right after the assistant's). Append them all before the next request.

    Args:
        outcomes: each call's ``id`` to its `run_tool_call` result, in the calls' order.
        images: whether to send the figures too, for a model that reads images.
    """
    messages: list[ChatCompletionMessageParam] = []
    parts: list[ChatCompletionContentPartParam] = []
    for call_id, outcome in outcomes.items():
        text = outcome if isinstance(outcome, str) else outcome.text
        messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        if not images or isinstance(outcome, str):
            continue
        shown = [f for f in cell_figures(outcome) if f.mime_type in ("image/png", "image/jpeg")]
        if shown:
            intro = f"The figures that tool call {call_id} showed, in order:"
            parts.append({"type": "text", "text": intro})
        for figure in shown:
            url = f"data:{figure.mime_type};base64,{base64.b64encode(figure.data).decode()}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
    if parts:
        messages.append({"role": "user", "content": parts})
    return messages


def anthropic_tool_result(
    tool_use_id: str,
    outcome: CellRun | str,
    *,
    images: bool = True,
    max_image_bytes: int = ANTHROPIC_IMAGE_BYTES,
) -> ToolResultBlockParam:
    """The ``tool_result`` block that answers an Anthropic ``tool_use`` block; send it in the
    next ``role: user`` message's content.

    Its content is a text block (`CellRun.text`, or the ``Error:`` line) and, with ``images``,
    an image block (base64) per figure of a type the API takes (PNG, JPEG); a figure over
    ``max_image_bytes`` is not attached, and a text block says so. ``is_error`` is True when
    the cell raised or timed out, or the arguments were wrong.

    Args:
        tool_use_id: the ``tool_use`` block's ``id``.
        outcome: `run_tool_call`'s result.
        images: whether to attach figures.
        max_image_bytes: the largest image attached, in bytes.
    """
    if isinstance(outcome, str):
        return {
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": [{"type": "text", "text": outcome}],
            "is_error": True,
        }
    content: list[TextBlockParam | ImageBlockParam] = [{"type": "text", "text": outcome.text}]
    for figure in cell_figures(outcome) if images else []:
        if figure.mime_type not in _ANTHROPIC_IMAGE_TYPES:
            continue
        label = figure.name or figure.mime_type
        if len(figure.data) > max_image_bytes:
            note = (
                f"[figure {label} not attached: {len(figure.data)} bytes, over {max_image_bytes}]"
            )
            content.append({"type": "text", "text": note})
            continue
        content.append(
            {
                "type": "image",
                "source": {
                    "type": "base64",
                    "media_type": "image/png" if figure.mime_type == "image/png" else "image/jpeg",
                    "data": base64.b64encode(figure.data).decode(),
                },
            }
        )
    return {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content,
        "is_error": outcome.status != "ok",
    }


OutputCallback = Callable[[list[dict[str, Any]]], "Awaitable[None] | None"]
"""``on_output(items)``: a cell's outputs as MathModelAgent's ``OutputItem`` dicts (sync or
async), where its interpreters publish ``InterpreterMessage(output=items)`` to their UI
channel."""

# MathModelAgent's ResultModel formats, by the MIME type each one shows (E2BCodeInterpreter).
_UI_FORMATS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "image/svg+xml": "svg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def _ui_items(run: CellRun) -> list[dict[str, Any]]:
    """A cell's outputs as MathModelAgent's UI items (``StdOutModel``, ``StdErrModel``,
    ``ResultModel`` per format, ``ErrorModel``), terminal controls removed."""
    items: list[dict[str, Any]] = []
    for output in run.cell.outputs:
        kind = output["output_type"]
        if kind == "stream":
            items.append({"res_type": output["name"], "msg": strip_ansi(output["text"])})
        elif kind == "error":
            items.append(
                {
                    "res_type": "error",
                    "msg": None,
                    "name": strip_ansi(output["ename"]),
                    "value": strip_ansi(output["evalue"]),
                    "traceback": strip_ansi("\n".join(output.get("traceback", []))),
                }
            )
        else:
            for mime, value in output.get("data", {}).items():
                if mime not in _UI_FORMATS:
                    continue
                if mime == "application/json":
                    msg = json.dumps(value, ensure_ascii=False)
                else:
                    msg = value if isinstance(value, str) else "".join(value)
                items.append({"res_type": "result", "format": _UI_FORMATS[mime], "msg": msg})
    return items


class SandboxCodeInterpreter:
    """MathModelAgent's code interpreter over a sandbox session; use it inside a flow.

    It has the whole public surface of MathModelAgent's ``BaseCodeInterpreter`` (its
    ``backend/app/tools/base_interpreter.py``; facts in docs/how-to/agents.md): the attributes
    ``task_id``, ``work_dir``, ``notebook_serializer``, ``section_output`` and
    ``last_created_images``; `initialize`, `execute_code`, `get_created_images`, `cleanup`,
    `add_section`, `add_content`, `get_code_output`, `delete_color_control_char`, and the
    ``create`` factory of its ``E2BCodeInterpreter``. Files go as there: `initialize` uploads
    the work folder's tables and fonts (top level), `execute_code` copies the sandbox's files
    back after each cell, `cleanup` copies them once more and ends the session (the sandbox is
    killed; the notebook, artifacts and summary are stored).

    Args:
        task_id: the agent's task id (kept, for its logs).
        work_dir: the local work folder.
        notebook_serializer: MathModelAgent's notebook writer, kept and unused (the session
            writes the executed notebook).
        backend: as for `sandbox_session`.
        storage: as for `sandbox_session`.
        artifacts: as for `sandbox_session`.
        setup_code: code run first, as MathModelAgent's ``_pre_execute_code`` does; None for
            none.
        on_output: called after each cell with its outputs as MathModelAgent's UI items
            (`OutputCallback`), where its interpreters publish them; None for no one.
        text: what `execute_code`'s text is: ``"model_text"`` (`CellRun.text`, fenced) or
            ``"mathmodelagent"`` (`mathmodelagent_text`, the shape MathModelAgent's own
            interpreters give and its prompts expect).
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
        on_output: OutputCallback | None = None,
        text: Literal["model_text", "mathmodelagent"] = "model_text",
    ) -> None:
        if text not in ("model_text", "mathmodelagent"):
            raise ValueError(f"text must be 'model_text' or 'mathmodelagent', not {text!r}")
        self.task_id = task_id
        self.work_dir = work_dir
        self.notebook_serializer = notebook_serializer
        self.section_output: dict[str, dict[str, list[str]]] = {}
        self.last_created_images: set[str] = set()
        self._options: dict[str, Any] = {
            "backend": backend,
            "storage": storage,
            "artifacts": artifacts,
        }
        self._setup_code = setup_code
        self._on_output = on_output
        self._text = text
        self._stack = AsyncExitStack()
        self._session: SandboxSession | None = None

    @classmethod
    async def create(
        cls, task_id: str, work_dir: str, notebook_serializer: Any = None, **options: Any
    ) -> SandboxCodeInterpreter:
        """Make an interpreter (no sandbox yet: `initialize` starts it); ``options`` are the
        constructor's keyword arguments."""
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
        """Start the sandbox, upload the work folder's tables and fonts and run the set-up
        code.

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
        await self._pre_execute_code()

    async def _pre_execute_code(self) -> None:
        """Run the set-up code, as MathModelAgent's interpreters do when they start."""
        if self._setup_code:
            await self.execute_code(self._setup_code)

    async def execute_code(self, code: str) -> tuple[str, bool, str]:
        """Run a cell, hand its outputs to ``on_output``, then copy the sandbox's files to the
        work folder.

        Returns:
            ``(text, error_occurred, error_message)``: the model's reading of the cell (as the
            ``text`` option says), whether it failed (an error or a timeout), and
            `mathmodelagent_error` (``"Error: <name>: <value>\\n<traceback>"``, capped at
            `INTERPRETER_ERROR_CHARS`; empty when it did not fail).

        Raises:
            RuntimeError: not initialized.
        """
        done = await self.session.run_cell(code)
        if self._on_output is not None:
            published = self._on_output(_ui_items(done))
            if inspect.isawaitable(published):
                await published
        await self.session.download(["*"], self.work_dir)
        text = done.text if self._text == "model_text" else mathmodelagent_text(done.cell)
        return text, done.status != "ok", mathmodelagent_error(done.cell)

    async def get_created_images(self, section: str) -> list[str]:
        """The ``.png``, ``.jpg`` and ``.jpeg`` files in the sandbox's working directory (top
        level) not there at the last call, as MathModelAgent's ``LocalCodeInterpreter`` finds
        them; also added to the section's ``images``.

        Args:
            section: the paper's section asking (MathModelAgent files images under it).

        Returns:
            Their names, sorted.
        """
        current = {
            remote.path
            for remote in await self.session.list_files("*")
            if remote.path.lower().endswith(_INTERPRETER_IMAGES)
        }
        created = sorted(current - self.last_created_images)
        self.last_created_images = current
        self.add_section(section)
        self.section_output[section]["images"].extend(created)
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

    def add_section(self, section_name: str) -> None:
        """Start a section (a subtask's title) with no content or images, unless it exists."""
        self.section_output.setdefault(section_name, {"content": [], "images": []})

    def add_content(self, section: str, text: str) -> None:
        """Add text to a section, starting it if needed."""
        self.add_section(section)
        self.section_output[section]["content"].append(text)

    def get_code_output(self, section: str) -> str:
        """A section's content, joined by newlines.

        Raises:
            KeyError: no such section (as MathModelAgent's does).
        """
        if section not in self.section_output:
            raise KeyError(f"no section {section!r}: add_section() or add_content() it first")
        return "\n".join(self.section_output[section]["content"])

    def delete_color_control_char(self, string: str) -> str:
        """``string`` without ANSI colour codes, as MathModelAgent's gives it; here without
        every other terminal control too (`strip_ansi`)."""
        return strip_ansi(string)


async def create_interpreter(
    kind: str = "local",
    *,
    task_id: str,
    work_dir: str,
    notebook_serializer: Any = None,
    timeout: int = 3000,
    **options: Any,
) -> SandboxCodeInterpreter:
    """MathModelAgent's ``create_interpreter`` factory: an initialized `SandboxCodeInterpreter`.

    Args:
        kind: MathModelAgent's ``"local"`` or ``"remote"``; unused, as the backend block (in
            ``options``) decides where cells run.
        task_id: as for `SandboxCodeInterpreter`.
        work_dir: as for `SandboxCodeInterpreter`.
        notebook_serializer: as for `SandboxCodeInterpreter`.
        timeout: passed to `SandboxCodeInterpreter.initialize`.
        options: `SandboxCodeInterpreter`'s keyword arguments.
    """
    interpreter = await SandboxCodeInterpreter.create(
        task_id, work_dir, notebook_serializer, **options
    )
    await interpreter.initialize(timeout=timeout)
    return interpreter
