"""Test-session setup: the repository root (for `tools`, `attention_core`) and tests/support on sys.path, and the
CI rule that nothing skips silently; tuned tile profiles of this machine kept out of the tests; a time limit per
test (tests/support/time_limit.py: a hanging test fails instead of stopping the suite).

Under CI=true a skipped test fails unless its reason starts with "not applicable" (a case that cannot apply, e.g. a
feature the older ComfyUI does not have): a skip for a missing tool, server or data file is a failure there.
"""
import atexit
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "tests", "support")):
    if path not in sys.path:
        sys.path.insert(0, path)

# tuned tile profiles of this machine (python -m attention_core.tune) must not steer the tests' `auto` calls; the
# empty folder made for that is removed when the session ends
if "TILED_ATTENTION_PROFILE_DIR" not in os.environ:
    os.environ["TILED_ATTENTION_PROFILE_DIR"] = tempfile.mkdtemp(prefix="tiled-attention-profiles-")
    atexit.register(shutil.rmtree, os.environ["TILED_ATTENTION_PROFILE_DIR"], ignore_errors=True)

pytest_plugins = ["time_limit"]  # tests/support/time_limit.py, on sys.path above

ALLOWED_SKIP_PREFIX = "not applicable"


def _under_ci():
    return os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (_under_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(ALLOWED_SKIP_PREFIX):
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true: {reason}\n(only skips whose reason starts with "
                           f"'{ALLOWED_SKIP_PREFIX}' are allowed in CI)")
