"""Every relative link in the documents reaches something: README.md, docs/*.md and bench/README.md.

A link `[text](path)` names a file or folder that exists, relative to the document; a link with an anchor,
`(path#section)` or `(#section)`, names a heading of the target document, turned into an anchor as GitHub
does it (lowercase, markdown markup and punctuation dropped, each space a '-', a repeated heading given -1, -2).
Links to the web (http, https, mailto) are not followed. Code blocks and inline code are skipped.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*(?:\([^()\s]*\)[^()\s<>]*)*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(path: Path):
    """(line number, text) for each line outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)                         # inline HTML
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"(?<![\w])_+|_+(?![\w])", "", text)           # _emphasis_, not snake_case
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                        # punctuation dropped, letters of any script kept
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if not heading:
            continue
        base = slug(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: Path):
    """(line number, target) for each link of a document."""
    for number, line in prose_lines(path):
        reference = REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def broken(path: Path, target: str) -> str | None:
    """Why `target`, a link in `path`, reaches nothing; None when it does."""
    if not target or EXTERNAL.match(target):
        return None
    file_part, _, anchor = target.partition("#")
    destination = (path.parent / file_part).resolve() if file_part else path
    if not destination.exists():
        return "no such file"
    if not anchor:
        return None
    if destination.is_dir() or destination.suffix.lower() != ".md":
        return None
    if anchor not in anchors(destination):
        return f"no heading with anchor #{anchor} in {destination.relative_to(ROOT).as_posix()}"
    return None


def test_slug_follows_github():
    assert slug("Verify's cost") == "verifys-cost"
    assert slug("Determinism: the pinned CPU arithmetic") == "determinism-the-pinned-cpu-arithmetic"
    assert slug("`make plan` and the disk") == "make-plan-and-the-disk"
    assert slug("Against speculators (data generation)") == "against-speculators-data-generation"
    assert slug("The DeepSeek-V3-shaped target, 2 × 2") == "the-deepseek-v3-shaped-target-2--2"
    assert slug("hidden_states and **bold**") == "hidden_states-and-bold"


def test_every_relative_link_reaches_its_target():
    problems = []
    for path in DOCUMENTS:
        if not path.is_file():
            continue
        for number, target in links(path):
            why = broken(path, target)
            if why:
                problems.append(f"{path.relative_to(ROOT).as_posix()}:{number}: ({target}) {why}")
    assert not problems, "broken links:\n" + "\n".join(problems)
