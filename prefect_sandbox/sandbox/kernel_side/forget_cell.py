"""Kernel code that makes the cell running it leave no trace (E2B's priming cells and probes).

Its input leaves the history (memory and database), and the execution counters go back one,
so the next cell gets this one's number. Relative steps, since IPython 8 counts a cell up as it
ends and IPython 9 as it starts. Run by `run_code` (``main``) as the cell's last statement.
Manual: docs/development.md.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from IPython import get_ipython


def main() -> None:
    """Forget the running cell: its history entry, its ``_iN`` and its execution count."""
    shell: Any = get_ipython()
    history = shell.history_manager
    line = len(history.input_hist_parsed) - 1  # In[n] is cell n's input: this cell's is last
    # Under the lock the saving thread writes under: the line is in its cache or written.
    with history.db_input_cache_lock:
        history.db_input_cache[:] = [e for e in history.db_input_cache if e[0] != line]
        try:
            with history.db:
                history.db.execute(
                    "DELETE FROM history WHERE session = ? AND line = ?",
                    (history.session_number, line),
                )
        except sqlite3.Error:
            pass
    del history.input_hist_parsed[line:], history.input_hist_raw[line:]
    raw = history.input_hist_raw
    last = [raw[k] if k >= 0 else "" for k in range(line - 1, line - 5, -1)]
    history._i00, history._i, history._ii, history._iii = last
    shell.user_ns.update(_i=last[1], _ii=last[2], _iii=last[3])
    shell.user_ns.pop(f"_i{line}", None)
    shell.execution_count -= 1
    shell.kernel.execution_count -= 1
