"""docs/messages.md documents exactly the registered messages and wire enums.

The page has one `## Area` section per messages module (common, device, host,
transfer, tree, storage) and one `### Name` entry per message (`### Name (enum)` per enum), with
bullet lines `- **Code:** N`, `- **Fields:** ...` (or `- **Members:** ...` for an
enum) and `- **Reply:** ...`. These tests parse that format.
"""

from __future__ import annotations

import builtins
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import hicache.actors
import hicache.messages
import hicache.runtime
from hicache.messages import ENUM_TYPES, MESSAGE_TYPES, field_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "messages.md"
AREAS = ("common", "device", "host", "transfer", "tree", "storage")
KINDS = {"command", "reply", "event", "record", "self-note", "enum"}

_HEADING = re.compile(r"^### (?P<name>\w+)(?P<enum> \(enum\))?\s*$")
_BULLET = re.compile(r"^- \*\*(?P<key>[A-Za-z ]+):\*\* (?P<value>.*)$")
_TICKED = re.compile(r"`([^`]+)`")
_CAMEL = re.compile(r"`([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)*)\b[^`]*`")


@dataclass
class Entry:
    name: str
    is_enum: bool
    area: str
    line: int
    bullets: dict[str, str] = field(default_factory=dict)

    def names_in(self, key: str) -> list[str]:
        value = self.bullets.get(key, "")
        return [] if value.strip() == "none" else _TICKED.findall(value)


def parse(text: str) -> list[Entry]:
    entries: list[Entry] = []
    area = ""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("## "):
            area = line[3:].strip().split()[0].lower()
            continue
        if line.startswith("### "):
            m = _HEADING.match(line)
            assert m, f"docs/messages.md:{number}: entry heading {line!r} is not `### Name` or `### Name (enum)`"
            entries.append(Entry(m["name"], bool(m["enum"]), area, number))
            continue
        if entries and (b := _BULLET.match(line)):
            entries[-1].bullets.setdefault(b["key"], b["value"])
    return entries


@pytest.fixture(scope="module")
def entries() -> list[Entry]:
    return parse(DOC.read_text(encoding="utf-8"))


def _messages() -> dict[str, type]:
    return {cls.__name__: cls for cls in MESSAGE_TYPES.values()}


def _enums() -> dict[str, type[enum.Enum]]:
    return {cls.__name__: cls for cls in ENUM_TYPES.values()}


def test_every_registered_message_has_an_entry(entries: list[Entry]) -> None:
    documented = {e.name for e in entries if not e.is_enum}
    missing = sorted(set(_messages()) - documented)
    assert not missing, f"registered messages without a `### Name` entry in docs/messages.md: {missing}"


def test_every_wire_enum_has_an_entry(entries: list[Entry]) -> None:
    documented = {e.name for e in entries if e.is_enum}
    missing = sorted(set(_enums()) - documented)
    assert not missing, f"wire enums without a `### Name (enum)` entry in docs/messages.md: {missing}"


def test_every_entry_names_a_registered_message_or_enum(entries: list[Entry]) -> None:
    stray = [
        f"{e.name} (line {e.line})"
        for e in entries
        if e.name not in (_enums() if e.is_enum else _messages())
    ]
    assert not stray, f"docs/messages.md documents what is not registered (renamed or removed?): {stray}"


def test_no_message_or_enum_is_documented_twice(entries: list[Entry]) -> None:
    seen: dict[tuple[str, bool], int] = {}
    twice = []
    for e in entries:
        key = (e.name, e.is_enum)
        if key in seen:
            twice.append(f"{e.name} (lines {seen[key]} and {e.line})")
        seen[key] = e.line
    assert not twice, f"documented twice: {twice}"


def test_each_entry_sits_in_the_section_of_its_module(entries: list[Entry]) -> None:
    registered = {**_messages(), **_enums()}
    wrong = []
    for e in entries:
        cls = registered.get(e.name)
        if cls is None:
            continue
        area = cls.__module__.rsplit(".", 1)[-1]
        assert area in AREAS, f"{e.name} lives in messages/{area}.py, which has no section; add one"
        if e.area != area:
            wrong.append(f"{e.name} is under '## {e.area}' but is declared in messages/{area}.py")
    assert not wrong, "; ".join(wrong)


def test_each_entry_states_the_registered_type_code(entries: list[Entry]) -> None:
    registered = {**_messages(), **_enums()}
    wrong = []
    for e in entries:
        cls = registered.get(e.name)
        if cls is None:
            continue
        code = e.bullets.get("Code", "").strip()
        if code != str(cls.TYPE_CODE):  # type: ignore[attr-defined]
            wrong.append(f"{e.name}: documented code {code!r}, registered {cls.TYPE_CODE}")  # type: ignore[attr-defined]
    assert not wrong, f"type codes in docs/messages.md disagree with the registry: {wrong}"


def test_each_message_entry_lists_its_fields_in_wire_order(entries: list[Entry]) -> None:
    wrong = []
    for e in entries:
        cls = _messages().get(e.name)
        if cls is None or e.is_enum:
            continue
        if "Fields" not in e.bullets:
            wrong.append(f"{e.name}: no `- **Fields:**` line")
        elif tuple(e.names_in("Fields")) != field_names(cls):
            wrong.append(f"{e.name}: documented {tuple(e.names_in('Fields'))}, declared {field_names(cls)}")
    assert not wrong, f"field lists in docs/messages.md disagree with the classes: {wrong}"


def test_each_enum_entry_lists_its_members_in_order(entries: list[Entry]) -> None:
    wrong = []
    for e in entries:
        cls = _enums().get(e.name)
        if cls is None or not e.is_enum:
            continue
        members = tuple(m.name for m in cls)
        if tuple(e.names_in("Members")) != members:
            wrong.append(f"{e.name}: documented {tuple(e.names_in('Members'))}, declared {members}")
    assert not wrong, f"member lists in docs/messages.md disagree with the enums: {wrong}"


def test_each_message_entry_has_a_kind_sender_receiver_and_reply(entries: list[Entry]) -> None:
    wrong = []
    for e in entries:
        keys = ("Code", "Kind", "Members") if e.is_enum else ("Code", "Kind", "Sender", "Receiver", "Fields", "Reply")
        absent = [k for k in keys if not e.bullets.get(k, "").strip()]
        if absent:
            wrong.append(f"{e.name}: missing {absent}")
        kind = e.bullets.get("Kind", "").strip()
        if kind not in KINDS or (kind == "enum") != e.is_enum:
            wrong.append(f"{e.name}: kind {kind!r} (allowed: {sorted(KINDS)}; `enum` exactly for enums)")
    assert not wrong, "; ".join(wrong)


def test_every_reply_named_is_a_registered_message(entries: list[Entry]) -> None:
    known = set(_messages())
    wrong = [
        f"{e.name} replies {name}"
        for e in entries
        for name in _CAMEL.findall(e.bullets.get("Reply", ""))
        if name not in known
    ]
    assert not wrong, f"replies in docs/messages.md that are not registered messages: {wrong}"


def test_every_class_name_the_page_mentions_exists() -> None:
    known = set(_messages()) | set(_enums()) | set(dir(builtins)) | set(dir(enum))
    for pkg in (hicache.actors, hicache.messages, hicache.runtime):
        known |= set(pkg.__all__)
    mentioned = set(_CAMEL.findall(DOC.read_text(encoding="utf-8")))
    unknown = sorted(mentioned - known)
    assert not unknown, (
        f"docs/messages.md mentions names that are neither registered nor exported (renamed or removed?): {unknown}"
    )


def test_the_parser_reads_an_entry_as_documented() -> None:
    text = "## Host\n\n### AllocateHost\n\n- **Code:** 201\n- **Fields:** `op_id`, `tokens`\n- **Reply:** none\n"
    [e] = parse(text)
    assert (e.name, e.is_enum, e.area, e.bullets["Code"]) == ("AllocateHost", False, "host", "201")
    assert e.names_in("Fields") == ["op_id", "tokens"]
    assert e.names_in("Reply") == []
