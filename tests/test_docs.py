"""The documentation holds together: README.md stays short; no relative link or #anchor in README.md and docs/
is broken; every section of the old 1,208-line README has a place that exists; docs/nodes.md's node reference is
the help pages' text (tools/node_docs.py), so the two cannot drift."""
from pathlib import Path

import pytest

from markdown_links import anchors, broken_links

ROOT = Path(__file__).resolve().parents[1]
# docs/pending/ holds other branches' drafts for the lead to fold in: not published pages
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md",
         *sorted(p for p in (ROOT / "docs").glob("*.md"))]

# every ## and ### heading of README.md before the split (commit cee33e0, 1,208 lines) -> where its text is now
OLD_README_SECTIONS = {
    "Quick start": "README.md#quick-start",
    "Why": "docs/engine.md#why",
    "Install": "docs/install.md#install",
    "The nodes": "docs/nodes.md#in-depth",
    "Tiled Attention Everywhere: every attention in the ComfyUI process":
        "docs/nodes.md#tiled-attention-everywhere-every-attention-in-the-comfyui-process",
    "How long per step": "docs/tuning.md#how-long-per-step",
    "Help pages and languages": "docs/nodes.md#help-pages-and-languages",
    "Bundled workflows": "docs/workflows.md#bundled-workflows",
    "What the demo shows": "docs/benchmarks.md#what-the-demo-shows",
    "Outside ComfyUI": "docs/engine.md#outside-comfyui-the-python-api",
    "Several GPUs": "docs/multi-gpu.md#several-gpus",
    "How it works": "docs/engine.md#how-it-works",
    "Benchmark": "docs/benchmarks.md#the-benchmark",
    "Per-device tuning": "docs/tuning.md#per-device-tuning",
    "Compared with the alternatives on these GPUs": "docs/engine.md#compared-with-the-alternatives-on-these-gpus",
    "Have an MI50, Vega or RDNA card? Send a report":
        "docs/troubleshooting.md#have-an-mi50-vega-or-rdna-card-send-a-report",
    "Troubleshooting on AMD": "docs/troubleshooting.md#troubleshooting-on-amd",
    "Limits": "docs/troubleshooting.md#limits",
    "Development": "docs/development.md#development",
    "Where things are": "docs/development.md#where-things-are",
}


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines; keep it at most 300 and move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_broken_link(page):
    assert not broken_links(page, ROOT), "\n".join(broken_links(page, ROOT))


@pytest.mark.parametrize("heading", sorted(OLD_README_SECTIONS))
def test_every_old_readme_section_has_a_place(heading):
    path, anchor = OLD_README_SECTIONS[heading].split("#")
    assert anchor in anchors((ROOT / path).read_text(encoding="utf-8")), (
        f"the old README's section '{heading}' was moved to {OLD_README_SECTIONS[heading]}, which is gone: "
        f"update OLD_README_SECTIONS to its new place")


def test_the_docs_link_every_page():
    """No page of docs/ is an orphan: each is linked from README.md or another page."""
    linked = "\n".join(p.read_text(encoding="utf-8") for p in PAGES)
    for page in (ROOT / "docs").glob("*.md"):
        assert f"{page.name})" in linked or f"{page.name}#" in linked, f"nothing links docs/{page.name}"


def test_nodes_md_is_the_help_pages():
    from tools import node_docs
    current = (ROOT / "docs" / "nodes.md").read_text(encoding="utf-8")
    assert node_docs.render(current) == current, (
        "docs/nodes.md's node reference differs from web/docs/<node id>.md: run python -m tools.node_docs")
    for node_id in node_docs.NODE_IDS:  # every English help page is in it, and nothing else is
        assert (ROOT / "web" / "docs" / f"{node_id}.md").is_file()
    assert sorted(node_docs.NODE_IDS) == sorted(p.stem for p in (ROOT / "web" / "docs").glob("*.md"))
