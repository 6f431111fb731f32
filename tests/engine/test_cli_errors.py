"""The engine's command lines (plan, tune, bench, selfcheck) answer bad input with one `error: argument --flag: ...`
line naming what the flag accepts and exit status 2: never a traceback, never a run on nonsense; and their messages
never contradict their own figures.

Every listed input runs in-process through the CLI's main() (fast; an uncaught exception fails the test); one bad
input per CLI also runs as `python -m ...` in a real process, to see the exit status and stderr a user sees."""
import json
import os
import subprocess
import sys

import pytest
import torch

from attention_core.cli import bench, plan, selfcheck, tune
from attention_core.device import profiles

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a GPU this torch cannot use: "cuda" without GPUs, else one index past the last
NO_GPU = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
PLAN = ["--model", "wan22-5b", "--width", "832", "--height", "480", "--frames", "41", "--free-gb", "8"]


def with_(base, flag, value):
    """`base` with `flag` set to `value` (replaced when present)."""
    out = list(base)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def assert_one_line_error(code, out, err, flag, *words):
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: argument {flag}" if flag else "error: "), err
    assert "Traceback" not in err and out == ""
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


def run_main(main, argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return e.value.code, out, err


PLAN_CASES = [
    *[(with_(PLAN, f, v), f, "from 1 to") for f in ("--width", "--height", "--frames") for v in ("0", "-5")],
    (with_(PLAN, "--width", "8"), "--width", "at least 16 pixels"),            # a valid size with 0 tokens
    (with_(PLAN, "--height", "15"), "--height", "at least 16 pixels"),
    (with_(with_(PLAN, "--model", "ltx23-22b"), "--height", "16"), "--height", "at least 64 pixels"),
    # LTX-2.3's first stage samples at half the size: 32 pixels give its full-size stage one token, that one none
    (with_(with_(with_(PLAN, "--model", "ltx23-22b"), "--width", "32"), "--height", "32"), "--width",
     "at least 64 pixels"),
    (with_(with_(PLAN, "--model", "ltx23-22b"), "--height", "63"), "--height", "stage 1 (half size) samples at 0.5"),
    *[(PLAN + ["--blocks", v], "--blocks", "whole number from 1 to 48") for v in ("0", "-1", "49", str(10 ** 30),
                                                                                   "1.5", "x", "", "1e3")],
    (PLAN + ["--blocks", "31"], "--blocks", "Wan 2.2 TI2V 5B has 30 blocks; give a whole number from 1 to 30, got 31"),
    (with_(PLAN, "--model", "wan-14b") + ["--blocks", "41"], "--blocks", "has 40 blocks"),
    (with_(PLAN, "--width", str(10 ** 30)), "--width", "16,384"),
    (with_(PLAN, "--width", "832.5"), "--width", "whole number"),
    (with_(PLAN, "--frames", "abc"), "--frames", "whole number"),
    (with_(PLAN, "--height", ""), "--height", "whole number"),
    *[(with_(PLAN, "--free-gb", v), "--free-gb", "0.000001 to 1,000,000 GB")
      for v in ("0", "-1", "nan", "inf", "1e400", "1e-300", "lots", "")],
    (PLAN + ["--free-gb=-inf"], "--free-gb", "0.000001 to 1,000,000 GB"),  # (-inf alone reads as an option)
    *[(with_(PLAN, "--batch", v), "--batch", "from 1 to 256") for v in ("0", "-2", "100000")],
    (with_(PLAN, "--dtype", "fp8"), "--dtype", "fp16"),
    (with_(PLAN, "--model", "sdxl"), "--model", "wan22-5b"),
    (PLAN[:6], "", "--frames"),  # a required flag missing: argparse's own line, still one line
]


@pytest.mark.parametrize("argv,flag,word", PLAN_CASES,
                         ids=[f"{c[1] or 'missing'}-{i}" for i, c in enumerate(PLAN_CASES)])
def test_plan_bad_input(argv, flag, word, capsys):
    assert_one_line_error(*run_main(plan.main, argv, capsys), flag.split()[0] if flag else "", word)


TUNE_CASES = [
    (["--device", "gpu"], "--device", "accepted: cpu"),
    (["--device", NO_GPU], "--device", "cpu"),
    (["--device", ""], "--device", "accepted"),
    (["--dtype", "float8"], "--dtype", "bfloat16"),
    (["--dtype", ""], "--dtype", "float32"),
    (["--presets", "wan-9000"], "--presets", "wan22-5b-480p"),
    (["--presets", ","], "--presets", "reference"),
    (["--tiers", "auto"], "--tiers", "chunked, inplace, online"),
    (["--rows", "0"], "--rows", ">= 64"),
    (["--rows", "-1"], "--rows", ">= 64"),
    (["--max-n", "0"], "--max-n", ">= 512"),
    (["--max-n", "511"], "--max-n", ">= 512"),  # the bounds themselves: 512 and 64 rows run (TINY_TUNE)
    (["--rows", "63"], "--rows", ">= 64"),
    (["--repeats", "1001"], "--repeats", "from 1 to 1,000"),
    (["--repeats", "-1"], "--repeats", "from 1 to 1,000"),
    (["--repeats", "0"], "--repeats", "from 1 to 1,000"),
    (["--repeats", "two"], "--repeats", "whole number"),
    (["--out", "{tmp}/missing/profile.json"], "--out", "does not exist"),
    (["--out", "{tmp}"], "--out", "is a folder"),
    (["--out", ""], "--out", "file path"),
    (["--layouts", "-1"], "--layouts", "from 0 to 1,000"),
    (["--layouts", "1001"], "--layouts", "from 0 to 1,000"),
]


def _fill(argv, tmp_path):
    return [a.replace("{tmp}", str(tmp_path)) for a in argv]


@pytest.mark.parametrize("argv,flag,word", TUNE_CASES, ids=[" ".join(c[0]) for c in TUNE_CASES])
def test_tune_bad_input(argv, flag, word, capsys, tmp_path):
    assert_one_line_error(*run_main(tune.main, _fill(argv, tmp_path), capsys), flag, word)


BENCH_CASES = [
    (["--preset", "wan22-5b-999p"], "--preset", "wan22-5b-480p"),
    (["--preset", ""], "--preset", "reference"),
    (["--n", "0"], "--n", ">= 1"),
    (["--n", "1024,abc"], "--n", "whole numbers"),
    (["--n", ""], "--n", "whole numbers"),
    (["--heads", "0"], "--heads", ">= 1"),
    (["--dim", "-64"], "--dim", ">= 1"),
    (["--batch", "0"], "--batch", ">= 1"),
    (["--bwd-n", "-4"], "--bwd-n", ">= 1"),
    (["--bwd-heads", "0"], "--bwd-heads", ">= 1"),
    (["--dtype", "int8"], "--dtype", "float16"),
    (["--device", "gpu"], "--device", "accepted: cpu"),
    (["--device", NO_GPU], "--device", "cpu"),
    (["--mode", "forward"], "--mode", "fwdbwd"),
    (["--methods", "math,flash"], "--methods", "comfy-subquad"),
    (["--repeats", "-1"], "--repeats", "from 1 to 1,000"),
    (["--rounds", "0"], "--rounds", "from 1 to 100"),
    (["--threads", "-1"], "--threads", "from 0 to 1,024"),
    (["--timeout", "0"], "--timeout", "from 1 to"),
    (["--comfyui", "{tmp}"], "--comfyui", "comfy/model_management.py"),
    (["--json", "{tmp}/missing/out.json"], "--json", "does not exist"),
    (["--plot", "{tmp}"], "--plot", "is a folder"),
    (["--from-json", "{tmp}/missing.json"], "--from-json", "does not exist"),
    (["--from-json", "{tmp}"], "--from-json", "not a file"),
    (["--from-json", "{tmp}/garbage.json"], "--from-json", "not JSON"),
    (["--from-json", "{tmp}/other.json"], "--from-json", "not a run saved with --json"),
    (["--case", "{not json"], "--case", "not JSON"),  # internal, but still no traceback
    # shapes whose inputs alone exceed any memory: said before anything runs
    (["--n", str(10 ** 12), "--mode", "fwd"], "--n/--heads/--dim/--batch", "the inputs alone take"),
    (["--preset", "wan22-5b-480p", "--heads", str(10 ** 9)], "--preset/--heads/--batch", "the inputs alone take"),
    (["--dim", str(10 ** 30)], "--n/--heads/--dim/--batch", "GB free on"),
]


@pytest.mark.parametrize("argv,flag,word", BENCH_CASES, ids=[" ".join(c[0])[:40] for c in BENCH_CASES])
def test_bench_bad_input(argv, flag, word, capsys, tmp_path):
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text(json.dumps({"results": [{"method": "math"}]}))
    assert_one_line_error(*run_main(bench.main, _fill(argv, tmp_path), capsys), flag, word)


@pytest.mark.parametrize("device", ["gpu", NO_GPU, "", "cuda:x", "meta"])
def test_selfcheck_bad_device(device, capsys):
    assert_one_line_error(*run_main(selfcheck.main, ["--device", device], capsys), "--device", "accepted")


PREDICT_CASES = [(["--blocks", "0"], "--blocks", "from 1 to 30"), (["--tokens", "-1"], "--tokens", "whole number"),
                 (["--batch", "x"], "--batch", "whole number"), (["--methods", "pack,flash"], "--methods", "'flash'"),
                 (["--methods", ""], "--methods", "pack, subquad"), (["--device", "gpu"], "--device", "accepted"),
                 (["--calibration", "{tmp}/missing.json"], "--calibration", "does not exist"),
                 (["--calibration", "{tmp}/garbage.json"], "--calibration", "not a valid calibration"),
                 (["--log", "{tmp}"], "--log", "is a folder"), (["--repeats", "0"], "--repeats", "from 1 to 100")]


@pytest.mark.parametrize("argv,flag,word", PREDICT_CASES, ids=[" ".join(c[0]) for c in PREDICT_CASES])
def test_predict_step_bad_input(argv, flag, word, capsys, tmp_path):
    """The predicted-vs-measured tool (tools/measure/predict_step.py) answers like the engine's CLIs, before any
    work."""
    from tools.measure import predict_step
    (tmp_path / "garbage.json").write_text("{not json")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert_one_line_error(*run_main(predict_step.main, argv + ["--methods", "pack"] * ("--methods" not in argv),
                                    capsys), flag, word)


@pytest.mark.parametrize("name", ["cpu", "CPU", " cpu:0 "])
def test_the_cpu_is_accepted_under_each_of_torchs_names(name):
    from attention_core.cli import cli_args
    assert cli_args.device(name) == "cpu"
    assert cli_args.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(Exception, match="unknown device 'cpu:1'"):
        cli_args.device("cpu:1")


def test_zero_tokens_is_an_error_at_the_input():
    """The library call says which size gives no tokens (it was a ZeroDivisionError deep in the tile rule)."""
    with pytest.raises(ValueError, match=r"needs width >= 16, height >= 16"):
        plan.estimate("wan22-5b", 8, 480, 41, free=8 << 30)
    assert plan.estimate("wan22-5b", 16, 16, 1, free=8 << 30)["tokens"] == 1


def test_plan_never_says_a_method_fits_beyond_the_free_memory(capsys):
    """With 1 MB free, ComfyUI's sub-quadratic (3 MB a call here) does not fit, and neither do q, k, v, o."""
    assert plan.main(with_(PLAN, "--free-gb", "0.001")) == 0
    out = capsys.readouterr().out
    subquad = next(ln for ln in out.splitlines() if "ComfyUI sub-quadratic" in ln)
    assert "DOES NOT FIT" in subquad
    assert "fits with" not in out and "sub-quadratic does not fit either (3.0 MB per call)" in out
    assert "q, k, v and o of one call alone take 100.5 MB > 1.0 MB free" in out
    assert plan.main(with_(PLAN, "--free-gb", "1")) == 0  # 1 GB: math does not fit, sub-quadratic does: said so
    out = capsys.readouterr().out
    assert "ComfyUI's sub-quadratic fits with" in out and "DOES NOT FIT" not in next(
        ln for ln in out.splitlines() if "ComfyUI sub-quadratic" in ln) and "alone take" not in out


TINY_TUNE = ["--device", "cpu", "--dtype", "float32", "--presets", "reference", "--max-n", "512", "--rows", "64",
             "--repeats", "1"]


def test_tune_says_whether_auto_reads_the_profile(tmp_path, monkeypatch, capsys):
    """A real (tiny) tuning pass: saved at the device's profile path, 'auto uses it'; saved by --out elsewhere,
    the line says auto does not read it and names the path it does read."""
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.setenv(profiles.ENV_DIR, str(tmp_path / "profiles"))
    profiles._cache.clear()
    assert tune.main(TINY_TUNE) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    read = profiles.profile_path("cpu")
    assert last.startswith(f"saved {read}; tier 'auto' uses it, in ComfyUI too") and os.path.isfile(read)
    os.remove(read)
    out = tmp_path / "elsewhere.json"
    assert tune.main(TINY_TUNE + ["--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"saved {out}; tier 'auto' does not read this path: it reads {read}")
    assert out.is_file() and profiles.load_profile("cpu") is None  # and indeed it does not


REAL = [("plan", with_(PLAN, "--free-gb", "nan"), "--free-gb"),
        ("tune", ["--rows", "0"], "--rows"),
        ("bench", ["--repeats", "-1"], "--repeats"),
        ("selfcheck", ["--device", NO_GPU], "--device")]


def test_each_cli_as_a_user_runs_it():
    """`python -m attention_core.X` with a bad flag: exit 2, one stderr line, nothing on stdout (all four at
    once, in real processes)."""
    procs = [(flag, subprocess.Popen([sys.executable, "-m", f"attention_core.{mod}", *argv], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)) for mod, argv, flag in REAL]
    for flag, p in procs:
        out, err = p.communicate(timeout=120)
        assert_one_line_error(p.returncode, out, err, flag)


# ------------------------------------------------------------------ cli_args: what each check accepts and says
def _msg(parse, value):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError) as e:
        parse(value)
    return str(e.value)


def test_whole_number_ranges_accept_their_bounds_and_say_them():
    from attention_core.cli import cli_args
    r = cli_args.int_range(1, 1000)
    assert (r("1"), r(" 1000 "), r("010")) == (1, 1000, 10)
    assert _msg(r, "0") == "expected a whole number from 1 to 1,000, got '0'"
    assert _msg(r, "1001") == "expected a whole number from 1 to 1,000, got '1001'"
    assert _msg(r, "1e3") == "expected a whole number from 1 to 1,000, got '1e3'"
    open_ended = cli_args.int_range(512)
    assert open_ended(str(10 ** 12)) == 10 ** 12 and open_ended("512") == 512
    assert _msg(open_ended, "511") == "expected a whole number >= 512, got '511'"
    assert _msg(cli_args.int_range(), "-1") == "expected a whole number >= 1, got '-1'"


def test_number_ranges_accept_their_bounds_and_refuse_non_finite_values():
    from attention_core.cli import cli_args
    f = cli_args.float_range(1e-6, 1e6, " GB")
    assert (f("0.000001"), f(" 1e6 "), f("2.5")) == (1e-6, 1e6, 2.5)
    for bad in ("0", "1000000.1", "nan", "inf", "-inf", "x"):
        assert _msg(f, bad) == f"expected a number from 0.000001 to 1,000,000 GB, got {bad!r}"
    assert _msg(cli_args.float_range(0.5, 2), "3") == "expected a number from 0.5 to 2, got '3'"


def test_name_lists_are_cleaned_deduplicated_and_checked():
    from attention_core.cli import cli_args
    c = cli_args.choice_list(("chunked", "inplace", "online"), "tiers")
    assert c(" online, chunked,,online ") == "online,chunked"
    assert _msg(c, "auto,chunked,flash") == ("unknown 'auto', 'flash'; expected comma-separated tiers from: chunked, "
                                             "inplace, online")
    assert _msg(c, " , ") == "expected comma-separated tiers from: chunked, inplace, online, got ' , '"
    n = cli_args.int_list(1, 8)
    assert n("8, 1,1") == "8,1,1"
    assert _msg(n, "1,9") == "expected comma-separated whole numbers from 1 to 8, got '1,9'"
    assert cli_args.dtype_list("FP16, half,bf16,fp32,Float64,fp64") == "float16,bfloat16,float32,float64"
    assert _msg(cli_args.dtype_list, "fp16,int8") == (
        "unknown 'int8'; expected comma-separated dtypes from: float32, float16, bfloat16, float64 (or fp32, fp16, "
        "half, bf16, fp64)")


def test_file_checks_say_what_is_wrong(tmp_path):
    from attention_core.cli import cli_args
    f = tmp_path / "a.json"
    f.write_text("{}")
    assert cli_args.existing_file(str(f)) == str(f)
    assert _msg(cli_args.existing_file, str(tmp_path / "b")) == (f"{str(tmp_path / 'b')!r} does not exist; expected "
                                                                 "the path of an existing file")
    assert _msg(cli_args.existing_file, str(tmp_path)) == (f"{str(tmp_path)!r} is not a file; expected the path of "
                                                           "an existing file")
    assert _msg(cli_args.existing_file, " ") == "expected the path of an existing file, got ' '"
    assert cli_args.output_file(str(tmp_path / "new.md")) == str(tmp_path / "new.md")
    assert cli_args.output_file(str(f)) == str(f)  # an existing file is overwritten
    assert _msg(cli_args.output_file, str(tmp_path)) == f"{str(tmp_path)!r} is a folder; expected a file path to write"
    assert _msg(cli_args.output_file, "") == "expected a file path to write, got ''"
    comfy = tmp_path / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    assert _msg(cli_args.comfyui_folder, str(comfy)) == (
        f"expected a ComfyUI folder (one with comfy/model_management.py), got {str(comfy)!r}")
    (comfy / "comfy" / "model_management.py").write_text("")
    assert cli_args.comfyui_folder(str(comfy)) == str(comfy)


def test_a_file_where_a_folder_should_be_is_named(tmp_path):
    """Issue 22.7: --out file/x.md (file a regular file) said "folder does not exist"; now it says which path is a
    file, however deep under it the output lies; a folder that is missing is still "does not exist"."""
    from attention_core.cli import cli_args
    f = tmp_path / "file"
    f.write_text("x")
    want = f"{str(f)!r} is a file, not a folder; expected a file path in an existing folder"
    assert _msg(cli_args.output_file, str(f / "x.md")) == want
    assert _msg(cli_args.output_file, str(f / "a" / "b" / "x.md")) == want
    assert _msg(cli_args.output_file, str(tmp_path / "missing" / "x.md")) == (
        f"folder {str(tmp_path / 'missing')!r} does not exist; expected a file path in an existing folder")
    assert cli_args.writable_path(str(f / "x.md")) == f"{str(f)!r} is a file, not a folder"
    assert cli_args.folder_problem(str(f / "a"), create=True) == f"{str(f)!r} is a file, not a folder"


def test_writability_is_tried_not_read_from_the_permission_bits(tmp_path, unwritable_folder):
    """Root passes every permission check (os.access) yet cannot write on a read-only mount: a file is created
    in the folder and removed again (nothing left behind), an existing file is opened for appending (nothing
    truncated). Where the tests do not run as root, the folder is read-only for real too."""
    from attention_core.cli import cli_args
    ok = tmp_path / "ok"
    ok.mkdir()
    assert cli_args.output_file(str(ok / "x.md")) == str(ok / "x.md") and os.listdir(ok) == []
    (ok / "kept.md").write_text("kept")
    assert cli_args.output_file(str(ok / "kept.md")) and (ok / "kept.md").read_text() == "kept"
    ro = unwritable_folder(tmp_path / "ro")
    assert _msg(cli_args.output_file, str(ro / "x.md")).startswith(f"folder {str(ro)!r} is not writable")
    assert cli_args.folder_problem(str(ro)).startswith(f"folder {str(ro)!r} is not writable")
    # a folder to be made (the default profile folder): its nearest existing parent must take it
    assert cli_args.writable_path(str(ro / "a" / "b" / "x.json")).startswith(f"folder {str(ro)!r} is not writable")
    assert cli_args.writable_path(str(ok / "a" / "b" / "x.json")) is None and os.listdir(ok) == ["kept.md"]
    assert cli_args.writable_path(str(ok)) == f"{str(ok)!r} is a folder"
    assert cli_args.folder_problem(str(ok / "new")) == f"folder {str(ok / 'new')!r} does not exist"


def test_an_existing_file_is_tried_for_appending(tmp_path, monkeypatch):
    """The file itself must take writes (the folder being writable is not enough for report's open(..., "w")):
    tried by opening it to append, which changes nothing."""
    import errno
    from attention_core.cli import cli_args
    f = tmp_path / "report.md"
    f.write_text("old")
    seen = []

    def refusing(path, mode="r", *a, **k):
        seen.append(mode)
        raise PermissionError(errno.EACCES, "Permission denied", path)
    monkeypatch.setattr(cli_args, "open", refusing, raising=False)
    assert _msg(cli_args.output_file, str(f)) == f"file {str(f)!r} is not writable (Permission denied)"
    assert cli_args.writable_path(str(f)) == f"file {str(f)!r} is not writable (Permission denied)"
    assert seen == ["a", "a"] and f.read_text() == "old"
    assert cli_args.output_file(str(tmp_path / "new.md"))  # a file that does not exist is not opened
    assert seen == ["a", "a"]


def test_keep_elsewhere_writes_a_new_temporary_file(tmp_path, monkeypatch):
    import tempfile
    from attention_core.cli import cli_args
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = cli_args.keep_elsewhere("text", "/some/where/report.md")
    assert os.path.dirname(path) == str(tmp_path) and os.path.basename(path).startswith("report-")
    assert path.endswith(".md") and open(path).read() == "text"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    assert cli_args.keep_elsewhere("text", "x.json") is None


def test_unreadable_and_unwritable_paths(tmp_path, monkeypatch):
    """(Permissions faked through os.access: the tests may run as root, who may read and write anything.)"""
    from attention_core.cli import cli_args
    f = tmp_path / "secret.json"
    f.write_text("{}")
    monkeypatch.setattr(cli_args.os, "access", lambda path, mode: False)
    assert _msg(cli_args.existing_file, str(f)) == f"{str(f)!r} is not readable"
    assert _msg(cli_args.output_file, str(tmp_path / "x")) == f"folder {str(tmp_path)!r} is not writable"
    assert _msg(cli_args.output_file, str(f)) == f"folder {str(tmp_path)!r} is not writable"
    monkeypatch.setattr(cli_args.os, "access", lambda path, mode: path != str(f))  # the folder yes, the file no
    assert _msg(cli_args.output_file, str(f)) == f"file {str(f)!r} is not writable (read-only)"


@pytest.mark.parametrize("count", [1, 2])
def test_gpu_names_against_the_gpus_torch_sees(monkeypatch, count):
    """With GPUs: cuda and cuda:N within the count (any case, spaces trimmed); other names list what is accepted.
    "cuda:" (no index) was accepted and then failed as a traceback in torch.device."""
    from attention_core.cli import cli_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    accepted = "cpu, cuda, cuda:0" if count == 1 else "cpu, cuda, cuda:0 to cuda:1"
    assert cli_args.device(" CUDA ") == "cuda" and cli_args.device(f"cuda:{count - 1}") == f"cuda:{count - 1}"
    assert cli_args.default_device() == "cuda"
    assert _msg(cli_args.device, f"cuda:{count}") == f"no GPU 'cuda:{count}': this torch sees {count}; accepted: " \
                                                     f"{accepted}"
    for bad in ("gpu", "cuda:x", "cuda:", "cpu:1", "cuda:-1"):
        assert _msg(cli_args.device, bad) == f"unknown device {bad!r}; accepted: {accepted}", bad


def test_a_gpu_name_without_gpus_names_the_build(monkeypatch):
    from attention_core.cli import cli_args
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli_args.default_device() == "cpu"
    assert _msg(cli_args.device, "cuda") == (f"'cuda' asks for a GPU, but torch {torch.__version__} (a CPU-only build) "
                                             "sees none; accepted here: cpu")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert "(CUDA 12.4) sees none" in _msg(cli_args.device, "cuda:0")
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    assert "(ROCm/HIP 6.2.41133) sees none" in _msg(cli_args.device, "cuda:0")
    assert _msg(cli_args.device, "gpu") == "unknown device 'gpu'; accepted: cpu (this torch sees no GPU)"


def test_the_parser_error_is_one_line_and_fail_names_the_flag(capsys):
    from attention_core.cli import cli_args
    ap = cli_args.Parser(prog="x")
    with pytest.raises(SystemExit) as e:
        ap.error("two\n   lines  here")
    assert e.value.code == 2 and capsys.readouterr().err == "error: two lines here\n"
    with pytest.raises(SystemExit) as e:
        cli_args.fail(ap, "--out", "the default is bad")
    assert e.value.code == 2 and capsys.readouterr().err == "error: argument --out: the default is bad\n"
