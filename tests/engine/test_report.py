"""attention_core.report: the one Markdown file a GPU owner pastes into an issue. A real quick run on the CPU writes
every section (device and versions, detection, self-check, the Wan 480p benchmark with ComfyUI's sub-quadratic when
a ComfyUI is found); a section that fails is written into the file and the others still run; bad flags are one
`error:` line."""
import os
import re
import subprocess
import sys

import pytest
import torch

from attention_core.cli import cli_args, report, selfcheck
from attention_core.device import profiles
from attention_core.device.detection import detect

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TITLES = ["## Device and software", "## Detection", "## Self-check", "## Benchmark: Wan 2.2 5B 480p attention"]
NO_GPU = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def sections(text):
    """{heading: body} of the report's `## ` sections, in order."""
    parts = re.split(r"^(## .*)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "mine.md"
    p = subprocess.run([sys.executable, "-m", "attention_core.report", "--device", "cpu", "--quick", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    return p, out


def test_quick_report_on_the_cpu(quick_report):
    p, out = quick_report
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert f"wrote {out}" in p.stdout.splitlines()
    text = out.read_text()
    got = sections(text)
    assert list(got) == TITLES and "This section failed" not in text
    assert f"| torch | {torch.__version__} |" in got[TITLES[0]] and "| arch |" in got[TITLES[0]]
    verdict = "needs tiled attention" if detect("cpu").needs_tiled_attention else "has fused attention"
    assert got[TITLES[1]].lstrip().startswith(f"**{verdict}**") and f"- detection: {verdict}" in text
    check = got[TITLES[2]]
    assert check.lstrip().startswith("**passed**") and "- self-check: passed" in text
    for tier in ("chunked", "inplace", "online"):
        assert re.search(rf"^ok  {tier} +float32 +plain ", check, re.M), tier
    rows = {m: (float(ms.replace(",", "")), float(err)) for m, ms, err in
            re.findall(r"^\| ([\w-]+) \| N=4,290 2x128 \| ([\d,.]+) \| [\d,]+ \| ([\d.e+-]+) \| \|$",
                       got[TITLES[3]], re.M)}
    expected = ["math", "torch", "chunked", "inplace", "online", "auto"]
    if not report.find_comfyui():
        assert "its sub-quadratic attention is not compared" in got[TITLES[3]]
    elif os.environ.get("TILED_ATTENTION_NO_COMFYUI"):  # ./dev test-oldest-torch: ComfyUI's folder is found but
        # its requirements are not installed in that venv: the row says why it did not run
        assert re.search(r"^\| comfy-subquad \|.*not run: ComfyUI import failed", got[TITLES[3]], re.M)
    else:  # ComfyUI found (./dev and CI set COMFYUI_LATEST_PATH): its sub-quadratic ran too
        expected.append("comfy-subquad")
    assert sorted(rows) == sorted(expected), got[TITLES[3]]
    assert all(ms > 0 and err < 1e-5 for ms, err in rows.values()), rows  # float32 vs the float64 reference


def test_a_failing_section_is_written_into_the_file(tmp_path, monkeypatch, capsys):
    """The self-check and the benchmark raise (as a broken ROCm build might): the file still comes, with both
    errors and their tracebacks in place, the device and detection sections intact, and the path printed."""
    def broken(*a, **k):
        raise RuntimeError("HIP error: invalid device function (simulated)")
    monkeypatch.setattr(selfcheck, "run", broken)
    monkeypatch.setattr(report, "run_bench", broken)
    out = tmp_path / "broken.md"
    assert report.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out.splitlines()
    text = out.read_text()
    got = sections(text)
    assert list(got) == TITLES
    assert f"| torch | {torch.__version__} |" in got[TITLES[0]] and "tiled attention" in got[TITLES[1]]
    for title in TITLES[2:]:
        body = got[title].lstrip()
        assert body.startswith("**This section failed**: `RuntimeError: HIP error: invalid device function "
                               "(simulated)`"), body
        assert "Traceback (most recent call last)" in body
    assert "- sections that failed: Self-check, Benchmark: Wan 2.2 5B 480p attention" in text


@pytest.mark.parametrize("argv,flag,word", [
    (["--device", "gpu"], "--device", "accepted: cpu"),
    (["--device", NO_GPU], "--device", "cpu"),
    (["--out", "{tmp}/missing/r.md"], "--out", "does not exist"),
    (["--out", "{tmp}"], "--out", "is a folder"),
    (["--out", "{tmp}/file/r.md"], "--out", "file' is a file, not a folder; expected a file path in an existing "
                                            "folder"),  # not "does not exist"
    (["--out", "{tmp}/file/sub/r.md"], "--out", "file' is a file, not a folder"),
    (["--comfyui", "{tmp}"], "--comfyui", "comfy/model_management.py"),
    (["--quick", "--full"], "--full", "not allowed with argument --quick"),
    (["--rounds", "3"], "", "unrecognized arguments"),
])
def test_report_bad_input(argv, flag, word, tmp_path, capsys):
    (tmp_path / "file").write_text("a regular file")
    with pytest.raises(SystemExit) as e:
        report.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert e.value.code == 2 and out == "" and len(lines) == 1, (e.value.code, out, err)
    assert lines[0].startswith(f"error: argument {flag}" if flag else "error: ") and word in lines[0], lines[0]


def test_report_bad_input_as_a_user_runs_it(tmp_path):
    p = subprocess.run([sys.executable, "-m", "attention_core.report", "--out", str(tmp_path / "no" / "r.md")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [f"error: argument --out: folder '{tmp_path / 'no'}' does not exist; "
                                             "expected a file path in an existing folder"]


def test_an_out_file_that_cannot_be_written_is_refused_before_the_benchmark(tmp_path, monkeypatch, capsys,
                                                                          unwritable_folder):
    """Issue 22.7: an existing file that cannot be written (opened for appending to try: nothing is truncated;
    as root, a file no one may write, such as one on a read-only mount, is faked by refusing that open; where
    the tests do not run as root, a real mode-444 file too), or a folder nothing can be created in: one error
    line, exit 2, the file untouched, and the benchmark never started."""
    import errno
    built = []
    monkeypatch.setattr(report, "build", lambda *a, **k: built.append(a) or "# r\n")
    old = tmp_path / "old.md"
    old.write_text("keep me")
    real_open = open

    def refusing(path, mode="r", *a, **k):
        if os.path.abspath(path) == str(old) and set(mode) & set("wax+"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr(cli_args, "open", refusing, raising=False)

    def refused(argv, message):
        with pytest.raises(SystemExit) as e:
            report.main(argv)
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err == f"error: argument --out: {message}\n", err
    refused(["--device", "cpu", "--out", str(old)], f"file {str(old)!r} is not writable (Permission denied)")
    monkeypatch.delattr(cli_args, "open")
    if os.geteuid() != 0:
        old.chmod(0o444)
        refused(["--device", "cpu", "--out", str(old)], f"file {str(old)!r} is not writable (read-only)")
        old.chmod(0o644)
    ro = unwritable_folder(tmp_path / "read-only")
    with pytest.raises(SystemExit) as e:
        report.main(["--device", "cpu", "--out", str(ro / "r.md")])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(
        f"error: argument --out: folder {str(ro)!r} is not writable")
    monkeypatch.chdir(ro)  # the default file, in the current folder
    with pytest.raises(SystemExit) as e:
        report.main(["--device", "cpu"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(
        f"error: argument --out: the default folder {str(ro)!r} is not writable")
    assert built == [] and old.read_text() == "keep me" and os.listdir(ro) == []
    assert report.main(["--device", "cpu", "--out", str(old)]) == 0 and old.read_text() == "# r\n"


def test_a_report_that_cannot_be_written_at_the_end_is_kept(tmp_path, monkeypatch, capsys):
    """Checked up front, the write can still fail after the benchmark (the folder removed, the disk full): the
    report goes to a temporary file named in one error line, exit 2, no traceback."""
    import errno
    import tempfile
    monkeypatch.setattr(report, "build", lambda *a, **k: "# the report\n")
    out = tmp_path / "r.md"

    def full(path, mode="r", *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(report, "open", full, raising=False)
    kept_dir = tmp_path / "kept"
    kept_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(kept_dir))
    assert report.main(["--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    (kept,) = kept_dir.iterdir()
    assert err == f"error: could not write {str(out)!r} (No space left on device); the report is in {str(kept)!r}\n"
    assert kept.read_text() == "# the report\n" and kept.name.startswith("r-") and kept.name.endswith(".md")


def test_comfyui_is_the_one_the_pack_is_installed_in(tmp_path, monkeypatch):
    """With no configured ComfyUI (bench's default finds none), a pack in <ComfyUI>/custom_nodes/<pack> compares
    against that ComfyUI; elsewhere there is none."""
    from attention_core.cli import bench
    comfy = tmp_path / "ComfyUI"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "comfy" / "model_management.py").write_text("")
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    monkeypatch.setattr(report, "ROOT", str(comfy / "custom_nodes" / "tiled-attention"))
    assert report.find_comfyui() == str(comfy)
    monkeypatch.setattr(report, "ROOT", str(tmp_path / "elsewhere" / "tiled-attention"))
    assert report.find_comfyui() is None


def test_device_section_on_a_faked_rocm_gpu(monkeypatch, tmp_path):
    """No GPU here: the GPU branch of the device section and the file name on a faked ROCm MI50 (torch's own
    property names), the installed ROCm read from $ROCM_PATH/.info/version."""
    import types
    props = types.SimpleNamespace(name="AMD Instinct MI50/MI60", gcnArchName="gfx906:sramecc+:xnack-", major=9,
                                  minor=0, multi_processor_count=60, total_memory=32 << 30)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (30 << 30, 32 << 30))
    (tmp_path / ".info").mkdir()
    (tmp_path / ".info" / "version").write_text("6.2.4-120\n")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    monkeypatch.setenv("HSA_OVERRIDE_GFX_VERSION", "9.0.6")
    ctx = {}
    table = report.section_device("cuda", ctx)
    for row in ("| name | AMD Instinct MI50/MI60 |", "| arch | gfx906:sramecc+:xnack- |", "| compute units / SMs | 60 |",
                "| memory total | 32.0 GB |", "| memory free now | 30.0 GB |",
                "| HIP (torch.version.hip) | 6.2.41133-dd7f95766 |", "| ROCm installed | 6.2.4-120 |",
                "| $HSA_OVERRIDE_GFX_VERSION | 9.0.6 |"):
        assert row in table, (row, table)
    assert (ctx["name"], ctx["arch"]) == ("AMD Instinct MI50/MI60", "gfx906:sramecc+:xnack-")
    assert report.default_out("cuda") == "tiled-attention-report-amd-instinct-mi50-mi60-gfx906.md"


# ------------------------------------------------------------------ the benchmark section and the summary, faked
def _fake_bench(monkeypatch, results, seen=None):
    """run_bench writes this bench JSON (what attention_core.bench --json writes) and exits 0."""
    import json

    def fake(device, quick, comfyui, json_path, log=print):
        with open(json_path, "w") as f:
            json.dump({"info": {"dtype": "float32", "threads": 2, "load_start": 0.5, "load_end": 1.25},
                       "results": results}, f)
        if seen is not None:
            seen.append((device, quick, comfyui))
        cmd = [sys.executable, "-m", "attention_core.bench", "--preset", report.PRESET, "--device", device,
               "--methods", report.METHODS, "--json", json_path, "--rounds", "3", "--comfyui", "/my ComfyUI"]
        return cmd, 0, []
    monkeypatch.setattr(report, "run_bench", fake)


ROWS = [{"method": "math", "n": 4290, "heads": 24, "dim": 128, "ms": 1234.56, "peak_mb": 2048.4, "err": 1.5e-7},
        {"method": "auto", "n": 4290, "heads": 24, "dim": 128, "ms": 987.65, "peak_mb": 12.6, "err": None},
        {"method": "inplace", "n": 4290, "heads": 24, "dim": 128, "skipped": "not | on this device"},
        {"method": "comfy-subquad", "n": 4290, "heads": 24, "dim": 128, "error": "boom"}]


def test_the_benchmark_table_rows_and_the_summary_figures(monkeypatch):
    """Each method's row: time (ms, one decimal), peak extra memory (MB), max error; a skipped or failed method says
    so with its reason ('|' would break the table); the command shown is the one to re-run, without --json; the
    summary keeps math, auto and ComfyUI's sub-quadratic figures."""
    _fake_bench(monkeypatch, ROWS)
    ctx = {"quick": False, "comfyui": "/my ComfyUI", "log": lambda s: None}
    body = report.section_bench("cpu", ctx)
    lines = body.splitlines()
    assert lines[0] == (f"`python -m attention_core.bench --preset wan22-5b-480p --device cpu --methods {report.METHODS}"
                        " --rounds 3 --comfyui '/my ComfyUI'`")
    assert lines[2] == ("full size, median of 3 rounds; float32, torch threads 2, machine load 0.5 at the start and "
                        "1.25 at the end")
    assert lines[4:] == [
        "| method | shape | time (ms) | peak extra memory (MB) | max abs error vs float64 | note |",
        "|---|---|---|---|---|---|",
        "| math | N=4,290 24x128 | 1,234.6 | 2,048 | 1.5e-07 | |",
        "| auto | N=4,290 24x128 | 987.6 | 13 | - | |",
        "| inplace | N=4,290 24x128 | - | - | - | not run: not / on this device |",
        "| comfy-subquad | N=4,290 24x128 | - | - | - | FAILED: boom |"]
    assert ctx["bench"] == "math 1,235 ms 2,048 MB; auto 988 ms 13 MB"


def test_the_benchmark_without_comfyui_says_how_to_compare(monkeypatch):
    _fake_bench(monkeypatch, ROWS[:1])
    ctx = {"quick": True, "comfyui": None, "log": lambda s: None}
    body = report.section_bench("cpu", ctx)
    assert body.splitlines()[2].startswith("quick: 2 of the 24 heads, one timed run; float32")
    assert body.endswith("\n\nComfyUI was not found, so its sub-quadratic attention is not compared (run from "
                         "ComfyUI/custom_nodes/<this pack>, or pass --comfyui PATH).")


def test_a_benchmark_that_exits_non_zero_fails_its_section_with_the_last_lines(monkeypatch):
    monkeypatch.setattr(report, "run_bench", lambda *a, **k: (["python"], 3, ["line 1", "Killed"]))
    with pytest.raises(RuntimeError) as e:
        report.section_bench("cpu", {"quick": True, "comfyui": None})
    assert str(e.value) == "attention_core.bench exited 3:\nline 1\nKilled"


def test_the_summary_at_the_top_of_the_file(monkeypatch):
    """Head line with the device's name and arch, the command that made it (--quick / --full), one summary line per
    section (the failed ones say so), and each section's heading and time."""
    _fake_bench(monkeypatch, ROWS)
    monkeypatch.setattr(report, "SECTIONS", [("Device and software", report.section_device),
                                             ("Detection", lambda d, ctx: ctx.update(verdict="has fused attention")
                                              or "ok"),
                                             ("Self-check", lambda d, ctx: 1 / 0),
                                             ("Benchmark: Wan 2.2 5B 480p attention", report.section_bench)])
    logged = []
    text = report.build("cpu", False, "/my ComfyUI", log=logged.append)
    name, arch = profiles._device_name("cpu")
    lines = text.splitlines()
    assert lines[0] == f"# tiled-attention report: {name} ({arch})"
    assert re.fullmatch(r"Made \d{4}-\d\d-\d\d \d\d:\d\d UTC by `python -m attention_core.report --full --device "
                        r"cpu`\.", lines[2]), lines[2]
    assert lines[4:10] == [f"- device: cpu ({name}, {arch})", "- detection: has fused attention",
                           "- self-check: failed to run, see below",
                           "- benchmark (full): math 1,235 ms 2,048 MB; auto 988 ms 13 MB",
                           "- sections that failed: Self-check", ""]
    assert "**This section failed**: `ZeroDivisionError: division by zero`" in text
    assert re.search(r"^## Detection\n\nok\n\n_\d+ s_$", text, re.M)
    assert logged == [f"[report] {t[3:]} ..." for t in TITLES]
    quick = report.build("cpu", True, None, log=lambda s: None)
    assert "--quick --device cpu`." in quick and "- benchmark (quick): math" in quick


def test_fences_tries_and_versions(monkeypatch, tmp_path):
    """A code block in the file cannot be closed early by the text inside it; a table cell holds a failing value's
    error, '-' for none; ROCm's version is read from $ROCM_PATH (else /opt/rocm); the CPU's file name."""
    assert report._fence("a ``` b\n\n") == "```\na ''' b\n```"
    assert report._try(lambda: None) == "-" and report._try(lambda: 0) == 0
    assert report._try(lambda: {}["x"]) == "(KeyError: 'x')"
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "none"))
    assert report._rocm_version() in (None, *([open("/opt/rocm/.info/version").read().strip()]
                                              if os.path.isfile("/opt/rocm/.info/version") else []))
    (tmp_path / ".info").mkdir()
    (tmp_path / ".info" / "version").write_text(" 6.2.4-120\n")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    assert report._rocm_version() == "6.2.4-120"
    assert report.default_out("cpu") == "tiled-attention-report-cpu.md"
    monkeypatch.setattr(profiles, "_device_name",
                        lambda d: ("x" * 80, "gfx1100"))
    assert report.default_out("cuda") == f"tiled-attention-report-{'x' * 60}.md"
    monkeypatch.setattr(profiles, "_device_name", lambda d: ("?", "!"))
    assert report.default_out("cuda") == "tiled-attention-report-gpu.md"


def test_the_pack_version_names_the_git_commit(monkeypatch):
    from attention_core import __version__
    v = report._pack_version()
    assert v == __version__ or re.fullmatch(re.escape(__version__) + r" \(git [0-9a-f]{4,40}\)", v), v
    monkeypatch.setattr(report, "ROOT", "/nonexistent")
    assert report._pack_version() == __version__


def test_main_defaults_quick_on_the_cpu_and_the_default_file_here(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(report, "build", lambda device, quick, comfyui, log=print: seen.append(
        (device, quick, comfyui)) or "# r\n")
    monkeypatch.setattr(report, "find_comfyui", lambda: "/found")
    monkeypatch.setattr(cli_args, "default_device", lambda: "cpu")
    monkeypatch.chdir(tmp_path)
    assert report.main([]) == 0
    assert seen == [("cpu", True, "/found")]
    assert (tmp_path / "tiled-attention-report-cpu.md").read_text() == "# r\n"
    assert capsys.readouterr().out == (f"wrote {tmp_path / 'tiled-attention-report-cpu.md'}\npaste it into an issue: "
                                       f"{report.ISSUES}\n")
    assert report.main(["--full", "--out", "x.md"]) == 0 and seen[-1] == ("cpu", False, "/found")
    (tmp_path / "tiled-attention-report-cpu.md").unlink()
    (tmp_path / "tiled-attention-report-cpu.md").mkdir()  # the default path is checked before any work
    with pytest.raises(SystemExit) as e:
        report.main([])
    assert e.value.code == 2 and len(seen) == 2
    assert capsys.readouterr().err == ("error: argument --out: the default 'tiled-attention-report-cpu.md' is a "
                                       "folder; expected a file path to write; pass --out PATH\n")


@pytest.mark.parametrize("ok", [True, False])
def test_the_self_check_section_keeps_the_verdict_lines(monkeypatch, ok):
    """Of the self-check's output only the case lines and the verdict go into the file (not the detection text it
    prints first), under the verdict and the command that reruns it."""
    def fake_run(device):
        print("Detection report\nGPU: none\n")
        print("ok  chunked  float32   plain                    err 1e-07")
        print("BAD online   float16   causal                   err 3e-01")
        print("skipped float64 on cuda: not supported")
        print("\nall cases within tolerance" if ok else "\nSOME CASES FAILED: please report them")
        return ok
    monkeypatch.setattr(selfcheck, "run", fake_run)
    ctx = {}
    body = report.section_selfcheck("cpu", ctx)
    verdict = "passed" if ok else "FAILED"
    assert ctx["selfcheck"] == verdict
    assert body == (f"**{verdict}** (`python -m attention_core.selfcheck --device cpu`)\n\n```\n"
                    "ok  chunked  float32   plain                    err 1e-07\n"
                    "BAD online   float16   causal                   err 3e-01\n"
                    "skipped float64 on cuda: not supported\n"
                    + ("all cases within tolerance" if ok else "SOME CASES FAILED: please report them") + "\n```")


def test_run_bench_runs_the_preset_and_passes_its_lines_on(monkeypatch):
    """The benchmark child: the preset, the device, every method, --json; quick = 2 heads and --quick, full = 3
    rounds; ComfyUI when found; the pack on PYTHONPATH; each output line logged; the last 20 lines kept."""
    seen = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            seen.append((cmd, kw))
            self.stdout = iter(f"line {i}\n" for i in range(25))

        def wait(self):
            return 7
    monkeypatch.setattr(report.subprocess, "Popen", FakePopen)
    logged = []
    cmd, code, tail = report.run_bench("cpu", True, None, "/t/b.json", log=logged.append)
    assert cmd == [sys.executable, "-m", "attention_core.bench", "--preset", "wan22-5b-480p", "--device", "cpu",
                   "--methods", "math,torch,chunked,inplace,online,auto,comfy-subquad", "--json", "/t/b.json",
                   "--force-busy", "--heads", "2", "--quick"]
    assert code == 7 and tail == [f"line {i}" for i in range(5, 25)]
    assert logged == [f"  bench: line {i}" for i in range(25)]
    assert seen[0][1]["cwd"] == report.ROOT and seen[0][1]["env"]["PYTHONPATH"].split(os.pathsep)[0] == report.ROOT
    cmd, _, _ = report.run_bench("cuda", False, "/ComfyUI", "/t/b.json", log=lambda s: None)
    assert cmd[-4:] == ["--rounds", "3", "--comfyui", "/ComfyUI"]


def test_device_section_on_the_cpu(monkeypatch):
    import types
    import psutil
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=16 << 30,
                                                                                available=int(8.5 * 2 ** 30)))
    monkeypatch.setenv("TILED_ATTENTION", "off|on")
    monkeypatch.delenv("TILED_ATTENTION_TUNE", raising=False)
    ctx = {}
    table = report.section_device("cpu", ctx)
    name, arch = profiles._device_name("cpu")
    assert table.startswith("| | |\n|---|---|\n| device | cpu |\n")
    for row in (f"| name | {name} |", f"| arch | {arch} |", "| memory total | 16.0 GB |",
                "| memory free now | 8.5 GB |", f"| CPU threads (torch / cores) | {torch.get_num_threads()} / "
                f"{os.cpu_count()} |", "| ComfyUI for the comparison | none found (sub-quadratic not compared) |",
                "| $TILED_ATTENTION | off/on |"):
        assert row in table.splitlines(), (row, table)
    assert "$TILED_ATTENTION_TUNE" not in table and (ctx["name"], ctx["arch"]) == (name, arch)
    assert "| ComfyUI for the comparison | /my/ComfyUI |" in report.section_device("cpu", {"comfyui": "/my/ComfyUI"})


def test_device_section_on_a_faked_nvidia_gpu(monkeypatch):
    """An NVIDIA GPU has no gcnArchName: the arch is sm_<major><minor>; a free-memory query that fails is said in
    its cell instead of failing the section."""
    import types
    props = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                                  total_memory=int(139.8 * 2 ** 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (_ for _ in ()).throw(RuntimeError("busy")))
    ctx = {}
    table = report.section_device("cuda:0", ctx).splitlines()
    for row in ("| arch | sm_90 |", "| compute units / SMs | 132 |", "| memory total | 139.8 GB |",
                "| memory free now | (RuntimeError: busy) |"):
        assert row in table, (row, table)
    assert ctx["arch"] == "sm_90"


def test_main_on_a_gpu_defaults_to_the_full_benchmark_and_a_file_named_for_it(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(report, "build", lambda device, quick, comfyui, log=print: seen.append((device, quick))
                        or "# r\n")
    monkeypatch.setattr(report, "find_comfyui", lambda: None)
    monkeypatch.setattr(cli_args, "default_device", lambda: "cuda")
    monkeypatch.setattr(profiles, "_device_name", lambda d: ("NVIDIA H200", "sm_90"))
    monkeypatch.chdir(tmp_path)
    assert report.main([]) == 0 and seen == [("cuda", False)]
    assert (tmp_path / "tiled-attention-report-nvidia-h200-sm-90.md").is_file()
    assert report.main(["--quick"]) == 0 and seen[-1] == ("cuda", True)


def test_find_comfyui_prefers_the_configured_one(monkeypatch, tmp_path):
    from attention_core.cli import bench
    monkeypatch.setattr(bench, "default_comfyui", lambda: "/configured")
    assert report.find_comfyui() == "/configured"
    # a pack in <folder>/custom_nodes/<pack> whose folder is not a ComfyUI: none
    monkeypatch.setattr(bench, "default_comfyui", lambda: None)
    monkeypatch.setattr(report, "ROOT", str(tmp_path / "custom_nodes" / "tiled-attention"))
    assert report.find_comfyui() is None


@pytest.mark.parametrize("needs", [True, False])
def test_the_detection_section_leads_with_the_verdict(monkeypatch, needs):
    import types
    from attention_core.device import detection
    r = types.SimpleNamespace(needs_tiled_attention=needs, reason="no fused kernel for gfx906",
                              text=lambda: "line 1\n```\nline 3\n")
    monkeypatch.setattr(detection, "detect", lambda device: r)
    ctx = {}
    verdict = "needs tiled attention" if needs else "has fused attention"
    assert report.section_detection("cpu", ctx) == (f"**{verdict}**: no fused kernel for gfx906\n\n"
                                                    "```\nline 1\n'''\nline 3\n```")
    assert ctx["verdict"] == verdict
