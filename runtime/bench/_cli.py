"""What every `hicache bench` command shares: its progress bar and how it reports.

Not actor code: the benches read `time.perf_counter` and print.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def progress_bar(as_json: bool) -> Progress:
    """The bar on stderr; with `--json` it is cleared at the end, so that stdout holds only the JSON."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True), transient=as_json,
    )


def report(table: RenderableType, body: dict[str, Any], *, as_json: bool) -> int:
    """With `--json`, `body` as one JSON line on stdout and the table on stderr; otherwise the
    table on stdout. The command's exit status."""
    if as_json:
        sys.stdout.write(json.dumps(body) + "\n")
        sys.stdout.flush()
        Console(stderr=True).print(table)
    else:
        Console().print(table)
    return 0
