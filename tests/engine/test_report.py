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

from attention_core import report, selfcheck
from attention_core.detection import detect

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
    (["--comfyui", "{tmp}"], "--comfyui", "comfy/model_management.py"),
    (["--quick", "--full"], "--full", "not allowed with argument --quick"),
    (["--rounds", "3"], "", "unrecognized arguments"),
])
def test_report_bad_input(argv, flag, word, tmp_path, capsys):
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


def test_comfyui_is_the_one_the_pack_is_installed_in(tmp_path, monkeypatch):
    """With no configured ComfyUI (bench's default finds none), a pack in <ComfyUI>/custom_nodes/<pack> compares
    against that ComfyUI; elsewhere there is none."""
    from attention_core import bench
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
