"""Fixtures shared by the in-process ComfyUI tests."""
import pytest

from comfy_harness import load_pack


@pytest.fixture(scope="module")
def pack():
    """This repository loaded as ComfyUI loads a custom node folder (skips, or fails under CI, without ComfyUI)."""
    return load_pack()
