"""Resolves paths inside a Daytona sandbox, so the host can check they stay in the working folder.

Prints ``[root, [[realpath, is_file], ...]]`` as JSON: the root's and each path's real path
(symlinks resolved) and whether it is an existing regular file. Run as ``python -c SOURCE JSON``;
the JSON: ``[root, path, ...]``. Manual: docs/development.md.
"""

from __future__ import annotations

import json
import os
import sys


def main(args_json: str) -> None:
    """Print the resolved root and paths (see the module's docstring)."""
    real = [os.path.realpath(path) for path in json.loads(args_json)]
    print(json.dumps([real[0], [[path, os.path.isfile(path)] for path in real[1:]]]))


if __name__ == "__main__":
    main(sys.argv[1])
