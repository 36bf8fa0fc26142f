"""Turning Jupyter iopub messages into a cell's nbformat outputs. Pure logic, no I/O."""

from __future__ import annotations

from typing import Any

from nbformat.v4 import output_from_msg

__all__ = ["OUTPUT_MSG_TYPES", "OutputCollector", "error_output"]

OUTPUT_MSG_TYPES = frozenset({"stream", "display_data", "execute_result", "error"})


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


class OutputCollector:
    """Collects one cell's outputs from its iopub messages, as Jupyter front ends show them.

    Consecutive ``stream`` outputs of the same name are coalesced; ``clear_output`` (with
    ``wait=True`` deferred to the next output) and ``update_display_data`` are honoured.
    """

    def __init__(self) -> None:
        self.outputs: list[dict[str, Any]] = []
        self._clear_before_next = False
        self._display_indexes: dict[str, list[int]] = {}

    def add(self, msg_type: str, content: dict[str, Any]) -> dict[str, Any] | None:
        """Take one iopub message's type and content.

        Args:
            msg_type: the Jupyter message type (``stream``, ``display_data``, ...).
            content: the message's content.

        Returns:
            The new nbformat output, or None when the message adds no output.
        """
        if msg_type == "clear_output":
            if content.get("wait"):
                self._clear_before_next = True
            else:
                self._clear()
            return None
        if msg_type == "update_display_data":
            self._update_display(content)
            return None
        if msg_type not in OUTPUT_MSG_TYPES:
            return None
        if self._clear_before_next:
            self._clear()
        output: dict[str, Any] = dict(
            output_from_msg({"header": {"msg_type": msg_type}, "content": content})
        )
        display_id = (content.get("transient") or {}).get("display_id")
        if display_id:
            self._display_indexes.setdefault(display_id, []).append(len(self.outputs))
        last = self.outputs[-1] if self.outputs else None
        if (
            msg_type == "stream"
            and last is not None
            and last["output_type"] == "stream"
            and last["name"] == output["name"]
        ):
            last["text"] += output["text"]
        else:
            self.outputs.append(output)
        return output

    def _clear(self) -> None:
        self.outputs.clear()
        self._display_indexes.clear()
        self._clear_before_next = False

    def _update_display(self, content: dict[str, Any]) -> None:
        display_id = (content.get("transient") or {}).get("display_id")
        for index in self._display_indexes.get(display_id or "", []):
            self.outputs[index]["data"] = content.get("data", {})
            self.outputs[index]["metadata"] = content.get("metadata", {})

    def has_error(self) -> bool:
        """Whether an ``error`` output was collected."""
        return any(output["output_type"] == "error" for output in self.outputs)
