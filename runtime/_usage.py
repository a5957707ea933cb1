"""`UsageError`: a mistake in a command's arguments or inputs, reported as one line.

The command line prints `hicache COMMAND: message` on stderr and exits with status 2,
the status argparse uses for the arguments it refuses itself.
"""

from __future__ import annotations

import os
from pathlib import Path


class UsageError(Exception):
    """What the user gave a command is wrong; the message says what and what to give instead."""


def check_writable_file(option: str, path: Path) -> None:
    """UsageError unless `path` names a file this process may create in an existing folder
    (checked before a command's work, which may take long)."""
    if path.is_dir():
        raise UsageError(f"{option} {path}: is a folder; give the path of a file to write")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the folder {folder} does not exist or is not writable; "
                         "create it or give another path")
