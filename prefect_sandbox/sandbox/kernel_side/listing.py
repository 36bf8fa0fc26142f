"""Lists what is under a folder of a remote sandbox, for backends whose own listing cannot give
every name (E2B's and Daytona's cannot marshal a name that is not UTF-8).

It prints ``[[path relative to root, lstat size in bytes, identity], ...]`` as JSON for every
entry but folders (links to folders included, never entered); identity is ``"DEV:INODE"`` of
what the path leads to, links followed, or None for a dangling link (``RemoteFile.identity``).
A name that is not UTF-8 travels as JSON's ``\\udcXX`` escape of `os.fsdecode`'s surrogate, and
`json.loads` gives it back as such. Run by `run_code` (``main``) or as ``python -c SOURCE JSON``;
the JSON: ``{"root": path}``. Manual: docs/development.md.
"""

from __future__ import annotations

import json
import os
import sys


def main(args_json: str) -> None:
    """Print the listing of ``root`` (see the module's docstring)."""
    root: str = json.loads(args_json)["root"]
    found = []
    for folder, folders, files in os.walk(root):
        for name in files + [f for f in folders if os.path.islink(os.path.join(folder, f))]:
            path = os.path.join(folder, name)
            identity: str | None
            try:
                target = os.stat(path)
                identity = f"{target.st_dev}:{target.st_ino}"
            except OSError:
                identity = None
            found.append([os.path.relpath(path, root), os.lstat(path).st_size, identity])
    print(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
