"""E2B's priming cell: the first execution on each connection to a kernel (creation, restart).

E2B's server puts ``import os; os.environ[...] = ...`` lines (from envd's ``/envs``) before
that execution; this drops the ``os`` they imported into the user's namespace (the variables
they set stay). At creation it writes the display hooks' code into the kernel's IPython startup
folder (for later restarts) and runs it now, printing a failure to stderr after the prefix
given; after a restart it goes back to the working directory (found by its path from Jupyter's
root where it is not found as is: an emulator's folders are elsewhere). Run by `run_code`
(``main``), followed by kernel_side/forget_cell.py. Manual: docs/development.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

from IPython import get_ipython


def main(args_json: str) -> None:
    """Prime the kernel.

    Args:
        args_json: ``{"hooks": {"file": name, "code": text, "failed": prefix}}`` at creation;
            ``{"workdir": path, "from_root": path}`` after a restart.
    """
    args = json.loads(args_json)
    shell: Any = get_ipython()
    if getattr(shell.user_ns.get("os"), "__name__", None) == "os":
        del shell.user_ns["os"]
    if "hooks" in args:
        _install_hooks(shell, **args["hooks"])
    if "workdir" in args:
        _back_to_workdir(args["workdir"], args["from_root"])


def _install_hooks(shell: Any, file: str, code: str, failed: str) -> None:
    try:
        path = os.path.join(shell.profile_dir.startup_dir, file)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as startup:
            startup.write(code)
        exec(code, {})
    except Exception as error:
        print(failed, repr(error), file=sys.stderr)


def _back_to_workdir(workdir: str, from_root: str) -> None:
    with contextlib.suppress(OSError):
        os.chdir(workdir if os.path.isdir(workdir) else from_root)
