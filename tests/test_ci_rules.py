"""The suite's own rule: under CI=true a skip fails unless it says why it cannot apply (tests/conftest.py)."""
import os
import shutil
import subprocess
import sys

PROBE = '''
import pytest
def test_missing_tool(): pytest.skip("no chromium")
def test_cannot_apply(): pytest.skip("not applicable: ComfyUI 0.3.75 has no attention registry")
def test_passes(): pass
'''


def run_probe(tmp_path, ci):
    shutil.copy(os.path.join(os.path.dirname(__file__), "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.path.join(os.path.dirname(__file__), "support")  # the conftest's plugins (time_limit)
    if ci:
        env["CI"] = "true"
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_missing_prerequisite_fails_under_ci(tmp_path):
    assert run_probe(tmp_path, ci=True).startswith("1 failed, 1 passed, 1 skipped")


def test_missing_prerequisite_skips_outside_ci(tmp_path):
    assert run_probe(tmp_path, ci=False).startswith("1 passed, 2 skipped")
