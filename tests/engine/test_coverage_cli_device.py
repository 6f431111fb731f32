"""The user-visible cases behind lines of the device layer (detection, jsonfile, machine_load) and of the command
lines (calibrate, cli_args, plan, report, selfcheck, tune) that no other in-process test ran (issue 22, item 11: a
mutant on a line no test runs always survives). Each test asserts what the line does: the verdict, the text, the
value, the file. GPU-only lines run with stand-ins for torch.cuda's answers (as tests/engine/test_detection.py
does); the `python -m attention_core.X` entry lines run in this process through runpy."""
import errno
import math
import os
import runpy
import sys
import types
import warnings

import pytest
import torch

import attention_core.device.detection as detection
from attention_core.cli import calibrate, cli_args, plan, report, selfcheck
from attention_core.device import jsonfile, machine_load


# ------------------------------------------------------------------------------------------------ detection
def test_the_report_as_a_dict_and_as_text_names_the_compute_capability_and_the_override(monkeypatch):
    """An NVIDIA sm_86 report: as_dict() (what the nodes serialise) holds every field; text() (what the self-check
    and the report print) has the compute capability line, and an override line when TILED_ATTENTION forces it."""
    r = detection.report_from_properties("cuda:0", "RTX 3090", hip=False, major=8, minor=6, fused_backends=["flash"])
    assert r.as_dict() == {"device": "cuda:0", "name": "RTX 3090", "vendor": "nvidia", "arch": None, "gfx": None,
                           "sm": "8.6", "bf16_hardware": True, "fused_backends": ["flash"], "probed": True,
                           "known_no_fused": False, "needs_tiled_attention": False,
                           "reason": "torch's flash attention runs", "override": None}
    assert r.text() == ("device: cuda:0\nname: RTX 3090\nvendor: nvidia\ncompute capability: 8.6\nbf16 hardware: yes\n"
                        "fused SDPA backends that run: flash\nneeds tiled attention: no\n"
                        "why: torch's flash attention runs")
    monkeypatch.setenv(detection.ENV_VAR, "force")
    forced = detection._apply_override(r)
    assert forced.text().splitlines()[-2:] == ["why: torch's flash attention runs; forced on by TILED_ATTENTION",
                                               "override: TILED_ATTENTION=force"]
    assert forced.needs_tiled_attention and forced.as_dict()["override"] == "force"


def test_no_arch_name_has_no_gfx():
    """A ROCm device whose properties carry no gcnArchName (None or ''): no gfx, so no arch-table verdict."""
    assert detection.gfx_of(None) is None and detection.gfx_of("") is None
    assert detection.gfx_of("gfx906:sramecc+:xnack-") == "gfx906"


def test_the_default_device_is_the_current_accelerator_else_the_cpu(monkeypatch):
    """detect() with no device (the nodes' default): the current CUDA/ROCm device when there is one (cuda:N with its
    index, so that the cache and the report name it), else the CPU; "cuda" alone is the current device too."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert detection._device_of(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert detection._device_of(None) == torch.device("cuda", 2)
    assert detection._device_of("cuda") == torch.device("cuda", 2)
    assert detection._device_of("cuda:1") == torch.device("cuda", 1)


def test_a_fused_kernel_that_raises_is_left_out_and_the_probe_goes_on(monkeypatch):
    """A fused backend that cannot run here (raises, as flash does on an arch it was not built for) is not in the
    probe's list; the backends after it are still probed."""
    def broken(q):
        raise RuntimeError("no kernel image is available for execution on the device")

    def math_sdpa(q):
        return torch.softmax((q @ q.transpose(-1, -2)) / 8.0, dim=-1) @ q
    monkeypatch.setattr(detection, "_fused_ops", lambda device: {"flash": broken, "efficient": math_sdpa,
                                                                 "cudnn": broken})
    assert detection.probe_fused_backends(torch.device("cpu")) == ["efficient"]


def test_bf16_hardware_on_nvidia_is_sm80_and_up_and_elsewhere_yes(monkeypatch):
    """bf16_hardware: an NVIDIA GPU (CUDA torch, no HIP) computes bf16 natively from sm_80 (Ampere) on; the CPU and
    other non-CUDA devices count as yes."""
    props = {0: types.SimpleNamespace(name="RTX 2080", major=7, minor=5),
             1: types.SimpleNamespace(name="RTX 3090", major=8, minor=6),
             2: types.SimpleNamespace(name="A100", major=8, minor=0)}
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props[torch.device(d).index])
    assert [detection.bf16_hardware(f"cuda:{i}") for i in range(3)] == [False, True, True]
    assert detection.bf16_hardware("cpu") is True


def test_a_probe_that_cannot_run_falls_back_to_not_probed(monkeypatch):
    """The probe itself failing (the device unusable for it) is not a crash: the report says it was not probed and
    no fused backend was found."""
    def failing(d):
        raise RuntimeError("HIP error: invalid device function")
    monkeypatch.setattr(detection, "probe_fused_backends", failing)
    r = detection._build_report(torch.device("cpu"), probe=True)
    assert (r.probed, r.fused_backends, r.needs_tiled_attention) == (False, [], True)
    assert r.reason == "no fused SDPA backend runs on the CPU"
    assert r.text().splitlines()[4] == "fused SDPA backends that run: none (not probed)"


# ------------------------------------------------------------------------------------------------- jsonfile
def test_a_failed_write_whose_temporary_file_is_already_gone_raises_the_write_error(tmp_path, monkeypatch):
    """When serialising fails and the temporary file cannot be removed (already gone), the caller gets the write's
    own error, not the clean-up's, and the old file is left as it was."""
    path = tmp_path / "a.json"
    path.write_text('{"n": 1}')

    def gone(p, *a, **k):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", p)
    monkeypatch.setattr(jsonfile.os, "unlink", gone)
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonfile.atomic_write_json(str(path), {"n": object()})
    monkeypatch.undo()
    assert path.read_text() == '{"n": 1}'


def _ok(obj):
    return obj, []


def test_a_file_that_vanishes_between_stat_and_open_is_no_file(tmp_path, monkeypatch, caplog):
    """Removed between the stat and the open (another process replacing a profile): as if missing, no warning."""
    path = tmp_path / "a.json"
    path.write_text('{"n": 1}')
    real_open = os.open

    def vanishing(p, *a, **k):
        if p == str(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", p)
        return real_open(p, *a, **k)
    monkeypatch.setattr(jsonfile.os, "open", vanishing)
    assert jsonfile.read_json_validated(str(path), _ok) == (None, None, [])
    with caplog.at_level("WARNING"):
        assert jsonfile.load_json_validated(str(path), _ok, {}) is None
    assert caplog.records == []


def test_a_file_replaced_by_a_pipe_after_the_stat_is_not_read(tmp_path, monkeypatch):
    """A regular file at the stat, a FIFO by the open (the path replaced in between): what was opened is checked,
    and it is reported, never read (a blocking read would hang the caller)."""
    path, fifo = tmp_path / "a.json", tmp_path / "fifo"
    path.write_text('{"n": 1}')
    os.mkfifo(fifo)
    real_open = os.open
    monkeypatch.setattr(jsonfile.os, "open", lambda p, *a, **k: real_open(str(fifo) if p == str(path) else p, *a, **k))
    key, value, problems = jsonfile.read_json_validated(str(path), _ok)
    assert key is not None and value is None
    assert problems == ["not a regular file (a pipe, socket or device), not a JSON file"]


def test_a_file_that_grows_past_the_limit_while_read_is_not_used(tmp_path, monkeypatch):
    """A file at most MAX_BYTES when opened that grows past it while read (a writer appending): not used, said so;
    one of exactly MAX_BYTES is read."""
    monkeypatch.setattr(jsonfile, "MAX_BYTES", 2 << 20)
    path = tmp_path / "a.json"
    exact = b'{"n": "' + b"x" * ((2 << 20) - 9) + b'"}'
    path.write_bytes(exact)
    assert len(exact) == 2 << 20
    key, value, problems = jsonfile.read_json_validated(str(path), _ok)
    assert problems == [] and len(value["n"]) == (2 << 20) - 9
    path.write_bytes(b"[" + b" " * (1 << 20))
    real_fstat = os.fstat

    def growing(fd):
        st = real_fstat(fd)
        if os.path.samestat(st, os.stat(path)):
            with open(path, "ab") as f:
                f.write(b" " * (2 << 20))  # after the size check: the read sees more than the limit
        return st
    monkeypatch.setattr(jsonfile.os, "fstat", growing)
    key, value, problems = jsonfile.read_json_validated(str(path), _ok)
    assert key is not None and value is None
    assert problems == ["larger than the 2 MB such a file can be; not read"]


def test_a_read_error_is_reported_not_raised(tmp_path, monkeypatch):
    """An I/O error while reading (a failing disk, a network file system gone): the file is reported as unreadable
    with the system's reason, no exception."""
    path = tmp_path / "a.json"
    path.write_text('{"n": 1}')

    def failing(fd, n):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(jsonfile.os, "read", failing)
    key, value, problems = jsonfile.read_json_validated(str(path), _ok)
    monkeypatch.undo()
    assert key == jsonfile._key(os.stat(path)) and value is None
    assert problems == ["cannot be read (Input/output error)"]


# --------------------------------------------------------------------------------------------- machine_load
def _proc_entry(folder, pid, state, ppid):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stat").write_text(f"{pid} (python) {state} {ppid} 1 1 0 -1 4194560 0 0 0 0\n")


def test_processes_and_threads_that_end_while_proc_is_read_are_skipped(tmp_path, monkeypatch):
    """/proc changes while it is read: a process or thread that ended (no stat file) or an entry that cannot be
    parsed is skipped, and the entries listed after it still count."""
    monkeypatch.undo()  # the real reading, not conftest.quiet_machine's stand-in
    proc = tmp_path / "proc"
    (proc / "5").mkdir(parents=True)                 # ended: its folder is there, its stat is not
    (proc / "6").mkdir()
    (proc / "6" / "stat").write_text("garbage")      # no ')': IndexError
    (proc / "7").mkdir()
    (proc / "7" / "stat").write_text("7 (x) S notapid 1\n")  # ValueError
    for pid, ppid in ((100, 1), (101, 100), (102, 101)):
        _proc_entry(proc / str(pid), pid, "R", ppid)
    task = proc / "100" / "task"
    (task / "50").mkdir(parents=True)                # a thread that ended
    (task / "51").mkdir()
    (task / "51" / "stat").write_text("")            # emptied: IndexError
    _proc_entry(task / "100", 100, "R", 1)
    _proc_entry(task / "101", 101, "R", 1)
    _proc_entry(task / "102", 102, "S", 1)
    order = {str(proc): ["5", "6", "7", "100", "101", "102"], str(task): ["50", "51", "100", "101", "102"]}
    real_listdir = os.listdir
    monkeypatch.setattr(machine_load.os, "listdir", lambda p: order.get(str(p)) or real_listdir(p))
    assert machine_load.own_tree(100, proc=str(proc)) == {100, 101, 102}
    assert machine_load._runnable_threads(100, str(proc)) == 2


def test_a_monitor_is_busy_above_a_quarter_of_its_cores():
    """Monitor.busy, what bench/tune/calibrate ask before saving: above SHARE x cores on average."""
    for reading, busy in ((1, True), (0.5, False), (0, False)):
        m = machine_load.Monitor(source=lambda r=reading: r, n_cores=2)
        m.read()
        assert m.busy is busy


# ------------------------------------------------------------------------------------------------ calibrate
def test_a_timed_figure_takes_its_load_reading_under_its_key(monkeypatch):
    """calibrate's figures timed with a monitor: the best time of the repeats (what _best gives), and the load read
    as the figure ended, kept under the figure's key."""
    calls = []
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])  # repeats of 5 s, 2 s, 7 s
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    m = machine_load.Monitor(period=3600, source=lambda: 3, n_cores=4)
    got = calibrate._timed(m, "gemm 512", lambda: calls.append(1), 3)
    assert got == 2.0 and len(calls) == 4  # a warm-up and 3 repeats
    assert list(m.figures) == ["gemm 512"] and m.figures["gemm 512"].samples == [3] and m.samples == [3]


# ------------------------------------------------------------------------------------------------- cli_args
def test_a_path_on_a_drive_that_is_not_there_is_no_file_in_the_way(monkeypatch, tmp_path):
    """_not_a_folder climbs to the root; where nothing on the way exists (a drive that is not mounted) there is no
    file in the way (the folder is "missing", said elsewhere); a file on the way is named."""
    (tmp_path / "f").write_text("")
    assert cli_args._not_a_folder(str(tmp_path / "f" / "a" / "b")) == str(tmp_path / "f")
    monkeypatch.setattr(cli_args.os.path, "lexists", lambda p: False)
    assert cli_args._not_a_folder(str(tmp_path / "a" / "b")) is None


def test_a_writable_folder_whose_check_file_cannot_be_removed_is_still_writable(tmp_path, monkeypatch):
    """The write check's temporary file could not be removed again (a file system that refuses unlink, another
    process cleaning up first): the folder was writable, so no problem is reported."""
    def refuse(p, *a, **k):
        raise PermissionError(errno.EPERM, "Operation not permitted", p)
    monkeypatch.setattr(cli_args.os, "unlink", refuse)
    assert cli_args._try_write(str(tmp_path)) is None
    monkeypatch.undo()
    (left,) = os.listdir(tmp_path)
    assert left.startswith(".tiled-attention-write-check-")


# ----------------------------------------------------------------------------------------------------- plan
@pytest.mark.parametrize("pixels,scale", [(10, 0.5), (29, 0.29), (21, 0.7)])
def test_the_smallest_side_corrects_float_rounding_both_ways(pixels, scale):
    """_smallest_side(pixels, scale) is the smallest side s with int(s * scale) >= pixels, also where the float
    ceil(pixels / scale) lands one below it (29 / 0.29 = 99.99..., 100 * 0.29 = 28.999...) or one above it
    (21 / 0.7 = 30.000...04, 30 * 0.7 = 21.0)."""
    s = plan._smallest_side(pixels, scale)
    want = next(t for t in range(1, 10 ** 6) if int(t * scale) >= pixels)
    assert s == want


# ------------------------------------------------------------------------------- report, selfcheck, tune
def test_a_report_that_cannot_be_written_anywhere_is_printed(tmp_path, monkeypatch, capsys):
    """Neither the --out file nor a temporary file can be written at the end (a full disk): the error line says so
    and the report itself goes to stdout, exit 2."""
    import tempfile
    monkeypatch.setattr(report, "build", lambda *a, **k: "# the report\n")

    def full(path, mode="r", *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(report, "open", full, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    out = tmp_path / "r.md"
    assert report.main(["--device", "cpu", "--out", str(out)]) == 2
    got = capsys.readouterr()
    assert got.err == f"error: could not write {str(out)!r} (No space left on device)\n"
    assert got.out == "# the report\n\n" and not out.exists()


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "No such file or directory: 'git'"),
                                   report.subprocess.TimeoutExpired(["git"], 10)])
def test_the_pack_version_without_git_is_the_version_alone(monkeypatch, error):
    """No git on the machine (OSError), or git hanging (a SubprocessError): the report names the pack version
    alone."""
    from attention_core import __version__

    def run(*a, **k):
        raise error
    monkeypatch.setattr(report.subprocess, "run", run)
    assert report._pack_version() == __version__


def test_skipped_cases_are_only_the_cpus():
    """On a GPU the self-check leaves nothing out; on the CPU it names the half-precision cases it skips."""
    assert selfcheck.skipped(torch.device("cuda", 0)) == []
    assert [what for what, why in selfcheck.skipped(torch.device("cpu"))] == [
        "float16 and bfloat16 cases", "fp16 overflowing scores"]


def _run_as_main(module, argv, monkeypatch):
    """`python -m attention_core.<module> argv...`, in this process: the exit code."""
    monkeypatch.setattr(sys, "argv", [module] + argv)
    # imported, attention_core.<module> is attention_core.cli.<module> itself (the alias puts it in sys.modules),
    # whose loader runpy will not run under the alias's name: run the alias file, as a fresh `python -m` does
    monkeypatch.delitem(sys.modules, f"attention_core.{module}", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (by this test)
        with pytest.raises(SystemExit) as e:
            runpy.run_module(f"attention_core.{module}", run_name="__main__")
    return e.value.code


def test_python_m_plan_prints_the_plan_and_exits_0(monkeypatch, capsys):
    assert _run_as_main("plan", ["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "41",
                                 "--free-gb", "8"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "(free memory: given; numbers per attention call and per batch item x 1)" in out


def test_python_m_report_writes_the_report_and_exits_0(monkeypatch, capsys, tmp_path):
    """`python -m attention_core.report --out FILE`: the file is written (here with every section failing fast on a
    broken detection, self-check and benchmark, as a broken build's would), exit 0 from main() through the entry
    line."""
    from attention_core.cli import selfcheck as selfcheck_mod

    def broken(*a, **k):
        raise RuntimeError("broken build")
    monkeypatch.setattr(detection, "detect", broken)
    monkeypatch.setattr(selfcheck_mod, "run", broken)
    monkeypatch.setattr(report.subprocess, "Popen", broken)
    out = tmp_path / "r.md"
    assert _run_as_main("report", ["--device", "cpu", "--out", str(out)], monkeypatch) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    text = out.read_text()
    assert text.startswith("# tiled-attention report: ") and ("\n- sections that failed: Device and software, "
                                                              "Detection, Self-check, Benchmark: ") in text


def test_python_m_tune_layouts_times_and_exits_0(monkeypatch, capsys):
    """`python -m attention_core.tune --layouts 1` on the smallest shape: the layout line, exit 0 (nothing saved)."""
    assert _run_as_main("tune", ["--device", "cpu", "--dtype", "float32", "--presets", "reference", "--max-n", "512",
                                 "--rows", "64", "--layouts", "1"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "  layout 16x64 N=512 float32" in out and "measured at: " in out


def test_python_m_selfcheck_exits_0_when_every_case_is_within_tolerance(monkeypatch, capsys):
    assert _run_as_main("selfcheck", ["--device", "cpu"], monkeypatch) == 0
    assert "all cases within tolerance" in capsys.readouterr().out
