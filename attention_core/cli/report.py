"""One Markdown file about this GPU to paste into an issue: device, arch, torch / ROCm (HIP) / CUDA versions, the
self-check, the detection verdict, and the benchmark at the Wan 2.2 5B 480p attention shape.

    python -m attention_core.report                       # the accelerator (else the CPU)
    python -m attention_core.report --quick               # 2 heads, one timed run: minutes on a small CPU
    python -m attention_core.report --device cuda:1 --out mi50.md

The benchmark is attention_core.bench at preset wan22-5b-480p (N=4,290 tokens, 24 heads x 128): torch math SDPA,
torch's default SDPA, this pack's tiers, and ComfyUI's sub-quadratic attention when a ComfyUI is found (--comfyui,
$COMFYUI_LATEST_PATH / $COMFYUI_PATH, or the ComfyUI this pack is installed in). Full size, 3 rounds, is the default
on GPUs; --quick (the default on the CPU) keeps 2 of the 24 heads and runs one round. Each section runs on its own:
one that fails is written into the file with its error, and the rest still run. Prints the file's path. The output
file is checked before anything runs (its folder and, when it exists, the file itself: attention_core.cli_args);
if writing still fails at the end, the report goes to a temporary file whose path the error line names.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

ISSUES = "https://github.com/tiled-attention/comfyui-tiled-attention/issues"
PRESET = "wan22-5b-480p"
METHODS = "math,torch,chunked,inplace,online,auto,comfy-subquad"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_SHOWN = ("HSA_OVERRIDE_GFX_VERSION", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "PYTORCH_HIP_ALLOC_CONF",
             "PYTORCH_CUDA_ALLOC_CONF", "MIOPEN_FIND_MODE", "TILED_ATTENTION", "TILED_ATTENTION_TUNE")


def find_comfyui():
    """ComfyUI for the sub-quadratic comparison: attention_core.bench's default, else the ComfyUI whose
    custom_nodes folder holds this pack; None when there is none."""
    from .bench import default_comfyui
    path = default_comfyui()
    if path:
        return path
    parent = os.path.dirname(ROOT)
    if os.path.basename(parent) == "custom_nodes":
        comfy = os.path.dirname(parent)
        if os.path.isfile(os.path.join(comfy, "comfy", "model_management.py")):
            return comfy
    return None


def _fence(text: str) -> str:
    return "```\n" + text.rstrip("\n").replace("```", "'''") + "\n```"


def _rocm_version():
    """The installed ROCm's version file ($ROCM_PATH, else /opt/rocm), or None."""
    for base in (os.environ.get("ROCM_PATH"), "/opt/rocm"):
        if base:
            try:
                with open(os.path.join(base, ".info", "version")) as f:
                    return f.read().strip()
            except OSError:
                continue
    return None


def _pack_version():
    from .. import __version__
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if rev.returncode == 0 and rev.stdout.strip():
            return f"{__version__} (git {rev.stdout.strip()})"
    except (OSError, subprocess.SubprocessError):
        pass
    return __version__


def _try(fn):
    """fn()'s value, '-' for None, or the error it raised: one table cell must not cost the whole section."""
    try:
        v = fn()
    except Exception as e:  # noqa: BLE001 - written into the cell
        return f"({type(e).__name__}: {e})"
    return "-" if v is None else v


# ------------------------------------------------------------------------------------------------ sections
def section_device(device, ctx):
    """Device, arch, memory and the software stack, as a two-column table."""
    import torch
    from ..device.profiles import _device_name
    name, arch = _device_name(device)
    rows = [("device", device), ("name", name)]
    d = torch.device(device)
    if d.type == "cuda":
        props = torch.cuda.get_device_properties(d)
        rows += [("arch", getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"),
                 ("compute units / SMs", props.multi_processor_count),
                 ("memory total", f"{props.total_memory / 2 ** 30:.1f} GB")]
        rows.append(("memory free now", _try(lambda: f"{torch.cuda.mem_get_info(d)[0] / 2 ** 30:.1f} GB")))
    else:
        import psutil
        vm = psutil.virtual_memory()
        rows += [("arch", arch), ("memory total", f"{vm.total / 2 ** 30:.1f} GB"),
                 ("memory free now", f"{vm.available / 2 ** 30:.1f} GB")]
    ctx["name"], ctx["arch"] = name, dict(rows).get("arch")
    rows += [("torch", torch.__version__),
             ("HIP (torch.version.hip)", getattr(torch.version, "hip", None) or "-"),
             ("ROCm installed", _rocm_version() or "-"),
             ("CUDA (torch.version.cuda)", torch.version.cuda or "-"),
             ("cuDNN / MIOpen", _try(lambda: torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
                                     else None)),
             ("Python", platform.python_version()), ("OS", platform.platform()),
             ("CPU threads (torch / cores)", f"{torch.get_num_threads()} / {os.cpu_count()}"),
             ("tiled-attention", _pack_version()),
             ("ComfyUI for the comparison", ctx.get("comfyui") or "none found (sub-quadratic not compared)")]
    rows += [(f"${k}", os.environ[k]) for k in ENV_SHOWN if k in os.environ]
    return "| | |\n|---|---|\n" + "\n".join(f"| {k} | {str(v).replace('|', '/')} |" for k, v in rows)


def section_detection(device, ctx):
    """attention_core.device.detection's verdict and its full report."""
    from ..device.detection import detect
    r = detect(device)
    ctx["verdict"] = "needs tiled attention" if r.needs_tiled_attention else "has fused attention"
    return f"**{ctx['verdict']}**: {r.reason}\n\n" + _fence(r.text())


def section_selfcheck(device, ctx):
    """attention_core.selfcheck: every tier against float64 math SDPA in the dtypes this device runs."""
    from . import selfcheck
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = selfcheck.run(device)
    ctx["selfcheck"] = "passed" if ok else "FAILED"
    lines = [ln for ln in out.getvalue().splitlines() if ln[:4] in ("ok  ", "BAD ") or ln.startswith(("skipped",
                                                                                                      "all ", "SOME"))]
    return f"**{ctx['selfcheck']}** (`python -m attention_core.selfcheck --device {device}`)\n\n" + _fence(
        "\n".join(lines))


def run_bench(device, quick, comfyui, json_path, log=print):
    """attention_core.bench at the preset in a child process (each case in its own process, as bench does);
    its console lines go to `log`. Returns (command, exit status, last lines of output). --force-busy: the report
    is taken whatever else runs (the bench JSON records the load; the section names the load average), not
    refused."""
    cmd = [sys.executable, "-m", "attention_core.bench", "--preset", PRESET, "--device", device, "--methods",
           METHODS, "--json", json_path, "--force-busy"] + (["--heads", "2", "--quick"] if quick else
                                                             ["--rounds", "3"])
    if comfyui:
        cmd += ["--comfyui", comfyui]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    tail = []
    for line in p.stdout:
        log("  bench: " + line.rstrip())
        tail = (tail + [line.rstrip()])[-20:]
    return cmd, p.wait(), tail


def section_bench(device, ctx):
    """The benchmark table (time, peak extra memory, max error vs float64) and the command that made it."""
    quick, comfyui = ctx["quick"], ctx.get("comfyui")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        cmd, code, tail = run_bench(device, quick, comfyui, path, ctx.get("log", print))
        if code != 0 or not os.path.isfile(path):
            raise RuntimeError(f"attention_core.bench exited {code}:\n" + "\n".join(tail))
        with open(path) as f:
            data = json.load(f)
    info, rows = data["info"], data["results"]
    shown = " ".join(a if re.fullmatch(r"[\w.,:/=+-]+", a) else repr(a) for a in ["python"] + cmd[1:]
                     if a not in ("--json", path, "--force-busy"))
    out = [f"`{shown}`", "",
           f"{'quick: 2 of the 24 heads, one timed run' if quick else 'full size, median of 3 rounds'}; "
           f"{info['dtype']}, torch threads {info['threads']}, machine load {info['load_start']} at the start and "
           f"{info['load_end']} at the end", "",
           "| method | shape | time (ms) | peak extra memory (MB) | max abs error vs float64 | note |",
           "|---|---|---|---|---|---|"]
    figures = {}
    for r in rows:
        shape = f"N={r['n']:,} {r['heads']}x{r['dim']}"
        if "ms" in r:
            err = r.get("err")
            figures[r["method"]] = f"{r['ms']:,.0f} ms {r['peak_mb']:,.0f} MB"
            out.append(f"| {r['method']} | {shape} | {r['ms']:,.1f} | {r['peak_mb']:,.0f} | "
                       f"{'-' if err is None else format(err, '.1e')} | |")
        else:
            note = (r.get("skipped") or r.get("error") or "").replace("|", "/")
            out.append(f"| {r['method']} | {shape} | - | - | - | {'not run' if 'skipped' in r else 'FAILED'}: "
                       f"{note} |")
    if not comfyui:
        out += ["", "ComfyUI was not found, so its sub-quadratic attention is not compared (run from "
                "ComfyUI/custom_nodes/<this pack>, or pass --comfyui PATH)."]
    ctx["bench"] = "; ".join(f"{m} {figures[m]}" for m in ("math", "auto", "comfy-subquad") if m in figures)
    return "\n".join(out)


SECTIONS = [("Device and software", section_device), ("Detection", section_detection),
            ("Self-check", section_selfcheck), ("Benchmark: Wan 2.2 5B 480p attention", section_bench)]


def build(device, quick, comfyui, log=print) -> str:
    """The whole report as Markdown; a section that raises is written as its error and traceback."""
    ctx = {"quick": quick, "comfyui": comfyui, "log": log}
    parts, failed = [], []
    for title, fn in SECTIONS:
        log(f"[report] {title} ...")
        t0 = time.perf_counter()
        try:
            body = fn(device, ctx)
        except Exception as e:  # noqa: BLE001 - a failure is what the report is for: write it and go on
            failed.append(title)
            body = (f"**This section failed**: `{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}`"
                    "\n\n" + _fence(traceback.format_exc()))
        parts.append(f"## {title}\n\n{body}\n\n_{time.perf_counter() - t0:.0f} s_")
    summary = [f"- device: {device} ({ctx.get('name', '?')}, {ctx.get('arch', '?')})",
               f"- detection: {ctx.get('verdict', 'failed, see below')}",
               f"- self-check: {ctx.get('selfcheck', 'failed to run, see below')}",
               f"- benchmark ({'quick' if quick else 'full'}): {ctx.get('bench') or 'see below'}"]
    if failed:
        summary.append(f"- sections that failed: {', '.join(failed)}")
    head = [f"# tiled-attention report: {ctx.get('name', device)} ({ctx.get('arch', '?')})", "",
            f"Made {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `python -m attention_core.report"
            f"{' --quick' if quick else ' --full'} --device {device}`.", "", *summary]
    return "\n".join(head) + "\n\n" + "\n\n".join(parts) + "\n"


def default_out(device) -> str:
    """tiled-attention-report-<gpu name>-<arch>.md (or -cpu.md) in the current folder."""
    if device == "cpu":
        return "tiled-attention-report-cpu.md"
    from ..device.profiles import _device_name
    slug = re.sub(r"[^a-z0-9]+", "-", "-".join(_device_name(device)).lower()).strip("-")[:60]
    return f"tiled-attention-report-{slug or 'gpu'}.md"


def main(argv=None) -> int:
    from . import cli_args
    ap = cli_args.Parser(prog="python -m attention_core.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=cli_args.device, default=None,
                    help="cpu, cuda, cuda:1 (default: the accelerator if any)")
    ap.add_argument("--out", type=cli_args.output_file, default=None,
                    help="Markdown file to write (default: tiled-attention-report-<device>.md here)")
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=None,
                      help="2 of the 24 heads, one timed run (the default on the CPU: a few minutes on a 2-core "
                           "one)")
    size.add_argument("--full", dest="quick", action="store_false",
                      help="all 24 heads, 3 rounds (the default on GPUs)")
    ap.add_argument("--comfyui", type=cli_args.comfyui_folder, default=None,
                    help="ComfyUI folder for its sub-quadratic attention (default: found as the benchmark does, or "
                         "the ComfyUI this pack is installed in)")
    a = ap.parse_args(argv)
    device = a.device or cli_args.default_device()
    quick = a.quick if a.quick is not None else device == "cpu"
    out = a.out or default_out(device)
    if a.out is None:  # the default path is checked like a given one, before minutes of work
        try:
            cli_args.output_file(out)
        except Exception as e:  # noqa: BLE001 - argparse.ArgumentTypeError, said as the flag's error
            cli_args.fail(ap, "--out", f"the default {e}; pass --out PATH")
    text = build(device, quick, a.comfyui or find_comfyui(), log=lambda s: print(s, flush=True))
    try:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as e:  # checked before the benchmark, so only a change since: the report is not thrown away
        kept = cli_args.keep_elsewhere(text, os.path.basename(out))
        print(f"error: could not write {out!r} ({e.strerror or e})" + (f"; the report is in {kept!r}" if kept
                                                                        else ""), file=sys.stderr)
        if not kept:
            print(text)
        return 2
    print(f"wrote {os.path.abspath(out)}\npaste it into an issue: {ISSUES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
