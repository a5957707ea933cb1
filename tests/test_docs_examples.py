"""The python examples of docs/*.md run as written, each page's in order in one namespace.

A block that cannot run here (it needs a model directory, CUDA, files an earlier console
step made, or is a fragment) says so on the line before it: `<!-- not run: why -->`.
A block followed by a paragraph ending in "It prints:" must print the block after it.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_FENCE = re.compile(r"^```(\S*)\n(.*?)^```\n", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (\S[^>]*?) -->\n$")


def examples(text: str) -> list[tuple[int, str, str | None, str | None]]:
    """Each python block as (line, code, why it is not run or None, the output it must print or None)."""
    fences = list(_FENCE.finditer(text))
    out = []
    for i, fence in enumerate(fences):
        if fence[1] != "python":
            continue
        line = text.count("\n", 0, fence.start()) + 1
        skip = _NOT_RUN.search(text, 0, fence.start())
        nxt = fences[i + 1] if i + 1 < len(fences) else None
        prints = None
        if nxt is not None and nxt[1] == "" and text[fence.end() : nxt.start()].strip().endswith("prints:"):
            prints = nxt[2]
        out.append((line, fence[2], skip[1] if skip else None, prints))
    return out


def test_the_fence_parser_sees_markers_and_printed_output() -> None:
    text = "<!-- not run: a fragment -->\n```python\nx(...)\n```\n\n```python\nprint(1)\n```\n\nIt prints:\n\n```\n1\n```\n"
    assert examples(text) == [(2, "x(...)\n", "a fragment", None), (6, "print(1)\n", None, "1\n")]


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_python_examples_of_the_page_run_as_written(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # files an example writes land here
    session: dict[str, object] = {"__name__": "__docs__"}
    for line, code, not_run, prints in examples(page.read_text(encoding="utf-8")):
        if not_run is not None:
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{page.name}:{line}", "exec"), session)
        if prints is not None:
            assert out.getvalue() == prints, f"{page.name}:{line} printed another output than the page shows"


def test_every_not_run_marker_stands_before_a_python_example() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        marked = sum(why is not None for _, _, why, _ in examples(text))
        assert text.count("<!-- not run:") == marked, f"{page.name}: a not-run marker not right before a python block"
