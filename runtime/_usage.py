"""`UsageError`: a mistake in a command's arguments or inputs, reported as one line.

The command line prints `hicache COMMAND: message` on stderr and exits with status 2,
the status argparse uses for the arguments it refuses itself.
"""

from __future__ import annotations


class UsageError(Exception):
    """What the user gave a command is wrong; the message says what and what to give instead."""
