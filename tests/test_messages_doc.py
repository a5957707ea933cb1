"""docs/messages.md is the catalogue `python -m hicache.messages._doc` makes from the message classes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache.messages import ENUM_TYPES, MESSAGE_TYPES, field_names
from hicache.messages._doc import main, page

PAGE = Path(__file__).resolve().parents[1] / "docs" / "messages.md"


def test_the_committed_catalogue_is_the_one_the_classes_make() -> None:
    assert PAGE.read_text(encoding="utf-8") == page(), (
        "docs/messages.md is stale: run `.venv/bin/python -m hicache.messages._doc`"
    )


def test_every_registered_message_and_enum_has_one_entry_with_its_code() -> None:
    text = page()
    for cls in MESSAGE_TYPES.values():
        assert len(re.findall(rf"^### {cls.__name__}$", text, flags=re.M)) == 1, cls.__name__
    for cls in ENUM_TYPES.values():
        assert len(re.findall(rf"^### {cls.__name__} \(enum\)$", text, flags=re.M)) == 1, cls.__name__
    entry = text.split("### AllocateHost\n", 1)[1].split("\n### ", 1)[0]
    assert "Code 201." in entry and "| `op_id` | `int` | Correlation id echoed in the reply. |" in entry


def test_fields_are_listed_in_wire_order_with_their_docstrings() -> None:
    text = page()
    for cls in MESSAGE_TYPES.values():
        entry = text.split(f"### {cls.__name__}\n", 1)[1].split("\n### ", 1)[0]
        listed = tuple(re.findall(r"^\| `(\w+)` \|", entry, flags=re.M))
        assert listed == field_names(cls), cls.__name__
        assert "|  |" not in entry, f"{cls.__name__}: a field without a docstring"


def test_the_command_writes_the_page(tmp_path: Path) -> None:
    out = tmp_path / "messages.md"
    assert main([str(out)]) == 0
    assert out.read_text(encoding="utf-8") == page()


def test_a_message_module_the_catalogue_does_not_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import hicache.messages._doc as doc

    monkeypatch.setattr(doc, "AREAS", doc.AREAS[:-1])
    with pytest.raises(ValueError, match=r"modules the catalogue does not list: \['storage'\]"):
        page()
