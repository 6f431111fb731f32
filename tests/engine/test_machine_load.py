"""attention_core.device.machine_load (other processes' runnable threads while something is timed) and the guard it
gives bench, tune, calibrate and tools.measure.predict_step: every figure names its load, and on a busy machine nothing
is saved unless --force-busy (then the file records the load). The readings are faked here (a /proc folder written by
the test, or a stand-in reading function): no test depends on what else runs on the machine."""
import json
import os

import pytest

from attention_core.cli import bench, bench_run, calibrate, tune
from attention_core.device import calibration, machine_load, profiles

CORES = os.cpu_count() or 1


def stat(pid, state, ppid, comm="python"):
    return f"{pid} ({comm}) {state} {ppid} 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 100 0 0\n"


@pytest.fixture
def fake_proc(tmp_path):
    """A /proc: 7 threads runnable in all; this run's process 100 (threads: 2 runnable, 1 sleeping), its child 101
    (1 runnable, a command name with spaces and parentheses) and grandchild 102 (1 runnable, 1 sleeping); an
    unrelated process 200 (2 runnable) and 300 (sleeping)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "loadavg").write_text("2.50 2.10 1.70 7/312 4242\n")
    (proc / "self").mkdir()  # not a process folder: ignored
    tree = {100: (1, ["R", "R", "S"], "python"), 101: (100, ["R"], "a (weird) name"), 102: (101, ["R", "S"], "sh"),
            200: (1, ["R", "R"], "busy"), 300: (1, ["S"], "idle")}
    for pid, (ppid, states, comm) in tree.items():
        (proc / str(pid) / "task").mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(stat(pid, states[0], ppid, comm))
        for i, st in enumerate(states):
            (proc / str(pid) / "task" / str(pid + i)).mkdir()
            (proc / str(pid) / "task" / str(pid + i) / "stat").write_text(stat(pid + i, st, ppid, comm))
    return str(proc)


def test_others_runnable_counts_other_processes_threads_directly(fake_proc, monkeypatch):
    """Every process's threads in state R except this process tree's, counted in one scan (issue 38.7: not
    /proc/loadavg's total less ours read later, which counted our threads that went to sleep in between as
    others'); /proc/loadavg (7 running, one more than the threads in state R) is not read at all."""
    monkeypatch.undo()  # the real reading, not conftest.quiet_machine's stand-in
    assert machine_load.own_tree(100, proc=fake_proc) == {100, 101, 102}
    assert machine_load.own_tree(101, proc=fake_proc) == {101, 102}
    monkeypatch.setattr(os, "getpid", lambda: 100)
    assert machine_load.others_runnable(proc=fake_proc) == 2           # 200's two; ours: 100: 2, 101: 1, 102: 1
    assert machine_load.runnable_by_process(proc=fake_proc) == ({200: 2}, {100: 2, 101: 1, 102: 1})
    assert machine_load.others_runnable([200], proc=fake_proc) == 4    # only 200's two threads as ours
    assert machine_load.others_runnable([999], proc=fake_proc) == 6    # a process that ended counts nothing
    os.remove(os.path.join(fake_proc, "loadavg"))
    assert machine_load.others_runnable(proc=fake_proc) == 2           # not needed
    assert machine_load.others_runnable(proc=os.path.join(fake_proc, "nothing")) is None  # no /proc: unknown
    assert machine_load.own_tree(100, proc=os.path.join(fake_proc, "nothing")) == set()


def _spinners(n, detached=False):
    """n real processes that keep one thread runnable each (a busy loop); detached: re-parented away from this
    process (a double fork: the spinner's parent exits), so they are other processes as an unrelated program's
    are. Returns (the spinners' pids, a function that ends them)."""
    import signal
    import subprocess
    import sys
    code = ("import os, sys, time\n"
            "if %r and os.fork():\n    os._exit(0)\n"
            "print(os.getpid(), flush=True)\n"
            "end = time.time() + 120\n"  # never outlives a failed test by long
            "while time.time() < end:\n    pass\n") % detached
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    pids = [int(p.stdout.readline()) for p in procs]
    if detached:  # the spinner can print before its parent has exited: wait for that exit (it re-parents the spinner)
        for p in procs:
            p.wait(timeout=60)

    def stop():
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
    return pids, stop


def _readings(n, fn):
    import time
    out = []
    for _ in range(n):
        out.append(fn())
        time.sleep(0.05)
    return out


def test_real_spinning_processes_are_counted_as_others_and_our_children_are_not(monkeypatch):
    """Real processes, counted in the real /proc: two spinning children of this process are runnable in nearly
    every reading and are never another process's (our tree is left out); the same two detached (their parent
    exited, as an unrelated program's) are counted as others in nearly every reading. Robust on a loaded machine:
    only the spinners' own pids are looked at, whatever else runs."""
    monkeypatch.undo()
    pids, stop = _spinners(2)
    try:
        assert machine_load.own_tree() >= set(pids)
        scans = _readings(20, machine_load.runnable_by_process)
        assert all(not set(pids) & set(others) for others, _ in scans)          # never others'
        assert sum(sum(ours.get(p, 0) for p in pids) == 2 for _, ours in scans) >= 15  # runnable: ours
    finally:
        stop()
    pids, stop = _spinners(2, detached=True)
    try:
        assert not machine_load.own_tree() & set(pids)
        scans = _readings(20, machine_load.runnable_by_process)
        assert sum(sum(others.get(p, 0) for p in pids) == 2 for others, _ in scans) >= 15
        assert sum(n >= 2 for n in _readings(10, machine_load.others_runnable)) >= 7  # in the total too
    finally:
        stop()


def test_the_verdict_on_a_real_competing_process_with_our_own_work_left_out(monkeypatch):
    """The busy verdict (Monitor.summary, and the demo's demo_summary.busy_reason) from the direct count, with
    "others" being the processes this test controls: our own busy child (as the demo's server) never makes the
    machine busy; one detached spinner per core (a real competing program) does. The readings count only the
    processes this test started, so the load of whatever else runs on the machine cannot change the verdict."""
    monkeypatch.undo()
    from tools.demo import demo_summary
    cores = machine_load.cores()

    def mine(spinners):  # other processes' runnable threads, among the ones this test started
        def read():
            got = machine_load.runnable_by_process()
            return sum(n for pid, n in got[0].items() if pid in spinners)
        return read
    own, stop = _spinners(cores)                # our busy children: left out
    try:
        m = machine_load.Monitor(source=mine(set(own)), n_cores=cores)
        for _ in range(10):
            m.read()
        assert not m.busy and m.summary()["mean"] == 0
        assert demo_summary.busy_reason(cores, None, m.samples) is None
    finally:
        stop()
    other, stop = _spinners(cores, detached=True)  # a competing program: one runnable thread per core
    try:
        m = machine_load.Monitor(source=mine(set(other)), n_cores=cores)
        for _ in range(10):
            m.read()
        assert m.busy, m.samples
        assert "other processes kept" in demo_summary.busy_reason(cores, None, m.samples)
    finally:
        stop()


def test_monitor_spans_laps_and_summary():
    readings = iter([0, 1, 3, 0, 2, None])
    m = machine_load.Monitor(period=3600, source=lambda: next(readings), n_cores=8)
    with m:
        with m.span("a") as a:
            pass                       # one reading as it ends: 0
        assert a.samples == [0] and m.figures["a"] is a
        assert m.lap().samples == []   # starts the first lap
        m.read()                       # a reading inside the lap (what the background thread does): 1
        lap = m.lap()                  # ends it with one more: 3
        assert lap.samples == [1, 3] and lap.text() == "others 2.0 (max 3)"
        with m.span() as b:
            m.read()                   # inside both the span and the running lap: 0
        assert b.samples == [0, 2] and b.mean == 1.0 and b.text() == "others 1.0 (max 2)"
        m.read()                       # unknown: not counted
    s = m.summary()
    assert s == {"mean": 1.2, "max": 3, "samples": 5, "cores": 8, "threshold": 2.0, "busy": False,
                 "forced": False}
    assert machine_load.figure_text(None) == "others ?" and machine_load.figure_text(0.0, 0) == "others 0.0"


@pytest.mark.parametrize("readings,busy", [([0, 1, 0, 1], False),     # 0.5 of 2 cores: at the threshold
                                           ([1, 1, 0, 1], True),      # 0.75 > 0.5
                                           ([None, None], False),     # unknown: never refuses
                                           ([4], True)])
def test_busy_above_a_quarter_of_the_cores_on_average(readings, busy):
    it = iter(readings)
    m = machine_load.Monitor(source=lambda: next(it), n_cores=2)
    for _ in readings:
        m.read()
    s = m.summary()
    assert s["busy"] == busy and s["threshold"] == 0.5
    refused = machine_load.refusal(s, "the profile")
    assert (refused is not None) == busy
    if busy:
        assert f"{s['mean']:.2f} threads runnable on average" in refused and "threshold 0.5" in refused
        assert "--force-busy" in refused and "the profile not saved" in refused
    forced = machine_load.Monitor(source=lambda: 4, n_cores=2, force=True)
    forced.read()
    assert forced.summary()["forced"] and machine_load.refusal(forced.summary(), "x") is None


def test_the_background_thread_samples_only_while_a_figure_runs():
    import threading
    seen = threading.Event()
    m = machine_load.Monitor(period=0.001, source=lambda: seen.set() or 0, n_cores=2)
    with m:
        assert not seen.wait(0.05)     # no figure open: no reading
        with m.span() as s:
            assert seen.wait(60)       # a figure open: the thread reads
    assert len(s.samples) >= 2         # the thread's reading(s) and the one at the end


def test_load_objects_are_accepted_by_the_profile_and_calibration_validators():
    good = {"mean": 0.25, "max": 1, "samples": 12, "cores": 2, "threshold": 0.5, "busy": False, "forced": False}
    assert machine_load.load_problem(good) is None
    assert machine_load.load_problem(dict(good, mean=None, max=None, samples=0)) is None
    for bad, word in ((dict(good, mean=-1), "mean"), (dict(good, cores=0), "cores"), (dict(good, busy="no"), "busy"),
                      (dict(good, threshold="x"), "threshold"), ([1], "list"), (dict(good, samples=1.5), "samples")):
        assert word in machine_load.load_problem(bad)
    prof = {"version": profiles.PROFILE_VERSION, "entries": [], "load": good}
    assert profiles.validate_profile(prof) == (prof, [])
    kept, problems = profiles.validate_profile(dict(prof, load="busy"))
    assert "load" not in kept and problems == ["'load' is str, not an object; dropped"]
    calib = {"version": calibration.VERSION, "device": "d", "date": "x", "dtype": "fp32",
             "attention": {"pack": [{"tokens": 1024, "gflops": 1.0}]}, "gemm": [{"n": 512, "gflops": 1.0}]}
    assert calibration.validate(dict(calib, load=good)) is None
    assert calibration.validate(dict(calib, load=dict(good, cores=-2))) == "'load' cores -2 is not a whole number >= 1"


# ---------------------------------------------------------------------------------- the commands' guard
def busy(monkeypatch):
    monkeypatch.setattr(machine_load, "others_runnable", lambda pids=None, proc=None: CORES)


TINY_TUNE = ["--device", "cpu", "--dtype", "float32", "--presets", "reference", "--max-n", "512", "--rows", "64",
             "--repeats", "1"]


def one_error(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: machine busy: "), err
    assert f"threshold {CORES / 4:g}" in lines[0] and "--force-busy" in lines[0]
    return lines[0]


def test_tune_refuses_a_profile_measured_busy_and_forced_records_the_load(profdir, monkeypatch, capsys):
    busy(monkeypatch)
    out = profdir / "p.json"
    assert tune.main(TINY_TUNE + ["--out", str(out)]) == 2
    text, err = capsys.readouterr()
    assert "the profile not saved" in one_error(err) and not out.exists()
    figures = [ln for ln in text.splitlines() if " ms" in ln]
    assert figures and all(ln.endswith(f"(others {CORES:.1f})") for ln in figures)  # each figure names its load
    assert tune.main(TINY_TUNE + ["--out", str(out), "--force-busy"]) == 0
    load = json.loads(out.read_text())["load"]
    assert load["busy"] and load["forced"] and load["mean"] == CORES and load["threshold"] == CORES / 4


def test_tune_quiet_saves_with_the_load(profdir, capsys):
    out = profdir / "p.json"
    assert tune.main(TINY_TUNE + ["--out", str(out)]) == 0
    load = json.loads(out.read_text())["load"]
    assert load["mean"] == 0 and not load["busy"] and not load["forced"] and load["samples"] >= 1


def test_calibrate_prints_the_rates_and_refuses_to_save_them_busy(tmp_path, monkeypatch, capsys):
    def measure(device, dtype, model, comfyui=None, monitor=None):
        with monitor.span(("pack", 1024)):
            pass
        return {"version": 1, "device": "Test CPU (x86_64)", "dtype": dtype, "model": model, "date": "today",
                "attention": {"pack": [{"tokens": 1024, "gflops": 12.34}]}, "gemm": [{"m": 1, "k": 2, "n": 3,
                                                                                      "gflops": 5.0}]}
    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    busy(monkeypatch)
    out = tmp_path / "c.json"
    assert calibrate.main(["--out", str(out)]) == 2
    text, err = capsys.readouterr()
    assert "the calibration not saved" in one_error(err) and not out.exists()
    assert f"N 1024: 12.3 (others {CORES:.1f})" in text and "-> not saved" in text  # the rates are not lost
    assert calibrate.main(["--out", str(out), "--force-busy"]) == 0
    saved = calibration.load(str(out))
    assert saved["load"]["forced"] and saved["load"]["mean"] == CORES


def test_bench_refuses_json_measured_busy(tmp_path, monkeypatch, capsys):
    def fake_case(case, timeout):
        return {k: case[k] for k in ("method", "n", "mode", "heads", "dim", "batch", "dtype", "device")} | {
            "repeats": 1, "ms": 12.0, "peak_mb": 3.0}
    monkeypatch.setattr(bench_run, "_run_in_subprocess", fake_case)
    argv = ["--n", "64", "--heads", "2", "--dim", "8", "--mode", "fwd", "--methods", "chunked", "--no-ref",
            "--device", "cpu", "--json", str(tmp_path / "b.json")]
    busy(monkeypatch)
    assert bench.main(argv) == 2
    text, err = capsys.readouterr()
    assert "--json not saved" in one_error(err) and not (tmp_path / "b.json").exists()
    assert f"12 ms, 3 MB, err -   (others {CORES:.1f}, load " in text      # the figure and its load
    assert "chunked" in text.split("forward  (ms")[1]                        # the table is printed
    assert bench.main(argv + ["--force-busy"]) == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["info"]["load"]["forced"] and data["results"][0]["others"] == {"mean": CORES, "max": CORES}
    # run by ./dev (from the clone), a relative --json is the caller's: $TILED_ATTENTION_CALLER_CWD
    monkeypatch.setenv("TILED_ATTENTION_CALLER_CWD", str(tmp_path))
    assert bench.main(argv[:-1] + ["rel.json", "--force-busy"]) == 0 and (tmp_path / "rel.json").is_file()


def test_predict_step_refuses_to_log_a_busy_measurement(tmp_path, monkeypatch, capsys):
    import torch

    from tools.measure import predict_step

    class Block(torch.nn.Module):  # a stand-in block: the guard, not the model, is under test
        def forward(self, x, context, e, attention):
            return x + 1
    monkeypatch.setattr(predict_step, "WanBlock", Block)
    cal = tmp_path / "cal.json"
    calibration.save({"version": 1, "device": "Test CPU (x86_64)", "dtype": "fp32", "date": "today",
                      "attention": {"pack": [{"tokens": 1024, "gflops": 10.0}]},
                      "gemm": [{"m": 512, "k": 3072, "n": 3072, "gflops": 100.0},
                               {"m": 512, "k": 3072, "n": 14336, "gflops": 100.0}]}, str(cal))
    log = tmp_path / "log.md"
    argv = ["--blocks", "1", "--tokens", "16", "--methods", "pack", "--calibration", str(cal), "--batch", "1",
            "--log", str(log)]
    busy(monkeypatch)
    assert predict_step.main(argv) == 2
    text, err = capsys.readouterr()
    assert f"--log {log} not saved" in one_error(err) and not log.exists()
    assert text.splitlines()[-1].endswith(f"| others {CORES:.1f} |")
    assert predict_step.main(argv + ["--force-busy"]) == 0
    assert "MACHINE BUSY, logged anyway (--force-busy)" in log.read_text()
