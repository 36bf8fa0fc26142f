"""An agent that writes its code as it goes, on the CO2 data, offline.

A deterministic stand-in for a language model (`ScriptedModel`) writes one cell at a time into a
sandbox session, reads what each printed or raised, and decides the next one. Its second cell
has a bug (a column name it guessed); the traceback goes back to it through ``fix``, it reads the
missing key and the columns the first cell printed, and writes the fix. Then it fits a trend +
seasonal model, scores it on the last five years and saves a figure and ``metrics.json``.

Run it from the repository root::

    .venv/bin/python examples/agent/co2_agent.py --out out

It leaves ``out/<run-folder>/`` holding ``executed.ipynb`` (every attempt, in order),
``figures/co2_agent.png``, ``metrics.json`` and ``summary.json``. To use a real model, give
`run_agent` a model with the same two methods (see docs/how-to/agents.md, "With a real
model").
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import re
from pathlib import Path
from typing import Any

from prefect import flow

from prefect_sandbox.blocks.base import SandboxBackend
from prefect_sandbox.flows import CellRun, sandbox_session

DATA = Path(__file__).resolve().parent.parent / "co2" / "co2.csv"

LOAD = """\
import pandas as pd
df = pd.read_csv('co2.csv')
df['date'] = pd.to_datetime(df['date'].astype(str), format='%Y%m%d')
print(df.shape, df.columns.tolist())"""

# The model guesses the column is called 'ppm'; it is 'co2'.
MONTHLY = """\
monthly = df.set_index('date')['ppm'].resample('MS').mean().interpolate()
print(len(monthly), 'months from', monthly.index[0].date(), 'to', monthly.index[-1].date())"""

FIT = """\
import json
import numpy as np
t = (monthly.index.year + (monthly.index.month - 1) / 12).to_numpy()
month = monthly.index.month.to_numpy()
train = np.arange(len(t)) < len(t) - 60  # the last five years held out
features = np.column_stack([t - t[0], (t - t[0]) ** 2] + [month == m for m in range(1, 13)])
coef, *_ = np.linalg.lstsq(features[train].astype(float), monthly.to_numpy()[train], rcond=None)
fitted = features.astype(float) @ coef
errors = monthly.to_numpy()[~train] - fitted[~train]
metrics = {
    'holdout_mae_ppm': round(float(np.abs(errors).mean()), 3),
    'holdout_rmse_ppm': round(float(np.sqrt((errors ** 2).mean())), 3),
    'holdout_months': int((~train).sum()),
}
json.dump(metrics, open('metrics.json', 'w'), indent=2)
print(metrics)"""

FIGURE = """\
import os
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
os.makedirs('figures', exist_ok=True)
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(monthly.index, monthly, lw=0.8, label='observed')
ax.plot(monthly.index, fitted, lw=0.8, label='trend + season')
ax.axvline(monthly.index[train.sum()], color='grey', ls='--', label='holdout')
ax.set_ylabel('CO2 (ppm)')
ax.legend()
fig.savefig('figures/co2_agent.png', dpi=100)
print('saved figures/co2_agent.png')"""


class ScriptedModel:
    """A stand-in for a language model: the same cells every time, and a fix that it derives
    from the traceback it is shown, as a model would."""

    def __init__(self) -> None:
        self._plan = [LOAD, MONTHLY, FIT, FIGURE]
        self._columns: list[str] = []

    def next_cell(self, last: CellRun | None) -> str | None:
        """The next cell to run, having read the last one's result; None when done."""
        if last is not None and last.step == 1:
            # The first cell printed the columns: "(rows, cols) ['date', 'co2']".
            columns = re.search(r"\[.*\]", last.text)
            self._columns = ast.literal_eval(columns.group()) if columns else []
        return self._plan.pop(0) if self._plan else None

    def fix(self, code: str, report: CellRun) -> str | None:
        """New code for a failed cell, from its traceback; None when it cannot tell."""
        missing = re.search(r"KeyError: '(\w+)'", report.text)
        values = [c for c in self._columns if c != "date"]
        if missing is None or len(values) != 1:
            return None
        return code.replace(f"'{missing.group(1)}'", f"'{values[0]}'")


async def run_agent(model: Any, session: Any, max_attempts: int = 3) -> list[CellRun]:
    """Let ``model`` write cells into ``session`` until it has none left; return each step."""
    steps: list[CellRun] = []
    last = None
    while (code := model.next_cell(last)) is not None:
        last = await session.run_cell(code, fix=model.fix, max_attempts=max_attempts)
        steps.append(last)
    return steps


@flow(name="co2-agent")
async def co2_agent(out: str = "out", backend: SandboxBackend | None = None) -> dict[str, Any]:
    """The scripted agent's run: one sandbox session, its cells decided as it goes.

    Returns:
        ``{"steps": [(step, attempts, status), ...], "last": what the last cell printed}``.
    """
    async with sandbox_session(
        backend=backend,
        inputs=[str(DATA)],
        artifacts=["figures/*.png", "metrics.json"],
        storage=out,
    ) as session:
        steps = await run_agent(ScriptedModel(), session)
    return {
        "steps": [(step.step, step.attempt, step.status) for step in steps],
        "last": "".join(
            o["text"] for o in steps[-1].cell.outputs if o["output_type"] == "stream"
        ).strip(),
    }


def report(found: dict[str, Any], out: str) -> str:
    """What the run did, for a person: a line per step (status, and how many attempts it took),
    the last cell's output, and where the files are."""
    lines = [f"The agent ran {len(found['steps'])} step(s):"]
    for step, attempts, status in found["steps"]:
        fixed = f", fixed after {attempts - 1} failed attempt(s)" if attempts > 1 else ""
        lines.append(f"  step {step}: {status}{fixed}")
    lines.append(f"Its last cell printed: {found['last']}")
    lines.append(f"Files (executed.ipynb, figures, metrics.json, summary.json) are in {out}/")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", default="out", help="the folder to store the run's files in")
    out = parser.parse_args().out
    print(report(asyncio.run(co2_agent(out=out)), out))
