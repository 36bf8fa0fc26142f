"""MkDocs hook: the command-line reference, rendered from the CLI's own argparse parser.

A page line ``<!-- cli-reference -->`` becomes the ``--help`` text of ``prefect-sandbox`` and of
each of its subcommands, as the installed CLI prints it, so the page cannot drift from the
options. Wrapped at 100 columns, whatever the terminal that builds the site.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from prefect_sandbox import cli

MARKER = "<!-- cli-reference -->"
WIDTH = 100


def _help(parser: argparse.ArgumentParser) -> str:
    """``parser``'s help text at `WIDTH` columns, keeping its own formatter class."""
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)  # type: ignore[call-arg]
    return parser.format_help()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of ``parser``, by name, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_reference() -> str:
    """Markdown for the whole CLI: the top-level help, then one section per subcommand."""
    parser = cli._parser()
    sections = ["```text", _help(parser).rstrip(), "```"]
    for name, command in _subcommands(parser).items():
        sections += ["", f"## `prefect-sandbox {name}`", "", "```text", _help(command).rstrip()]
        sections.append("```")
    return "\n".join(sections)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: put the CLI reference where a page asks for it."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())
