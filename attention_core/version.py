"""The pack's version, from one place: `pyproject.toml`'s `[project] version`.

In a checkout or an installed ComfyUI pack the file stands next to this package and is read (a line scan: Python
3.10 has no tomllib); in an installed wheel it is absent and the version is the package metadata's, which the build
took from the same line. `VERSION` is "unknown" only where neither exists (a copied folder without its pyproject).
"""
from __future__ import annotations

import os
import re

PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
DISTRIBUTION = "tiled-attention"


def from_pyproject(path: str = PYPROJECT) -> str | None:
    """The `version = "..."` of the `[project]` table of `path`, or None (no file, no such line)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    table = None
    for line in text.splitlines():
        head = re.match(r"\s*\[([^\]]+)\]\s*$", line)
        if head:
            table = head.group(1).strip()
            continue
        found = re.match(r'\s*version\s*=\s*"([^"]+)"', line)
        if table == "project" and found:
            return found.group(1)
    return None


def from_metadata() -> str | None:
    """The installed distribution's version (a wheel), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version(DISTRIBUTION)
    except (ImportError, PackageNotFoundError):
        return None


VERSION = from_pyproject() or from_metadata() or "unknown"
