"""Every relative link in the README and docs/ names a file that exists, and a heading there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+ (.*)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (code blocks skipped, repeats numbered)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else _HEADING.match(line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for link in _LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if root not in target.parents:
            bad.append(f"{link} (outside the repository)")
        elif not target.exists():
            bad.append(f"{link} (no such file)")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            bad.append(f"{link} (no such heading)")
    return bad


def test_every_relative_link_of_the_readme_and_docs_resolves() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert not bad, f"broken links: {bad}"


def test_a_missing_file_a_missing_heading_and_a_link_outside_are_reported(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n")
    page.write_text("# Title\n\n```\n# not a heading\n```\n[a](#title) [b](#not-a-heading) [c](gone.md) "
                    "[d](other.md#other-page) [e](other.md#title) [f](../../shared/DESIGN.md) [g](https://x.org/a)\n")
    assert broken_links(page, root=tmp_path) == [
        "#not-a-heading (no such heading)", "gone.md (no such file)", "other.md#title (no such heading)",
        "../../shared/DESIGN.md (outside the repository)"]
