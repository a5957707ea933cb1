"""The field table of docs/configuration.md, made from `Config`'s fields.

`python -m hicache.runtime._config_doc [PAGE]` rewrites the table between its
markers in PAGE (docs/configuration.md by default); a test fails when the page and
the fields disagree, so the page never drifts from the code.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import sys
from pathlib import Path

from hicache.messages.config import Config

START = "<!-- fields: made by `python -m hicache.runtime._config_doc`; edit messages/config.py, not this table -->"
END = "<!-- end of fields -->"


def field_table() -> str:
    """One row per field: name, default (as JSON, the form `from_mapping` reads), what it takes, meaning."""
    rows = ["| field | default | takes | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(Config):
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        rows.append(f"| `{f.name}` | `{json.dumps(default)}` | {f.metadata['rule'].allowed} | {f.metadata['doc']} |")
    return "\n".join(rows)


def with_table(page: str) -> str:
    """`page` with the text between the markers replaced by the current table."""
    head, start, rest = page.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise ValueError(f"the page lacks the markers {START!r} and {END!r}")
    return f"{head}{START}\n{field_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    page = Path(args[0] if args else "docs/configuration.md")
    page.write_text(with_table(page.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
