"""The README is the front door and docs/ holds one page per topic: keep both navigable.

The README opens with the two commands CI runs (.ci/run), stays short enough to read first and
links every docs page; every relative link in them resolves, anchors included (GitHub's heading
slugs), so text moved from one page to another cannot leave a dead link behind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MOST_README_LINES = 250

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
"""A markdown link or image, `[text](target)` or `[text](target "title")`; group 1 the target."""
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _split_fences(text: str) -> tuple[list[str], list[list[str]]]:
    """The page's lines outside fenced code blocks, and each fenced block's lines, in order."""
    prose: list[str] = []
    blocks: list[list[str]] = []
    fence: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip()
        if fence is None and stripped.startswith(("```", "~~~")):
            fence = stripped[:3]
            blocks.append([])
        elif fence is not None and stripped.startswith(fence):
            fence = None
        elif fence is not None:
            blocks[-1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, punctuation dropped, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a page, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in _split_fences(page.read_text(encoding="utf-8"))[0]:
        match = HEADING.match(line)
        if match is None:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    """The relative link targets of a page (not in code: fenced blocks and `inline` spans)."""
    prose = "\n".join(_split_fences(page.read_text(encoding="utf-8"))[0])
    prose = re.sub(r"(`+)(?:(?!\1).)+?\1", "", prose, flags=re.DOTALL)
    targets = [match.group(1) for match in LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, flags=re.IGNORECASE)]


def resolve(page: Path, target: str) -> tuple[Path, str | None]:
    """The file a link from `page` points at, and its anchor (None when it has none)."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    return file, anchor or None


def test_the_readme_is_short() -> None:
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MOST_README_LINES, (
        f"README.md has {lines} lines, over {MOST_README_LINES}: move the detail to a page in "
        "docs/ and link it from the README's table"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        file, anchor = resolve(page, target)
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT)}")
        elif anchor is not None and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_readme_opens_with_the_two_commands_ci_runs() -> None:
    text = README.read_text(encoding="utf-8")
    before_first_block = text.split("```", 1)[0].strip().splitlines()
    assert before_first_block == ["# meshsplit"], "the README opens: title, then the commands"
    blocks = _split_fences(text)[1]
    run, test = ("\n".join(block) for block in blocks[:2])
    assert "pip install" in run and "meshsplit compare" in run, run
    assert "pip install" in test and "pytest" in test, test
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for command in (*blocks[0], *blocks[1]):
        assert command in ci, f"the README's command is not the one .ci/run runs: {command}"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {resolve(README, target)[0] for target in links(README)}
    unlinked = [page.name for page in DOCS if page.resolve() not in linked]
    assert DOCS, "docs/ has no pages"
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_anchors_follow_githubs_slug_rule() -> None:
    assert _slug("Your own loop: `ms.launch` and `ms.parallelize`") == (
        "your-own-loop-mslaunch-and-msparallelize"
    )
    assert _slug("Memory, part 2: what each technique saves, and what it costs") == (
        "memory-part-2-what-each-technique-saves-and-what-it-costs"
    )
    slug = _slug("Desynchronised ranks: MESHSPLIT_DEBUG=1")
    assert slug == "desynchronised-ranks-meshsplit_debug1"
