"""Turning Jupyter iopub messages into a cell's nbformat outputs. Pure logic, no I/O.

Front ends show a cell's output as a terminal would; so do the outputs we store: consecutive
stream text is coalesced per stream, ``\\r`` overwrites the current line, ``clear_output`` and
``update_display_data`` are honoured. Stored outputs are capped per cell: all are kept while
they fit; past the cap the start and end are kept, with a marker giving the original size and
naming what was dropped, so a cell that prints 100 MB keeps client memory bounded and its last
line. Error outputs are never dropped. Text is made valid UTF-8 (lone surrogates replaced), so
logging, JSON and nbformat never choke on it. Manual: docs/backends/index.md.
"""

from __future__ import annotations

import base64
import re
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = [
    "COMM_MSG_TYPES",
    "DEFAULT_MAX_OUTPUT_CHARS",
    "ERROR_TEXT_CHARS",
    "OUTPUT_MSG_TYPES",
    "TRACEBACK_CHARS",
    "CellOutputs",
    "OutputCollector",
    "StreamLogThrottle",
    "cap_text",
    "cap_traceback",
    "collapse_carriage_returns",
    "error_content",
    "error_output",
    "merged_streams",
    "output_from_content",
    "strip_ansi",
    "valid_text",
]

OUTPUT_MSG_TYPES = frozenset({"stream", "display_data", "execute_result", "error"})
_DISPLAY_MSG_TYPES = frozenset({"display_data", "execute_result", "update_display_data"})
COMM_MSG_TYPES = frozenset({"comm_open", "comm_msg"})
"""The comm messages that can carry a widget model's state (``data.state``)."""
DEFAULT_MAX_OUTPUT_CHARS = 1 << 20
ERROR_TEXT_CHARS = 4096
"""Characters an exception's message keeps wherever it is copied (errors, logs, summaries)."""
TRACEBACK_CHARS = 8192
"""Characters a traceback keeps wherever it is copied, its lines joined."""

# Held outputs are handed over at the latest once this many, or this much text, are waiting.
_HAND_OVER_OUTPUTS = 1000
_HAND_OVER_CHARS = 1 << 20

# ECMA-48 as terminals read it: control strings (OSC, DCS, SOS, PM, APC: a title, a clipboard
# write) up to their terminator, or the line's end when there is none; CSI sequences; other
# escape sequences; each in its 7-bit (ESC-led) and 8-bit (C1) form; then any other control
# character but tab, newline and carriage return. The lookahead lets `re` skip plain text
# fast (about 3x), since every match starts with a control character.
_TERMINAL_CONTROL = re.compile(
    r"(?=[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f])(?:"
    r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x9c|\x1b\\)?"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|\x1b[ -/]*[0-~]?"
    r"|[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f])"
)


def strip_ansi(text: str) -> str:
    """Remove what a terminal would act on rather than show from ``text``: ANSI escape
    sequences (colours, cursor moves, a screen clear or reset, a title or clipboard write), in
    their ESC-led and 8-bit C1 forms, and every other control character but tab, newline and
    carriage return. For every text that reaches a terminal or a log."""
    return _TERMINAL_CONTROL.sub("", text)


def cap_text(text: str, max_chars: int = ERROR_TEXT_CHARS) -> str:
    """``text`` if it has at most ``max_chars`` characters; else its start and end, with a
    marker between them saying how many characters were left out, ``max_chars`` in all."""
    if len(text) <= max_chars:
        return text
    marker = f" ... [{len(text)} characters, {len(text) - max_chars} left out here] ... "
    keep = max(max_chars - len(marker), 0)
    head = keep - keep // 2
    return f"{text[:head]}{marker}{text[len(text) - keep // 2 :]}"


def cap_traceback(lines: list[str], max_chars: int = TRACEBACK_CHARS) -> list[str]:
    """Traceback lines as people read them: ANSI codes removed and, past ``max_chars`` joined,
    the start (where the cell's failing line is named) and end kept (see `cap_text`)."""
    plain = [strip_ansi(line) for line in lines]
    joined = "\n".join(plain)
    if len(joined) <= max_chars:
        return plain
    return cap_text(joined, max_chars).split("\n")


def valid_text(text: str) -> str:
    """Replace lone surrogates (undecodable bytes a kernel passed on) with U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return text


def collapse_carriage_returns(text: str) -> str:
    """Apply ``\\r`` as a terminal does: later text overwrites the start of the line.

    ``"50%\\r100%\\n"`` becomes ``"100%\\n"``; ``"abc\\rX"`` becomes ``"Xbc"``; ``\\r\\n`` is a
    newline. An unfinished last line keeps where the cursor is: ``"abc\\rX"`` at the very end
    becomes ``"Xbc\\rX"``, so text appended later (the next message) still overwrites ``bc``.
    """
    if "\r" not in text:
        return text
    lines = text.replace("\r\n", "\n").split("\n")
    for index, line in enumerate(lines):
        if "\r" in line:
            shown = ""
            for segment in line.split("\r"):
                shown = segment + shown[len(segment) :]
            lines[index] = shown
    unfinished = text.rsplit("\n", 1)[-1]
    if "\r" in unfinished:
        cursor = unfinished.rsplit("\r", 1)[1]
        if len(cursor) < len(lines[-1]):
            lines[-1] = f"{lines[-1]}\r{cursor}"
    return "\n".join(lines)


class StreamLogThrottle:
    """What of one stream's text to log, and when: complete lines at once; the unfinished last
    line (a progress bar that redraws itself with ``\r``, as tqdm does) when first seen, then
    at most once per ``interval_s`` while it changes, and its last state when it ends or the
    cell does (`flush`).

    A cell printing 200 ``\r`` updates of a bar within ``interval_s`` then gives two records,
    the bar's first and last states, instead of one per kernel flush (about 5 a second). Pure:
    the caller passes the time. Text is ANSI-stripped and each line shown as a terminal ends up
    showing it.

    Args:
        interval_s: least seconds between two records of one unfinished line.
        max_chars: an unfinished line longer than this is logged at once, as if it ended.
    """

    def __init__(self, interval_s: float, max_chars: int) -> None:
        self._interval_s = interval_s
        self._max_chars = max_chars
        self._pending = ""
        self._logged = ""
        self._logged_at: float | None = None

    def feed(self, text: str, now: float) -> str | None:
        """Take a stream message's text, received at ``now`` (monotonic seconds).

        Returns:
            The text to log now (lines joined by ``\n``, no trailing newline), or None.
        """
        pending = collapse_carriage_returns(self._pending + strip_ansi(text))
        complete, newline, unfinished = pending.rpartition("\n")
        out = []
        if newline:
            out.append(complete)
            self._logged, self._logged_at = "", None
        self._pending = unfinished
        shown = _shown(unfinished)
        if len(shown) > self._max_chars:
            out.append(shown)
            self._pending, self._logged, self._logged_at = "", "", None
        elif (
            shown
            and shown != self._logged
            and (self._logged_at is None or now - self._logged_at >= self._interval_s)
        ):
            out.append(shown)
            self._logged, self._logged_at = shown, now
        return "\n".join(out) if out else None

    def flush(self) -> str | None:
        """The unfinished line's last state, when it was not logged yet (the cell ended)."""
        shown = _shown(self._pending)
        logged = self._logged
        self._pending, self._logged, self._logged_at = "", "", None
        return shown if shown and shown != logged else None


def _shown(line: str) -> str:
    """What a terminal shows of a line `collapse_carriage_returns` left unfinished."""
    return line.split("\r", 1)[0]


def output_from_content(msg_type: str, content: dict[str, Any]) -> dict[str, Any]:
    """The nbformat v4 output for an iopub output message's content.

    nbformat's own ``output_from_msg`` validates each output against the JSON schema, which
    costs about a second for a 100 MB stream; the notebook is validated once when written.

    Args:
        msg_type: ``stream``, ``display_data``, ``execute_result`` or ``error``.
        content: the message's content.

    Returns:
        The output dict.
    """
    if msg_type == "stream":
        return {"output_type": "stream", "name": content["name"], "text": content["text"]}
    if msg_type == "error":
        return error_output(content["ename"], content["evalue"], list(content["traceback"]))
    output: dict[str, Any] = {
        "output_type": msg_type,
        "data": dict(content.get("data", {})),
        "metadata": dict(content.get("metadata", {})),
    }
    if msg_type == "execute_result":
        output["execution_count"] = content.get("execution_count")
    return output


def error_output(ename: str, evalue: str, traceback: list[str]) -> dict[str, Any]:
    """Build an nbformat ``error`` output.

    Args:
        ename: exception class name.
        evalue: exception message.
        traceback: traceback lines.

    Returns:
        The output dict.
    """
    return {"output_type": "error", "ename": ename, "evalue": evalue, "traceback": traceback}


def error_content(ename: str, evalue: str, traceback: str) -> dict[str, Any]:
    """The iopub ``error`` content of an exception whose traceback came as one string.

    E2B's code interpreter and Daytona's daemon join the kernel's traceback lines; this splits
    them again, for `OutputCollector.add` (``add("error", error_content(...))``).

    Args:
        ename: the exception's class name.
        evalue: its message.
        traceback: the traceback as one string.

    Returns:
        ``{"ename", "evalue", "traceback"}``, the traceback as a list of lines.
    """
    return {"ename": ename, "evalue": evalue, "traceback": traceback.splitlines()}


def _size(output: dict[str, Any]) -> int:
    """Stored size in characters: of text, or of each rich value as a string (base64 for
    images)."""
    if output["output_type"] == "stream":
        return len(output["text"])
    if output["output_type"] == "error":
        return len(output["evalue"]) + sum(len(line) for line in output["traceback"])
    return sum(len(str(value)) for value in output.get("data", {}).values())


def _sanitised(output: dict[str, Any]) -> dict[str, Any]:
    if output["output_type"] == "stream":
        output["text"] = valid_text(output["text"])
    elif output["output_type"] == "error":
        output["evalue"] = valid_text(output["evalue"])
        output["traceback"] = [valid_text(line) for line in output["traceback"]]
    else:
        data = output.get("data", {})
        for mime, value in data.items():
            if isinstance(value, str):
                data[mime] = valid_text(value)
    return output


class OutputCollector:
    """Collects one cell's outputs from its iopub messages, as Jupyter front ends show them.

    Args:
        max_output_chars: cap on the stored outputs of the cell, in characters (of text, and
            of rich values as strings).
            Outputs are all kept while they fit under it. Past it, the start (up to half the
            cap) and the end (the rest of it) are kept, with a marker between them giving the
            original size and naming what was dropped: whole outputs by type and MIME types,
            stream text in characters. ``error`` outputs are never dropped nor counted against
            the cap. None for no cap.
    """

    def __init__(self, max_output_chars: int | None = DEFAULT_MAX_OUTPUT_CHARS) -> None:
        if max_output_chars is not None and max_output_chars <= 0:
            raise ValueError(f"max_output_chars must be positive or None, not {max_output_chars}")
        self._max = max_output_chars
        self._half = None if max_output_chars is None else max_output_chars // 2
        self._head: list[dict[str, Any]] = []
        self._tail: deque[dict[str, Any]] = deque()
        self._head_chars = self._tail_chars = 0
        self.total_chars = 0
        self.omitted_chars = 0
        self._omitted_outputs: dict[str, int] = {}
        self._omitted_stream_chars: dict[str, int] = {}
        self._clear_before_next = False
        self._displays: dict[str, list[dict[str, Any]]] = {}
        self.display_updates: dict[str, dict[str, Any]] = {}
        """The last content (``data`` and ``metadata``) the cell sent for each display id, by
        an update or a new display with that id: outputs of earlier cells shown with the id
        show it too, as in nbclient."""
        self.widget_state: dict[str, dict[str, Any]] = {}
        """Each comm id to the widget state the cell sent for it (`add_comm`)."""

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """The outputs to store: head, a truncation marker if anything was dropped, tail."""
        return self._assembled()[0]

    @property
    def display_ids(self) -> dict[str, list[int]]:
        """Each display id to the indexes in `outputs` of the outputs shown with it."""
        return self._assembled()[1]

    def _assembled(self) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
        merged: list[dict[str, Any]] = []
        index_of: dict[int, int] = {}
        for output in [*self._head, *self._omission_marker(), *self._tail]:
            copied = dict(output)
            _append_coalescing(merged, copied)
            if merged[-1] is copied:
                index_of[id(output)] = len(merged) - 1
        shown = {
            display_id: [index_of[id(output)] for output in outputs if id(output) in index_of]
            for display_id, outputs in self._displays.items()
        }
        return merged, {display_id: indexes for display_id, indexes in shown.items() if indexes}

    def _omission_marker(self) -> list[dict[str, Any]]:
        """The marker output naming what the cap dropped; none when nothing was."""
        if not self.omitted_chars:
            return []
        name = "stdout"
        if self._tail and self._tail[0]["output_type"] == "stream":
            name = self._tail[0]["name"]
        dropped = [f"{count} {kind}" for kind, count in self._omitted_outputs.items()]
        dropped += [
            f"{count} characters of {stream}"
            for stream, count in self._omitted_stream_chars.items()
        ]
        text = (
            f"\n... [output truncated: {self.total_chars} characters in all, "
            f"{self.omitted_chars} characters omitted] [omitted: {', '.join(dropped)}] ...\n"
        )
        return [{"output_type": "stream", "name": name, "text": text}]

    def add(self, msg_type: str, content: dict[str, Any]) -> dict[str, Any] | None:
        """Take one iopub message's type and content.

        Args:
            msg_type: the Jupyter message type (``stream``, ``display_data``, ...).
            content: the message's content.

        Returns:
            The new nbformat output as received (before capping), or None when the message
            adds no output.
        """
        if msg_type == "clear_output":
            if content.get("wait"):
                self._clear_before_next = True
            else:
                self._clear()
            return None
        display_id = (content.get("transient") or {}).get("display_id")
        if display_id and msg_type in _DISPLAY_MSG_TYPES:
            self._update_display(display_id, content)
        if msg_type not in OUTPUT_MSG_TYPES:
            return None
        if self._clear_before_next:
            self._clear()
        output = _sanitised(output_from_content(msg_type, content))
        size = _size(output)
        self.total_chars += size
        kept = dict(output)  # later output may still be merged into it; the caller's stays
        if display_id:
            self._displays.setdefault(display_id, []).append(kept)
        if output["output_type"] == "error":
            (self._tail if self._tail else self._head).append(kept)
        elif self._half is None or (not self._tail and self._head_chars + size <= self._half):
            self._head_chars += _append_coalescing(self._head, kept)
        elif not self._tail and output["output_type"] == "stream" and "\r" in output["text"]:
            self._keep_overwriting_text(kept)
        else:
            self._keep_in_tail(kept)
        return output

    def add_comm(self, content: dict[str, Any], buffers: list[Any]) -> None:
        """Take a ``comm_open`` or ``comm_msg``: the model state it carries (an ipywidgets
        model's, ``data.state``) is merged into `widget_state`, as nbclient's
        ``store_widget_state`` keeps it; other comm messages are ignored.

        Args:
            content: the message's content (``comm_id``, ``data``).
            buffers: its binary buffers (bytes, or base64 text), one per ``data.buffer_paths``
                entry.
        """
        data = content.get("data") or {}
        comm_id = content.get("comm_id")
        if not isinstance(comm_id, str) or not isinstance(data.get("state"), dict):
            return
        kept = self.widget_state.setdefault(comm_id, {"state": {}, "buffers": []})
        kept["state"].update(data["state"])
        paths = data.get("buffer_paths") or []
        by_path = {tuple(buffer["path"]): buffer for buffer in kept["buffers"]}
        for path, buffer in zip(paths, buffers, strict=False):
            text = buffer if isinstance(buffer, str) else base64.b64encode(bytes(buffer)).decode()
            by_path[tuple(path)] = {"path": list(path), "encoding": "base64", "data": text}
        kept["buffers"] = list(by_path.values())

    def omit_unread(self, msg_type: str, size_bytes: int) -> None:
        """Count a message its reader left undecoded as too large to keep (it names it in the
        omission marker), as if its output had been dropped by the cap.

        Args:
            msg_type: the Jupyter message type; types that show no output are ignored.
            size_bytes: the message's size as received, in bytes.
        """
        if msg_type not in OUTPUT_MSG_TYPES | _DISPLAY_MSG_TYPES:
            return
        kind = f"{msg_type} (too large to read)"
        self._omitted_outputs[kind] = self._omitted_outputs.get(kind, 0) + 1
        self.total_chars += size_bytes
        self.omitted_chars += size_bytes

    def _keep_overwriting_text(self, output: dict[str, Any]) -> None:
        """Stream text with ``\\r``: what counts is its size once overwritten, so a progress
        bar's thousands of updates stay one short line; only what is left past the head's half
        goes on to the tail."""
        assert self._half is not None
        self._head_chars += _append_coalescing(self._head, output)
        excess = self._head_chars - self._half
        if excess <= 0:
            return
        last = self._head[-1]
        keep = len(last["text"]) - excess
        spill = dict(last, text=last["text"][keep:])
        last["text"] = last["text"][:keep]
        self._head_chars = self._half
        self._keep_in_tail(spill)

    def _keep_in_tail(self, output: dict[str, Any]) -> None:
        """Keep ``output`` at the end; once the head is full, the tail gets the rest of the cap
        and loses its oldest outputs (or the start of its oldest text) past that."""
        assert self._half is not None and self._max is not None
        if output["output_type"] == "stream":
            text, start = output["text"], 0
            if not self._tail:
                # Fill the head up to its half with the start of the text, cut after a newline
                # where there is one, so that a later \r still overwrites the right line.
                start = max(self._half - self._head_chars, 0)
                start = text.rfind("\n", 0, start) + 1 or start
                if start:
                    self._head_chars += _append_coalescing(
                        self._head, dict(output, text=text[:start])
                    )
            # Copy no more of a huge text than the tail can keep.
            room = self._max - self._head_chars
            if len(text) - start > room:
                self._omit_text(output["name"], len(text) - start - room)
                start = len(text) - room
            output = dict(output, text=text[start:])
        self._tail_chars += _append_coalescing(self._tail, output)
        self._trim_tail()

    def _trim_tail(self) -> None:
        assert self._max is not None
        room = self._max - self._head_chars
        while self._tail_chars > room:
            index = next(
                (i for i, kept in enumerate(self._tail) if kept["output_type"] != "error"), None
            )
            if index is None:
                return
            oldest = self._tail[index]
            excess = self._tail_chars - room
            if oldest["output_type"] == "stream" and len(oldest["text"]) > excess:
                oldest["text"] = oldest["text"][excess:]
                self._tail_chars -= excess
                self._omit_text(oldest["name"], excess)
                continue
            del self._tail[index]
            size = _size(oldest)
            self._tail_chars -= size
            if oldest["output_type"] == "stream":
                self._omit_text(oldest["name"], size)
            else:
                kind = f"{oldest['output_type']} ({', '.join(oldest.get('data', {}))})"
                self._omitted_outputs[kind] = self._omitted_outputs.get(kind, 0) + 1
                self.omitted_chars += size

    def _omit_text(self, stream: str, chars: int) -> None:
        self._omitted_stream_chars[stream] = self._omitted_stream_chars.get(stream, 0) + chars
        self.omitted_chars += chars

    def _clear(self) -> None:
        self._head.clear()
        self._tail.clear()
        self._head_chars = self._tail_chars = self.total_chars = self.omitted_chars = 0
        self._omitted_outputs.clear()
        self._omitted_stream_chars.clear()
        self._displays.clear()
        self._clear_before_next = False

    def _update_display(self, display_id: str, content: dict[str, Any]) -> None:
        """Show new content in the outputs shown with ``display_id`` so far (nbclient's rule:
        an update, or a new display with the same id, rewrites them all)."""
        shown = _sanitised(output_from_content("display_data", content))
        update = {"data": shown["data"], "metadata": shown["metadata"]}
        self.display_updates[display_id] = update
        for output in self._displays.get(display_id, []):
            output["data"] = dict(update["data"])
            output["metadata"] = dict(update["metadata"])

    def has_error(self) -> bool:
        """Whether an ``error`` output was collected."""
        return any(o["output_type"] == "error" for o in [*self._head, *self._tail])

    def append_error(self, ename: str, evalue: str, traceback: list[str]) -> None:
        """Add an ``error`` output the kernel did not send (a timeout, a reply-only error)."""
        output = error_output(ename, evalue, traceback)
        target = self._tail if self._tail else self._head
        target.append(_sanitised(output))


class CellOutputs:
    """One cell's outputs as they arrive: kept by an `OutputCollector` and handed, as received
    (before coalescing and capping), to the cell's ``on_output`` callback.

    A backend that reads messages faster than a slow callback takes them (one log record per
    output) may hold outputs back and hand them over in batches, back-to-back stream text
    merged, so it never falls behind its kernel.

    Args:
        max_output_chars: the collector's cap (see `OutputCollector`).
        on_output: called with each output; None for no callback.
    """

    def __init__(
        self,
        max_output_chars: int | None,
        on_output: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.collector = OutputCollector(max_output_chars)
        self._on_output = on_output
        self._held: list[dict[str, Any]] = []
        self._held_chars = 0

    @property
    def held(self) -> bool:
        """Whether outputs are waiting to be handed over (see `flush`)."""
        return bool(self._held)

    def add(self, msg_type: str, content: dict[str, Any], *, hold: bool = False) -> None:
        """Take one iopub message's type and content (see `OutputCollector.add`).

        Args:
            msg_type: the Jupyter message type.
            content: the message's content.
            hold: keep the output back for a later `flush`, unless too much is held already.
        """
        output = self.collector.add(msg_type, content)
        if output is None or self._on_output is None:
            return
        self._held.append(output)
        # Rich outputs count too: a cell's raw 50 MiB displays are not held back by the dozen.
        self._held_chars += _size(output)
        if (
            not hold
            or self._held_chars >= _HAND_OVER_CHARS
            or len(self._held) >= _HAND_OVER_OUTPUTS
        ):
            self.flush()

    def add_comm(self, content: dict[str, Any], buffers: list[Any]) -> None:
        """Take a comm message's widget state (see `OutputCollector.add_comm`)."""
        self.collector.add_comm(content, buffers)

    def omit_unread(self, msg_type: str, size_bytes: int) -> None:
        """Count a message left undecoded as too large (see `OutputCollector.omit_unread`)."""
        self.collector.omit_unread(msg_type, size_bytes)

    def flush(self) -> None:
        """Hand the held outputs to ``on_output``, back-to-back stream text merged."""
        if not self._held:
            return
        assert self._on_output is not None
        held, self._held, self._held_chars = self._held, [], 0
        for output in merged_streams(held):
            self._on_output(output)


def merged_streams(outputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``outputs`` with back-to-back text of one stream joined into one output, as sent: unlike
    the stored outputs, no ``\\r`` is applied. The dicts given are not changed."""
    merged: list[tuple[dict[str, Any], list[str]]] = []
    for output in outputs:
        if output["output_type"] == "stream" and merged:
            last, texts = merged[-1]
            if last["output_type"] == "stream" and last["name"] == output["name"]:
                texts.append(output["text"])
                continue
        merged.append((output, [output["text"]] if output["output_type"] == "stream" else []))
    return [dict(output, text="".join(texts)) if texts else output for output, texts in merged]


def _append_coalescing(
    outputs: list[dict[str, Any]] | deque[dict[str, Any]], new: dict[str, Any]
) -> int:
    """Append ``new``, merging it into the last output when both are the same stream.

    Returns:
        How much the stored size grew (may be negative: ``\\r`` overwrites the last line).
    """
    if outputs and new["output_type"] == "stream":
        last = outputs[-1]
        if last["output_type"] == "stream" and last["name"] == new["name"]:
            before = len(last["text"])
            cut = last["text"].rfind("\n") + 1
            last["text"] = last["text"][:cut] + collapse_carriage_returns(
                last["text"][cut:] + new["text"]
            )
            return len(last["text"]) - before
    if new["output_type"] == "stream":
        new["text"] = collapse_carriage_returns(new["text"])
    outputs.append(new)
    return _size(new)
