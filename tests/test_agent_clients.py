"""Agents driving sessions as real clients do: a driver shaped like MathModelAgent's CoderAgent
and workflow, calling every method of its interpreter, on local, E2B and Daytona; and the
OpenAI and Anthropic loops of docs/how-to/agents.md, type-checked with ``mypy --strict`` and run
through the real ``openai`` and ``anthropic`` clients against scripted servers on 127.0.0.1."""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import subprocess
import sys
import threading
import unicodedata
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from prefect import flow

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.blocks.daytona import DaytonaBackend
from prefect_sandbox.blocks.e2b import E2BBackend, E2BCredentials
from prefect_sandbox.blocks.local import LocalKernelBackend
from prefect_sandbox.flows.tools import INTERPRETER_ERROR_CHARS, create_interpreter
from prefect_sandbox.sandbox.model_text import MATHMODELAGENT_IMAGE
from tests.conftest import ROOT, python_stdout

pytestmark = [pytest.mark.usefixtures("prefect_api"), pytest.mark.timeout(300)]

AGENTS_PAGE = ROOT / "docs" / "how-to" / "agents.md"

LIST = (
    "import os\nprint(sorted(f for f in os.listdir('.') if f.endswith(('.csv', '.ttf', '.txt'))))"
)
RICH = (
    "import sys\n"
    "from IPython.display import Markdown, display\n"
    "display(Markdown('**RMSE = 0.42**'))\n"
    "print('warned', file=sys.stderr, flush=True)\n"
    "6 * 7"
)
PLOT = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.savefig('plot.png')\nplt.close()"
FAIL = "def f():\n    raise ValueError('x' * 5000)\nf()"
# An exception class named with a clipboard write (OSC 52), a screen clear and a right-to-left
# override; a message with a bidi isolate; a bell, a tab and colours printed.
HOSTILE = (
    "Evil = type('Evil\\x1b]52;c;aGk=\\x07\\x1b[2JError\\u202e', (Exception,), {})\n"
    "print('\\x07bell\\tTab\\x1b[31mred')\n"
    "raise Evil('\\x1b[2Jboom\\u2066')"
)


@pytest.fixture(params=["local", "e2b", "daytona"])
def backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """The backends MathModelAgent's interpreters stand for (local Jupyter, E2B), and
    Daytona: the vendors' real SDKs against the session's emulators."""
    if request.param == "e2b":
        emulator = request.getfixturevalue("e2b_emulator")
        credentials = E2BCredentials(
            api_key=emulator.api_key, api_url=emulator.url, sandbox_url=emulator.url
        )
        return E2BBackend(credentials=credentials, lifetime_s=120)
    if request.param == "daytona":
        request.getfixturevalue("daytona_env")
        return DaytonaBackend()
    return LocalKernelBackend()


async def _coder_agent_shaped(interpreter: Any) -> dict[str, Any]:
    """What MathModelAgent's CoderAgent, workflow and writer prompts call on its interpreter,
    in their order, and every other public method of its ``BaseCodeInterpreter``."""
    interpreter.add_section("eda")
    ran = [await interpreter.execute_code(code) for code in (LIST, RICH, PLOT, FAIL)]
    images = [
        await interpreter.get_created_images("eda"),
        await interpreter.get_created_images("eda"),
    ]
    interpreter.add_content("eda", ran[1][0])
    try:
        interpreter.get_code_output("no such section")
    except KeyError as exc:
        missing = str(exc)
    found = {
        "ran": ran,
        "images": images,
        "section": interpreter.section_output["eda"],
        "code_output": interpreter.get_code_output("eda"),
        "missing": missing,
        "colourless": interpreter.delete_color_control_char("\x1b[31mred\x1b[0m"),
    }
    await interpreter.cleanup()
    await interpreter.cleanup()
    return found


async def test_a_mathmodelagent_coder_agent_runs_unchanged_with_its_text_and_ui_messages(
    backend: SandboxBackend, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.csv").write_text("a\n1\n2\n")
    (work / "font.ttf").write_bytes(b"\0\1\0\0")
    (work / "notes.txt").write_text("not uploaded")
    published: list[list[dict[str, Any]]] = []

    async def publish(items: list[dict[str, Any]]) -> None:
        published.append(items)

    @flow
    async def workflow() -> dict[str, Any]:
        interpreter = await create_interpreter(
            "local",
            task_id="task-1",
            work_dir=str(work),
            notebook_serializer=None,
            timeout=3000,
            backend=backend,
            storage=str(tmp_path / "out"),
            on_output=publish,
            text="mathmodelagent",
        )
        hostile = await interpreter.session.run_cell(HOSTILE)
        return {"hostile": hostile.text, **await _coder_agent_shaped(interpreter)}

    found = await workflow()
    listed, rich, plot, failed = found["ran"]
    assert listed == ("[stdout]\n['data.csv', 'font.ttf']\n", False, "")
    assert rich == (
        "[display_text]\n**RMSE = 0.42**\n[stderr]\nwarned\n\n[execute_result_text]\n42",
        False,
        "",
    )
    # E2B's server shows every image saved to a path as a display (LIMITS' quiet_image_save).
    marker = MATHMODELAGENT_IMAGE.format(mark="display_png")
    shown = f"[display_text]\n<PIL.Image.Image image mode=RGBA size=640x480>\n{marker}"
    assert plot == (shown if isinstance(backend, E2BBackend) else "", False, "")
    text, error_occurred, message = failed
    assert error_occurred is True and text == message
    assert message.startswith("Error: ValueError: xxxx")
    assert len(message) == INTERPRETER_ERROR_CHARS and "left out here" in message
    assert "\x1b" not in message
    assert found["images"] == [["plot.png"], []]
    assert found["section"] == {"content": [rich[0]], "images": ["plot.png"]}
    assert found["code_output"] == rich[0]
    assert "no such section" in found["missing"] and found["colourless"] == "red"
    assert (work / "plot.png").read_bytes().startswith(b"\x89PNG")
    # Its UI channel got each cell's outputs as OutputItem dicts, set-up cell first.
    assert len(published) == 5
    rich_items = published[2]
    assert {"res_type": "result", "format": "markdown", "msg": "**RMSE = 0.42**"} in rich_items
    assert {"res_type": "stderr", "msg": "warned\n"} in rich_items
    assert {"res_type": "result", "format": "text", "msg": "42"} in rich_items
    (error,) = [item for item in published[4] if item["res_type"] == "error"]
    assert error["name"] == "ValueError" and "raise ValueError" in error["traceback"]
    (run_folder,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["sandbox_killed_at"] is not None
    assert len(summary["stages"]) == 6
    # What a real kernel gave of hostile names and text reaches the model inert.
    hostile = found["hostile"]
    assert hostile.startswith(
        "```stdout\nbell    Tabred\n```\n```error\nEvilError<U+202E>: boom<U+2066>"
    )
    texts = [hostile, *(part for ran in found["ran"] for part in ran if isinstance(part, str))]
    assert [
        c for text in texts for c in text if c != "\n" and unicodedata.category(c) == "Cc"
    ] == []


class ScriptedModel(ThreadingHTTPServer):
    """An OpenAI- and Anthropic-compatible HTTP server on 127.0.0.1 that answers each
    ``POST`` with the next scripted reply for its path and keeps the requests' bodies."""

    def __init__(self, replies: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__(("127.0.0.1", 0), _ScriptedHandler)
        self.replies = replies
        self.requests: dict[str, list[dict[str, Any]]] = {path: [] for path in replies}
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _ScriptedHandler(BaseHTTPRequestHandler):
    server: ScriptedModel

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path = self.path.split("?")[0]
        if path not in self.server.replies or not self.server.replies[path]:
            self.send_error(404, f"no scripted reply left for {path}")
            return
        self.server.requests[path].append(body)
        reply = json.dumps(self.server.replies[path].pop(0)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:
        pass


# The model's cell: reads the input, shows a figure and a Markdown result, prints a line.
MODEL_CODE = (
    "import csv, io\n"
    "import matplotlib\n"
    "matplotlib.use('Agg')\n"
    "import matplotlib.pyplot as plt\n"
    "from IPython.display import Image, display\n"
    "rows = list(csv.DictReader(open('co2.csv')))\n"
    "plt.plot([1, 3, 2])\n"
    "buffer = io.BytesIO()\n"
    "plt.savefig(buffer, format='png')\n"
    "display(Image(data=buffer.getvalue()))\n"
    "from IPython.display import Markdown\n"
    "display(Markdown('**RMSE = 0.42**'))\n"
    # A screen clear and a right-to-left override, which the model must not get as such.
    "print('\\x1b[2J\\u202e', len(rows) > 100)"
)
_USAGE_OPENAI = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
_USAGE_ANTHROPIC = {"input_tokens": 1, "output_tokens": 1}


def _openai_reply(message: dict[str, Any], finish: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "scripted",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": _USAGE_OPENAI,
    }


def _anthropic_reply(content: list[dict[str, Any]], stop: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "scripted",
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": _USAGE_ANTHROPIC,
    }


SCRIPT = {
    "/v1/chat/completions": [
        _openai_reply(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "execute_python",
                            "arguments": json.dumps({"code": MODEL_CODE}),
                        },
                    }
                ],
            },
            "tool_calls",
        ),
        _openai_reply({"role": "assistant", "content": "It has over 100 rows."}, "stop"),
    ],
    "/v1/messages": [
        _anthropic_reply(
            [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "execute_python",
                    "input": {"code": MODEL_CODE},
                },
            ],
            "tool_use",
        ),
        _anthropic_reply([{"type": "text", "text": "It has over 100 rows."}], "end_turn"),
    ],
}


@pytest.fixture(scope="module")
def scripted_model() -> Iterator[ScriptedModel]:
    server = ScriptedModel(json.loads(json.dumps(SCRIPT)))
    server.thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _documented_loops() -> dict[str, str]:
    """The page's Python blocks that run a loop through each SDK's client, by SDK."""
    loops = {}
    for token in MarkdownIt().parse(AGENTS_PAGE.read_text()):
        if token.type == "fence" and token.info.startswith("python"):
            for sdk, client in (("openai", "AsyncOpenAI()"), ("anthropic", "AsyncAnthropic()")):
                if client in token.content:
                    loops[sdk] = token.content
    assert set(loops) == {"openai", "anthropic"}, f"{AGENTS_PAGE} lost a loop"
    return loops


# The loop these docs showed before the tool helpers were typed: mypy --strict refuses it.
UNTYPED_LOOP = """
from openai import AsyncOpenAI
from prefect_sandbox.flows import SandboxSession
from prefect_sandbox.flows.tools import dispatch_tool_call, openai_tool

async def loop(session: SandboxSession, question: str) -> str | None:
    client, messages = AsyncOpenAI(), [{"role": "user", "content": question}]
    while True:
        answer = await client.chat.completions.create(
            model="gpt-4.1", messages=messages, tools=[openai_tool()]
        )
        reply = answer.choices[0].message
        messages.append(reply)
        if not reply.tool_calls:
            return reply.content
        for call in reply.tool_calls:
            text = await dispatch_tool_call(session, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
"""


def _mypy_strict(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=250,
        check=False,
    )


_WITHOUT_THE_SDKS = """
import importlib.abc, json, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"openai", "anthropic"}:
            raise ImportError(f"{name} imported")

sys.meta_path.insert(0, Refuse())
from prefect_sandbox.flows import tools

outcome = "Error: the arguments are not valid JSON"
print(json.dumps([
    tools.openai_tool()["function"]["name"],
    tools.anthropic_tool()["name"],
    tools.anthropic_tool_result("toolu_1", outcome)["is_error"],
    tools.openai_tool_messages({"call_1": outcome})[0]["role"],
]))
"""


def test_the_tool_helpers_need_neither_sdk_at_run_time() -> None:
    printed = python_stdout("-c", _WITHOUT_THE_SDKS)
    assert json.loads(printed) == ["execute_python", "execute_python", True, "tool"]


def test_both_documented_loops_type_check_under_mypy_strict(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for sdk, code in _documented_loops().items():
        (tmp_path / "docs" / f"{sdk}_loop.py").write_text(code)
    done = _mypy_strict(tmp_path / "docs")
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "untyped_loop.py").write_text(UNTYPED_LOOP)
    refused = _mypy_strict(tmp_path / "old").stdout
    assert 'Argument 1 to "append" of "list"' in refused
    assert 'has no attribute "function"' in refused


async def test_both_documented_loops_run_through_the_real_sdk_clients_and_send_the_figure(
    scripted_model: ScriptedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "examples" / "co2").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "co2" / "co2.csv", tmp_path / "examples" / "co2")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{scripted_model.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-scripted")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", scripted_model.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-scripted")
    monkeypatch.setenv("PREFECT_SANDBOX_STORAGE", str(tmp_path / "out"))
    answers = {}
    for sdk, code in _documented_loops().items():
        path = tmp_path / f"{sdk}_loop.py"
        path.write_text(code)
        spec = importlib.util.spec_from_file_location(f"{sdk}_loop", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        answers[sdk] = await module.analyst("How many rows has co2.csv?", model="scripted")
    assert answers == {"openai": "It has over 100 rows.", "anthropic": "It has over 100 rows."}

    first, second = scripted_model.requests["/v1/chat/completions"]
    assert first["tools"][0]["function"]["name"] == "execute_python"
    assistant, tool, figures = second["messages"][1:]
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": (
            "[figure inline-figures/cell-000-1.png]\n```display\n**RMSE = 0.42**\n```\n"
            "```stdout\n<U+202E> True\n```"
        ),
    }
    assert [part["type"] for part in figures["content"]] == ["text", "image_url"]
    assert figures["content"][1]["image_url"]["url"].startswith("data:image/png;base64,iVBOR")

    first, second = scripted_model.requests["/v1/messages"]
    assert first["tools"][0]["input_schema"]["required"] == ["code"]
    assistant, results = second["messages"][1:]
    assert [block["type"] for block in assistant["content"]] == ["text", "tool_use"]
    (result,) = results["content"]
    assert (result["type"], result["tool_use_id"], result["is_error"]) == (
        "tool_result",
        "toolu_1",
        False,
    )
    text, image = result["content"]
    assert text == {"type": "text", "text": tool["content"]}
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    assert base64.b64decode(image["source"]["data"]).startswith(b"\x89PNG")
