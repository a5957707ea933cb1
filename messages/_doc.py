"""docs/messages.md, made from the message classes.

`python -m hicache.messages._doc [PAGE]` writes the catalogue to PAGE
(docs/messages.md by default): one section per messages module, one entry per
registered message or wire enum with its code, its docstring and its fields (or
members) in wire order with theirs. A test fails when the committed page is not
the one this makes, so the page never drifts from the code: edit the docstrings,
then run the command.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import sys
from pathlib import Path

from ._registry import ENUM_TYPES, MESSAGE_TYPES

AREAS = ("common", "device", "host", "transfer", "tree", "storage")
"""The messages modules, in the order of their code ranges."""

_PREAMBLE = """\
# Message catalogue

<!-- made by `python -m hicache.messages._doc`: edit the docstrings in messages/, not this page -->

Every message the actors exchange, and every enum that travels inside one, as
the registry in `hicache.messages` (`MESSAGE_TYPES`, `ENUM_TYPES`) declares
them. See [architecture.md](architecture.md) for the actors and the flows these
messages make up.

## Conventions

- **One class per verb**, declared in `messages/<area>.py` with `@message(code)`:
  a frozen, slotted, keyword-only dataclass. Commands are imperative
  (`AllocateHost`), events and replies past tense (`WriteDone`). *Records* are
  registered classes that only travel inside other messages (`SlotDemand`).
- **Codes** are stable wire identifiers, never reused: 1-99 common, 100-199
  device, 200-299 host, 300-399 transfer, 400-499 tree, 500-599 storage. Enums
  have their own code table (`@wire_enum(code)`); an enum and a message may
  share a number.
- **Wire format** (`hicache.messages.encode` / `decode`): the msgpack array
  `[code, field_1, ..., field_n]` in declaration order. `Indices` travel as
  extension 1 (raw little-endian int64 bytes), enum members as extension 2
  (`[enum_code, value]`), nested records as extension 3, and `Tokens` (the same
  int64 bytes, another meaning) as extension 4. Arrays decode as tuples. A bad
  payload raises `CodecError` saying what was wrong.
  `Indices.concat` of parts of 4 KiB or more joins their bytes when they are
  first read; such a value is an `Indices` to equality, hashing, the codec and
  pickle (it decodes and unpickles as a plain one).
- **Every mail names its sender** (`Mail.sender`, an `ActorName`); a receiver
  refuses a message from an actor that may not send it with `WrongSenderError`.
- **Replies**: when the mail was an ask, the reply goes to the asker's future;
  when it was a tell from another actor, the receiver sends the reply back as a
  message of its own. A handler never blocks on a future. Operating conditions
  (no free pages, a failed copy) are reply messages; programmer errors (a ledger
  misused, an illegal slot move, a wrong sender) raise in the handler.
"""


def _docs_of(cls: type) -> tuple[str, dict[str, str]]:
    """The class docstring and the docstring under each field or member, read from the source."""
    tree = ast.parse(inspect.getsource(cls))
    node = tree.body[0]
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    body = node.body
    for stmt, after in zip(body, body[1:]):
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else (
            stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else None)
        if isinstance(target, ast.Name) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[target.id] = inspect.cleandoc(after.value.value)
    return inspect.cleandoc(cls.__doc__ or ""), docs


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _enum_entry(cls: type[enum.Enum]) -> list[str]:
    doc, docs = _docs_of(cls)
    rows = ["| member | value | meaning |", "|---|---|---|"]
    rows += [f"| `{m.name}` | `{m.value!r}` | {_one_line(docs.get(m.name, ''))} |" for m in cls]
    return [f"### {cls.__name__} (enum)", "", f"Code {cls.TYPE_CODE}.", "", doc, "", *rows]  # type: ignore[attr-defined]


def _message_entry(cls: type) -> list[str]:
    doc, docs = _docs_of(cls)
    fields = dataclasses.fields(cls)
    head = [f"### {cls.__name__}", "", f"Code {cls.TYPE_CODE}.", "", doc]  # type: ignore[attr-defined]
    if not fields:
        return [*head, "", "No fields."]
    rows = ["| field | type | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{_one_line(str(f.type))}` | {_one_line(docs.get(f.name, ''))} |" for f in fields]
    return [*head, "", *rows]


def _area(name: str) -> list[str]:
    module = importlib.import_module(f"{__package__}.{name}")
    enums = sorted((c for c in ENUM_TYPES.values() if c.__module__ == module.__name__),
                   key=lambda c: c.TYPE_CODE)  # type: ignore[attr-defined]
    messages = sorted((c for c in MESSAGE_TYPES.values() if c.__module__ == module.__name__),
                      key=lambda c: c.TYPE_CODE)  # type: ignore[attr-defined]
    out = [f"## {name.capitalize()}", "", f"`messages/{name}.py`: {inspect.cleandoc(module.__doc__ or '')}"]
    for entry in [*map(_enum_entry, enums), *map(_message_entry, messages)]:
        out += ["", *entry]
    return out


def page() -> str:
    """The whole catalogue, as docs/messages.md holds it."""
    declared = {c.__module__.rsplit(".", 1)[-1] for c in [*MESSAGE_TYPES.values(), *ENUM_TYPES.values()]}
    stray = sorted(declared - set(AREAS))
    if stray:
        raise ValueError(f"messages declared in modules the catalogue does not list: {stray}; add them to AREAS")
    lines = [_PREAMBLE.rstrip("\n")]
    for name in AREAS:
        lines += ["", *_area(name)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    Path(args[0] if args else "docs/messages.md").write_text(page(), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
