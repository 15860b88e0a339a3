"""The README and docs/ lead somewhere: every relative link names a file or folder that exists,
every anchor names a heading of its page (GitHub's slugs), and the README stays a front door of
at most 8 KB."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 8192

EXTERNAL = re.compile(r"^(?:https?|mailto):", re.IGNORECASE)
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) or ![alt](target), with an optional "title"; the text may hold one level of
# brackets. Code spans are blanked before this runs, so links inside them do not count.
INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*(?:\s#+)?\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked out."""
    lines: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is not None:
            if opening and opening[1][0] == fence[0] and len(opening[1]) >= len(fence):
                fence = None
            continue
        if opening:
            fence = opening[1]
            continue
        lines.append((number, CODE_SPAN.sub(lambda m: " " * len(m[0]), line)))
    return lines


def link_targets(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline link, image and reference definition."""
    targets = []
    for number, line in prose_lines(text):
        found = [m[1] for m in INLINE_LINK.finditer(line)]
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            found.append(definition[1])
        targets += [(number, target.strip("<>")) for target in found]
    return targets


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation other than '-' and '_'
    dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def heading_anchors(text: str) -> set[str]:
    """Every anchor a page's headings give, repeated headings numbered as GitHub numbers them."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for number, _ in prose_lines(text):
        match = HEADING.match(text.splitlines()[number - 1])
        if not match:
            continue
        slug = github_slug(match[2])
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def split_target(page: Path, target: str, root: Path) -> tuple[Path, str]:
    """The file a link points at (relative to its page, or to the root for '/...') and its
    anchor ('' for none)."""
    path, _, anchor = target.partition("#")
    path = unquote(path)
    if not path:
        return page, anchor
    base = root if path.startswith("/") else page.parent
    return (base / path.lstrip("/")).resolve(), unquote(anchor)


def broken_links(page: Path, root: Path = ROOT, skip=lambda target: False) -> list[str]:
    """'page:line: target (why)' for each relative link of `page` that leads nowhere.
    `skip(target)` drops links from the check."""
    problems = []
    for number, target in link_targets(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or skip(target):
            continue
        where = f"{page.relative_to(root)}:{number}: {target}"
        path, anchor = split_target(page, target, root)
        if not path.is_relative_to(root.resolve()):
            problems.append(f"{where} (outside the repository)")
        elif not path.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and path.suffix != ".md":
            problems.append(f"{where} (an anchor into a file that is not markdown)")
        elif anchor and anchor not in heading_anchors(path.read_text(encoding="utf-8")):
            problems.append(f"{where} (no heading with that anchor)")
    return problems


def is_source_link(target: str) -> bool:
    return not EXTERNAL.match(target) and target.lstrip("./").startswith("aioinfer/")


def readme_source_links() -> list[str]:
    return sorted({t for _, t in link_targets(README.read_text()) if is_source_link(t)})


def test_the_readme_is_a_front_door_of_at_most_8_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    skip = is_source_link if page == README else (lambda target: False)
    assert broken_links(page, skip=skip) == []


@pytest.mark.parametrize("target", readme_source_links())
def test_readme_links_into_the_source_tree(target: str):
    assert broken_links(README, skip=lambda t: t != target) == []


def test_the_readme_maps_the_chat_handler_the_scheduler_and_the_device_thread():
    targets = set(readme_source_links())
    for path in ("server/openai/completions.py", "core/scheduler.py", "gpu/thread.py"):
        assert f"aioinfer/{path}" in targets


def test_github_slugs():
    assert github_slug("Will it fit? `aioinfer plan`") == "will-it-fit-aioinfer-plan"
    assert github_slug("Anthropic's Messages API") == "anthropics-messages-api"
    assert github_slug("2026-11-30, evening: embeddings (`--runner pooling`)") == (
        "2026-11-30-evening-embeddings---runner-pooling"
    )
    assert github_slug("The [design](design.md) of it_all") == "the-design-of-it_all"


def test_the_checker_finds_planted_broken_links(tmp_path: Path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    other = "# Other page\n\n## A section, again\n\n## Repeat\n\n## Repeat\n"
    (tmp_path / "docs" / "other.md").write_text(other)
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "Fine: [other](other.md), [section](other.md#a-section-again), [2](other.md#repeat-1),\n"
        "[here](#page), [folder](../src/), [root](/docs/other.md), ![img](other.md),\n"
        "[web](https://example.com/missing), [mail](mailto:a@b.c), `[code](missing.md)`.\n\n"
        "```\n[fenced](missing.md)\n```\n\n"
        "Broken: [file](missing.md), [anchor](other.md#no-such-heading),\n"
        "[here](#nowhere), [up](../../outside.md), [code](../src/#L3)\n\n"
        "[ref]: gone.md\n"
    )
    problems = broken_links(page, root=tmp_path)
    assert problems == [
        "docs/page.md:11: missing.md (no such file)",
        "docs/page.md:11: other.md#no-such-heading (no heading with that anchor)",
        "docs/page.md:12: #nowhere (no heading with that anchor)",
        "docs/page.md:12: ../../outside.md (outside the repository)",
        "docs/page.md:12: ../src/#L3 (an anchor into a file that is not markdown)",
        "docs/page.md:14: gone.md (no such file)",
    ]
    assert broken_links(page, root=tmp_path, skip=lambda t: True) == []
