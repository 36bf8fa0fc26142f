"""E2B kernel hooks: what E2B's code interpreter would lose of a cell, carried in display data.

The server passes on only a display's data, drops ``update_display_data``, ``clear_output``, the
reply's payloads and status, and comms. These hooks put display ids, updates, ``clear_output``,
metadata, the exact ``text/plain``, traceback lines, an ``exit()``, the reply's status and
widgets' comm state in a bundle under the key given (E2B's ``DISPLAY_CONTROL_MIME``), which the
host turns back into Jupyter messages. A kernel hooked already is not hooked twice (hooks over
hooks would mark displays twice). Run by `run_code` (``main``, with ``{"key": mime}``), from the
kernel's startup file and the first priming cell; the user's namespace is left as it was.
Manual: docs/development.md.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

from IPython import get_ipython


class _NoThreadParents(dict[Any, Any]):
    """A thread's output is tagged with the running cell, as ipykernel 7 does (the template's
    6.x tags the finished cell the server forgot)."""

    def __setitem__(self, ident: Any, parent: Any) -> None:
        pass


def main(args_json: str) -> None:
    """Hook the kernel's display publisher, display hook, traceback, exit and session."""
    key: str = json.loads(args_json)["key"]
    shell: Any = get_ipython()
    if getattr(shell, "_prefect_sandbox_hooked", False):
        return  # from the startup file already: hooks over hooks would mark displays twice
    shell._prefect_sandbox_hooked = True
    publish, session = shell.display_pub.publish, shell.kernel.session
    for stream in (sys.stdout, sys.stderr):
        if isinstance(getattr(stream, "_thread_to_parent_header", None), dict):
            stream._thread_to_parent_header = _NoThreadParents()  # type: ignore[union-attr]
    _hook_displays(shell, key, publish)
    _hook_reply_and_comms(shell, session, key, publish)


def _hook_displays(shell: Any, key: str, publish: Any) -> None:
    """Displays, results, ``clear_output``, tracebacks and ``exit()`` carry what E2B drops."""
    publisher, displayhook = shell.display_pub, shell.displayhook
    write_format_data = displayhook.write_format_data
    showtraceback = shell._showtraceback
    ask_exit = shell.ask_exit

    def controlled(data: dict[str, Any], metadata: Any, **control: Any) -> dict[str, Any]:
        if "text/plain" in data:
            control["text/plain"] = data["text/plain"]
        control["metadata"] = metadata or {}
        return dict(data, **{key: control})

    def hooked_publish(
        data: dict[str, Any],
        metadata: Any = None,
        *args: Any,
        transient: Any = None,
        update: Any = False,
        **kwargs: Any,
    ) -> Any:
        display_id = (transient or {}).get("display_id")
        data = controlled(data, metadata, display_id=display_id, update=bool(update))
        return publish(data, metadata, *args, transient=transient, **kwargs)

    def hooked_clear_output(wait: Any = False) -> None:
        publish({key: {"clear": True, "wait": bool(wait)}})

    def hooked_write_format_data(format_dict: dict[str, Any], md_dict: Any = None) -> Any:
        return write_format_data(controlled(format_dict, md_dict), md_dict)

    def hooked_showtraceback(etype: Any, evalue: Any, stb: Any) -> Any:
        ename = getattr(etype, "__name__", str(etype))
        publish({key: {"traceback": list(stb), "ename": ename, "evalue": str(evalue)}})
        return showtraceback(etype, evalue, stb)

    def hooked_ask_exit() -> Any:
        if not shell.keepkernel_on_exit:
            publish({key: {"exit": True}})
        return ask_exit()

    publisher.publish = hooked_publish
    publisher.clear_output = hooked_clear_output
    displayhook.write_format_data = hooked_write_format_data
    shell._showtraceback = hooked_showtraceback
    shell.ask_exit = hooked_ask_exit


def _hook_reply_and_comms(shell: Any, session: Any, key: str, publish: Any) -> None:
    """Each cell's reply status (by ipykernel's rule) and widgets' comm state are published."""

    def outcome(result: Any) -> None:
        error = result.error_before_exec or result.error_in_exec
        if error is None and not getattr(shell, "_last_traceback_during_displayhook", False):
            publish({key: {"outcome": "ok"}})
        else:
            shown = {"ename": type(error).__name__, "evalue": str(error)}
            publish({key: {"outcome": "error", **shown}})

    send = session.send

    def hooked_send(
        stream: Any,
        msg_or_type: Any,
        content: Any = None,
        *args: Any,
        buffers: Any = None,
        **kwargs: Any,
    ) -> Any:
        msg_type = msg_or_type if isinstance(msg_or_type, str) else None
        if msg_type in ("comm_open", "comm_msg") and "state" in (content or {}).get("data", {}):
            data = content["data"]
            comm = {
                "comm": msg_type,
                "comm_id": content.get("comm_id"),
                "state": data["state"],
                "buffer_paths": data.get("buffer_paths") or [],
                "buffers": [base64.b64encode(bytes(b)).decode() for b in buffers or []],
            }
            publish({key: comm})
        return send(stream, msg_or_type, content, *args, buffers=buffers, **kwargs)

    shell.events.register("post_run_cell", outcome)
    session.send = hooked_send
