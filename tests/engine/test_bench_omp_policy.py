"""The benchmark's --omp-wait-policy: which OpenMP wait policy every case's fresh process gets (bench_run.child_env),
and that a case's process really runs under it (a real child reads its own environment)."""
import os
import subprocess
import sys

import pytest

from attention_core.cli import bench, bench_run


@pytest.mark.parametrize("user_env", [None, "ACTIVE"])
def test_policy_per_flag(monkeypatch, user_env):
    if user_env is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_env)
    # no flag: the user's variable wins, else PASSIVE
    assert bench_run.child_env("/r")["OMP_WAIT_POLICY"] == (user_env or "PASSIVE")
    assert bench_run.child_env("/r", "passive")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert bench_run.child_env("/r", "active")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "OMP_WAIT_POLICY" not in bench_run.child_env("/r", "default")  # OpenMP's own default runs
    assert os.environ.get("OMP_WAIT_POLICY") == user_env  # ours untouched
    assert bench_run.child_env("/r")["PYTHONPATH"].split(os.pathsep)[0] == "/r"
    with pytest.raises(ValueError, match="expected one of passive, active, default"):
        bench_run.child_env("/r", "spin")


def test_flag_parses_and_refuses_others(capsys):
    ap = bench.parser("")
    assert ap.parse_args(["--omp-wait-policy", "default"]).omp_wait_policy == "default"
    assert ap.parse_args([]).omp_wait_policy is None
    with pytest.raises(SystemExit):
        ap.parse_args(["--omp-wait-policy", "spin"])
    assert "invalid choice" in capsys.readouterr().err


def test_a_case_process_runs_under_the_policy(monkeypatch):
    """The real subprocess path: the child sees exactly the environment child_env builds for the case."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    real_run = subprocess.run

    def fake_run(cmd, **kw):  # the case's command swapped for one that prints the environment it got
        return real_run([sys.executable, "-c", "import json, os; print(json.dumps({'omp': "
                              "os.environ.get('OMP_WAIT_POLICY')}))"], capture_output=True, text=True, env=kw["env"])

    monkeypatch.setattr(bench_run.subprocess, "run", fake_run)
    for policy, want in (("default", None), ("passive", "PASSIVE"), (None, "ACTIVE")):
        got = bench_run._run_in_subprocess({"method": "chunked", "n": 1, "mode": "fwd", "omp_wait_policy": policy},
                                           timeout=60)
        assert got == {"omp": want}, policy
