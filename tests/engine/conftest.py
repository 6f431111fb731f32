"""Fixtures shared by the engine tests.

Nothing from attention_core is imported at this module's top: pytest loads conftest files before plugins start
(tools/mutate.py's coverage run among them), and a module imported here would have its import-time lines (the
constants) attributed to no test at all."""
import sys

import pytest


@pytest.fixture
def profdir(tmp_path, monkeypatch):
    """An empty per-user profile folder (tmp_path) as outside ComfyUI: no ComfyUI user folder, no
    TILED_ATTENTION_PROFILES / TILED_ATTENTION_LAYOUT switches, no cached profile before or after the test."""
    from attention_core import profiles
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)  # not inside ComfyUI
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(profiles.ENV_SWITCH, raising=False)
    monkeypatch.delenv(profiles.ENV_LAYOUT, raising=False)
    profiles._cache.clear()
    yield tmp_path
    profiles._cache.clear()
