"""The per-test time limit (tests/support/time_limit.py), run in a child pytest on tests that hang: an infinite
loop and a wait on a lock nobody releases each fail by the limit while the session goes on to the next test; a test
that swallows every exception ends the process with exit status 1 a grace period later; a bad limit is refused by
name. Without the plugin these children would run until killed."""
import os
import subprocess
import sys
import textwrap
import time

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")


def run_child(tmp_path, body: str, limit: str, deadline: float = 120):
    path = tmp_path / "test_child.py"
    path.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=SUPPORT, TILED_ATTENTION_TEST_TIME_LIMIT=limit)
    env.pop("PYTEST_ADDOPTS", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "time_limit", "-p", "no:cacheprovider", "-q",
                           "-rf", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=deadline)
    return proc, time.monotonic() - t0


def test_hanging_tests_fail_by_the_limit_and_the_session_goes_on(tmp_path):
    proc, took = run_child(tmp_path, """
        import threading

        def test_loops_forever():
            n = 0
            while True:
                n += 1

        def test_waits_on_a_lock_nobody_releases():
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()

        def test_catches_exception_and_loops():
            while True:
                try:
                    sum(range(1000))
                except Exception:
                    pass

        def test_after_them():
            assert True
    """, limit="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "3 failed, 1 passed" in out, out
    assert out.count("TestTimeLimitExceeded") >= 3 and "TILED_ATTENTION_TEST_TIME_LIMIT" in out, out
    assert "test_child.py::test_loops_forever: ran past the per-test time limit of 2 s" in out, out
    assert took < 60, (took, out)


def test_a_test_that_swallows_the_limit_ends_the_process_after_the_grace(tmp_path):
    proc, took = run_child(tmp_path, """
        import time

        def test_swallows_everything():
            while True:
                try:
                    time.sleep(0.05)
                except BaseException:
                    pass
    """, limit="2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "ran past the per-test time limit" in out and "Timeout" in out, out  # then faulthandler's own dump
    assert took < 60, (took, out)


def test_a_quick_test_is_untouched_and_a_late_signal_is_dropped(tmp_path):
    proc, _ = run_child(tmp_path, """
        import os, signal, time

        def test_quick():
            time.sleep(0.1)

        def test_a_stray_sigusr2_outside_a_limit_is_ignored():
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.1)
    """, limit="5")
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("bad", ["soon", "-1", "inf", "nan"])
def test_a_bad_limit_is_refused_by_name(tmp_path, bad):
    proc, _ = run_child(tmp_path, "def test_x():\n    pass\n", limit=bad)
    assert proc.returncode != 0
    assert f"TILED_ATTENTION_TEST_TIME_LIMIT={bad!r}" in proc.stderr and "seconds" in proc.stderr, proc.stderr


def test_zero_turns_it_off(tmp_path):
    proc, took = run_child(tmp_path, "import time\n\ndef test_x():\n    time.sleep(3)\n", limit="0")
    assert proc.returncode == 0 and took >= 3, proc.stdout + proc.stderr
