"""The pack's version, written in one place (pyproject.toml's [project] version) and read from there.

version() looks for the pyproject.toml beside the attention_core folder (a clone or a ComfyUI custom_nodes folder
of the pack: the file whose [project] name is tiled-attention), else asks the installed distribution's metadata
(`pip install` of the wheel, which setuptools built from that file); "0+unknown" when neither is there. Cached.
"""
from __future__ import annotations

import functools
import os
import re

DIST_NAME = "tiled-attention"
UNKNOWN = "0+unknown"
PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "pyproject.toml")


def from_pyproject(text: str):
    """[project] version of a pyproject.toml's text when its [project] name is tiled-attention, else None (read with
    a pattern: tomllib is Python >= 3.11 and the engine runs on 3.10)."""
    project = re.search(r"(?ms)^\[project\][ \t]*$(.*?)(?=^\[|\Z)", text)
    if not project:
        return None
    body = project.group(1)
    name = re.search(r'(?m)^name\s*=\s*"([^"]+)"', body)
    version = re.search(r'(?m)^version\s*=\s*"([^"]+)"', body)
    if not (name and version) or name.group(1) != DIST_NAME:
        return None
    return version.group(1)


@functools.lru_cache(maxsize=1)
def version() -> str:
    try:
        with open(PYPROJECT, encoding="utf-8") as f:
            found = from_pyproject(f.read())
        if found:
            return found
    except OSError:
        pass
    try:
        from importlib.metadata import PackageNotFoundError, version as dist_version
        return dist_version(DIST_NAME)
    except (ImportError, PackageNotFoundError):
        return UNKNOWN
