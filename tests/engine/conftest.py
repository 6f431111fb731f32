"""Fixtures shared by the engine tests."""
import sys

import pytest

from attention_core import profiles


@pytest.fixture
def profdir(tmp_path, monkeypatch):
    """An empty per-user profile folder (tmp_path) as outside ComfyUI: no ComfyUI user folder, no
    TILED_ATTENTION_PROFILES / TILED_ATTENTION_LAYOUT switches, no cached profile before or after the test."""
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)  # not inside ComfyUI
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path))
    monkeypatch.delenv(profiles.ENV_SWITCH, raising=False)
    monkeypatch.delenv(profiles.ENV_LAYOUT, raising=False)
    profiles._cache.clear()
    yield tmp_path
    profiles._cache.clear()
