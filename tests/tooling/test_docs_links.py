"""README.md and docs/*.md: every relative link and image points to a file that exists, every ``#anchor``
to a heading of its page (GitHub's slug rule), no docs page is unreachable from the README, and the
README stays a front page (at most 400 lines). Pure text; external links are only checked for form."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
FRONT_PAGE_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), target without spaces, an optional "title" after it
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def pages() -> list[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


def prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked (line breaks kept, so offsets still
    give line numbers): links inside code are no links."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        elif fenced:
            out.append("")
        else:
            out.append(INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's heading id: markup dropped, lower case, punctuation except '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs, a repeated slug numbered -1, -2, ... as GitHub does."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(path: Path):
    """(line number, target) of every Markdown link and image on a page, outside code; a link's text may
    span lines."""
    text = prose(path.read_text(encoding="utf-8"))
    for match in LINK.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1)


def problems(page: Path, anchor_cache: dict[Path, set[str]]) -> list[str]:
    found = []
    for number, target in links(page):
        where = f"{page.relative_to(REPO)}:{number}: ({target})"
        parsed = urlparse(target)
        if parsed.scheme in ("http", "https"):
            if not parsed.netloc or " " in target:
                found.append(f"{where} is not a valid URL")
            continue
        if parsed.scheme or target.startswith("//"):
            found.append(f"{where}: only relative links and http(s) URLs are expected")
            continue
        path_part, _, fragment = target.partition("#")
        goal = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not goal.exists():
            found.append(f"{where} points to a missing file")
            continue
        if fragment:
            if goal.suffix != ".md":
                found.append(f"{where}: an anchor into a file that is not Markdown")
                continue
            offered = anchor_cache.setdefault(goal, anchors(goal))
            if unquote(fragment) not in offered:
                found.append(f"{where}: no heading of {goal.relative_to(REPO)} has the anchor #{fragment}")
    return found


def reachable_from_readme() -> set[Path]:
    seen, todo = {README}, [README]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            path_part = target.partition("#")[0]
            if not path_part or urlparse(target).scheme:
                continue
            goal = (page.parent / unquote(path_part)).resolve()
            if goal.suffix == ".md" and goal.is_file() and goal not in seen:
                seen.add(goal)
                todo.append(goal)
    return seen


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_and_anchor_resolves(page):
    found = problems(page, {})
    assert not found, "\n".join(found)


def test_every_docs_page_is_reachable_from_the_readme():
    reached = reachable_from_readme()
    orphans = sorted(str(p.relative_to(REPO)) for p in DOCS.glob("*.md") if p.resolve() not in reached)
    assert not orphans, f"no link leads from README.md to {orphans}: link them from README.md or a docs page"


def test_the_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= FRONT_PAGE_LINES, (f"README.md has {lines} lines (at most {FRONT_PAGE_LINES}): move the detail "
                                       "to a page under docs/ and link it")
    assert "./scripts/test" in README.read_text(encoding="utf-8"), "the README names ./scripts/test as the test command"


def test_the_slug_rule_matches_githubs():
    """Headings seen on GitHub and the ids it gave them (independent examples, not this code's output)."""
    assert slug("VAE tiling (Generate's `vae_tiling`)") == "vae-tiling-generates-vae_tiling"
    assert slug("Your server list (`lingbot_servers.json`)") == "your-server-list-lingbot_serversjson"
    assert slug("LoRA (`python -m bench.lora`)") == "lora-python--m-benchlora"
    assert slug("Fast: the four-step LoRA") == "fast-the-four-step-lora"
    # a repeated heading is numbered, a heading in a code block is none
    assert _anchors_of_text("# A\n## Setup\n## Setup\n```\n## Setup\n```\n## Setup\n") == {
        "a", "setup", "setup-1", "setup-2"}


def _anchors_of_text(text: str) -> set[str]:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "page.md"
        page.write_text(text, encoding="utf-8")
        return anchors(page)
