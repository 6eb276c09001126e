"""Every relative link in the README and the pages under docs/ resolves: the file exists and, where the link
names an anchor in a Markdown file, that file has a heading with that anchor (GitHub's rule for turning a
heading into an anchor). Links to the web are not fetched."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$")
FENCE = re.compile(r"^ {0,3}(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `#` comment in a bash block is no heading)."""
    lines, in_code = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces turned to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor the page's headings make; a repeated heading gets -1, -2, ... as on GitHub."""
    found: dict[str, int] = {}
    result = set()
    for line in prose_lines(page.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = found.get(base, 0)
        found[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path) -> list[str]:
    broken = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target} (no file {file})")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no heading with anchor #{anchor} in {file.name})")
    return broken


def test_the_slug_follows_githubs_rule():
    assert slug("Prefix cache tiers: host memory and disk") == "prefix-cache-tiers-host-memory-and-disk"
    assert slug("GPU (Triton) — not yet measured") == "gpu-triton--not-yet-measured"
    assert slug("`GET /v1/kv`") == "get-v1kv"
    assert slug("Q4_K and Q6_K with integer sub-scales") == "q4_k-and-q6_k-with-integer-sub-scales"


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A section\n")
    page.write_text(
        "# Page\n\n[ok](other.md#a-section) [self](#page) [gone](missing.md) [no anchor](other.md#nope)\n"
        "```bash\n# not a heading [in code](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        f"page.md: missing.md (no file {tmp_path / 'missing.md'})",
        "page.md: other.md#nope (no heading with anchor #nope in other.md)",
    ]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []
