"""Griffe extension: the flows' sync twins (``run_notebook = sync_twin(arun_notebook)``) shown
as the functions they are at run time, with their async flow's signature, not as attributes.

`prefect_sandbox.flows.stopping.sync_twin` wraps the flow's function with ``functools.wraps``,
so the twin's signature is the flow's; griffe reads the source, where the twin is an
assignment, so this extension makes it a function of that signature for the API reference.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_TWIN = re.compile(r"^sync_twin\((\w+)\)$")


class SyncTwins(griffe.Extension):
    """Replace each module attribute ``NAME = sync_twin(FLOW)`` by a function ``NAME`` with
    ``FLOW``'s parameters and return annotation, and a docstring saying what it is."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for module in _modules(pkg):
            for name, member in list(module.members.items()):
                if member.is_alias or not isinstance(member, griffe.Attribute):
                    continue
                match = _TWIN.match(str(member.value or ""))
                flow = module.members.get(match.group(1)) if match else None
                if not isinstance(flow, griffe.Function):
                    continue
                twin = griffe.Function(
                    name,
                    lineno=member.lineno,
                    endlineno=member.endlineno,
                    parameters=flow.parameters,
                    returns=flow.returns,
                    docstring=griffe.Docstring(
                        f"The blocking twin of `{flow.name}`, for plain Python: the same "
                        "parameters, result and errors. On a script's main thread it takes "
                        "SIGTERM as the CLI does: the run is cancelled, cleans up and ends "
                        "Cancelled, then the twin raises `SystemExit(143)`.",
                        parser="google",
                    ),
                )
                module.set_member(name, twin)


def _modules(module: griffe.Module) -> list[griffe.Module]:
    found = [module]
    for member in module.members.values():
        if not member.is_alias and isinstance(member, griffe.Module):
            found += _modules(member)
    return found
