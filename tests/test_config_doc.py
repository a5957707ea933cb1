"""docs/configuration.md's field table is the one `Config`'s fields make."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hicache.runtime import Config
from hicache.runtime._config_doc import END, START, field_table, main, with_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_the_configuration_page_lists_the_fields_as_they_are() -> None:
    page = PAGE.read_text()
    assert with_table(page) == page, (
        "docs/configuration.md's field table is stale: run `.venv/bin/python -m hicache.runtime._config_doc`"
    )


def test_the_table_has_a_row_per_field_with_its_default_and_range() -> None:
    rows = field_table().splitlines()[2:]
    assert [r.split("`")[1] for r in rows] == [f.name for f in dataclasses.fields(Config)]
    assert "| `storage_batch_pages` | `16` | an integer in 1..4096 |" in field_table()
    assert "| `write_policy` | `\"write_through\"` | one of write_through, write_through_selective, write_back |" \
        in field_table()


def test_the_command_rewrites_only_the_table(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(f"# Before\n\n{START}\n| stale |\n{END}\n\nAfter.\n")
    assert main([str(page)]) == 0
    assert page.read_text() == f"# Before\n\n{START}\n{field_table()}\n{END}\n\nAfter.\n"


def test_a_page_without_the_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="the page lacks the markers"):
        with_table("# no table here\n")
