"""Every relative link and ``#anchor`` in the Markdown docs resolves.

The README is a short landing page that links into ``docs/``; a renamed heading or a moved
file would otherwise leave a dead link nobody notices. A link resolves when its file exists
(relative to the page) and, if it names an anchor in a Markdown file, a heading there has that
GitHub slug.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", *(ROOT / "docs").glob("*.md")])

# [text](target) and ![alt](target), with an optional "title"; the text may hold `code`.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, numbered from 1 (a `# comment` in code is no heading)."""
    out: list[tuple[int, str]] = []
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fence = not fence
            continue
        if not fence:
            out.append((number, line))
    return out


def _prose(text: str) -> str:
    """The text with fenced blocks and inline code blanked, keeping every line where it was.

    Whole text rather than line by line: a link's text may wrap onto the next line.
    """
    lines = text.splitlines()
    kept = dict(_prose_lines(text))
    blanked = "\n".join(kept.get(number, "") for number in range(1, len(lines) + 1))
    return _INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), blanked)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters and digits of any script, and _
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading slug of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `page` that do not resolve, as 'file:line: target (why)'."""
    problems: list[str] = []
    prose = _prose(page.read_text(encoding="utf-8"))
    for match in _LINK.finditer(prose):
        number = prose.count("\n", 0, match.start()) + 1
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, mailto:…
            continue
        where = f"{page.relative_to(root)}:{number}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(file_part)).resolve() if file_part else page
        if not dest.exists():
            problems.append(f"{where} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor)")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    """No relative link or anchor in the page is dead."""
    problems = broken_links(page)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_readme_links_into_every_docs_page() -> None:
    """A topic page nobody links to is lost: the README's contents table names each one."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds the topic pages"
    assert [name for name in pages if f"(docs/{name}" not in readme] == []


def test_the_checker_sees_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """The checker itself fails on what it must catch, and ignores links inside code."""
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## A: heading, with `code`\n", encoding="utf-8")
    page.write_text(
        "# Page\n\n"
        "[ok](other.md#a-heading-with-code) [ok too](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [self](#nowhere)\n"
        "`[in code](missing.md)`\n"
        "[a link wrapped\nover two lines](gone-too.md)\n"
        "```\n[fenced](missing.md)\n# not a heading\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md:4: missing.md (no such file)",
        "page.md:4: other.md#nope (no heading with that anchor)",
        "page.md:4: #nowhere (no heading with that anchor)",
        "page.md:6: gone-too.md (no such file)",
    ]
    assert github_slug("Updates: a synchronous answer from a running workflow") == (
        "updates-a-synchronous-answer-from-a-running-workflow"
    )
    assert (
        github_slug("Continue-as-new, cancellation, retry") == "continue-as-new-cancellation-retry"
    )
