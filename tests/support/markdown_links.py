"""Links and headings of the project's Markdown, read the way GitHub renders them: `[text](target)` and
`![alt](target)` outside code (fenced blocks and inline spans), heading anchors by GitHub's slug rule (lower case,
punctuation but `-` and `_` dropped, spaces to `-`, a repeated slug suffixed `-1`, `-2`, ...)."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (links there are not links)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (without the leading #s)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading anchors its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(md: Path, root: Path) -> list[str]:
    """Each relative link of `md` whose file does not exist (or leaves `root`), or whose #anchor is no heading of
    the Markdown file it points at: one line per link, naming the file, the link and what is wrong."""
    problems = []
    for target in LINK.findall(prose(md.read_text(encoding="utf-8"))):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / unquote(path)).resolve() if path else md.resolve()
        where = f"{md.relative_to(root)}: ({target})"
        if root.resolve() not in dest.parents and dest != root.resolve():
            problems.append(f"{where} leaves the repository")
        elif not dest.exists():
            problems.append(f"{where}: no file {dest.relative_to(root.resolve())}")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where}: {dest.name} has no heading with anchor #{anchor}")
    return problems
