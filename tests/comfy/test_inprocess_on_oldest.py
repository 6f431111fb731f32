"""The in-process ComfyUI tests (files marked `comfy_inprocess`) once more, against the oldest supported ComfyUI.

A process can import one ComfyUI, and this session imports the newest (0.33.0); so this test runs those files in a
child pytest that imports the stock 0.3.75 (TILED_ATTENTION_TEST_COMFYUI), and fails with the child's report when
any of them fails there."""
import os
import re
import subprocess
import sys

import pytest

from comfy_harness import missing
from tools.comfyui_setup.comfyui import INPROCESS_ENV, OLDEST, ROOT, comfy_path, inprocess_version

TESTS = os.path.join(ROOT, "tests")


def test_inprocess_comfy_tests_pass_on_oldest_comfyui():
    if inprocess_version() == OLDEST:
        pytest.skip(f"not applicable: this session already imports ComfyUI {OLDEST}")
    if comfy_path(OLDEST) is None:
        missing(f"ComfyUI {OLDEST} is not set up: run ./dev test")
    env = dict(os.environ, **{INPROCESS_ENV: OLDEST})
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", os.path.join(TESTS, "pytest.ini"), "--rootdir", TESTS,
           "-m", "comfy_inprocess", os.path.join(TESTS, "comfy")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, f"in-process tests on ComfyUI {OLDEST} failed:\n{report}"
    assert re.search(r"\d+ passed", summary) and "failed" not in summary, report
