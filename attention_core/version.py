"""The pack's version, written in one place: `pyproject.toml`'s `[project] version`, read from there when asked.

version() reads the pyproject.toml beside the attention_core folder (a clone, or the pack in ComfyUI's
custom_nodes: the file whose [project] name is tiled-attention), else the installed distribution's metadata (`pip
install` of the wheel, which setuptools built from that same line); "0+unknown" when neither is there. Cached; nothing
is read at import. Standard library only (the release tests load this file without torch).
"""
from __future__ import annotations

import functools
import os
import re

DIST_NAME = "tiled-attention"
UNKNOWN = "0+unknown"
PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def from_pyproject(path: str | None = None) -> str | None:
    """The [project] version of the pyproject.toml at `path` (default: the pack's) when its [project] name is
    tiled-attention, else None (no file, no such table, another project's file). A pattern, not tomllib: the engine
    runs on Python 3.10."""
    try:
        with open(path or PYPROJECT, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    project = re.search(r"(?ms)^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text)
    if not project:
        return None
    name = re.search(r'(?m)^name\s*=\s*"([^"]+)"', project.group(1))
    found = re.search(r'(?m)^version\s*=\s*"([^"]+)"', project.group(1))
    if not (name and found) or name.group(1) != DIST_NAME:
        return None
    return found.group(1)


def from_metadata() -> str | None:
    """The installed distribution's version (a wheel), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version
        return dist_version(DIST_NAME)
    except (ImportError, PackageNotFoundError):
        return None


@functools.lru_cache(maxsize=1)
def version() -> str:
    """The pack's version: the pyproject.toml's, else the metadata's, else UNKNOWN."""
    return from_pyproject() or from_metadata() or UNKNOWN
