"""The storage tier's operational log lines (`hicache.storage`, through stdlib `logging`) as
dicts, for tests: each line's `key=value` fields, and its level as `log_level`."""

from __future__ import annotations

import ast
import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

_FIELD = re.compile(r"""(\w+)=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+)""")


def fields(line: str) -> dict[str, Any]:
    """The fields of one rendered line (`KeyValueRenderer`: `key=repr(value)` separated by spaces)."""
    out: dict[str, Any] = {}
    for m in _FIELD.finditer(line):
        try:
            out[m[1]] = ast.literal_eval(m[2])
        except (ValueError, SyntaxError):
            out[m[1]] = m[2]
    return out


@contextlib.contextmanager
def storage_logs(name: str = "hicache.storage") -> Iterator[list[dict[str, Any]]]:
    """The lines logged under `name` while the block runs, in order."""
    events: list[dict[str, Any]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            events.append({**fields(record.getMessage()), "log_level": record.levelname.lower()})

    log = logging.getLogger(name)
    handler, level = Collect(logging.DEBUG), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield events
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
