"""Side-by-side attention benchmark: time, peak extra memory and max error vs float64, over sequence lengths.

    python -m attention_core.bench                          # the default sweep on the best device here
    python -m attention_core.bench --n 4096 --heads 16 --mode fwd --json out.json --plot out.png
    python -m attention_core.bench --comfyui /path/to/ComfyUI   # ComfyUI's sub-quadratic and split attention from there
    python -m attention_core.bench --preset wan22-5b-480p --mode fwd      # a real video model's attention shape
    python -m attention_core.bench --preset wan22-5b-720p --quick         # big: one repeat, fewer methods, no fp64 ref

Presets (video self-attention, batch 1; tokens from attention_core.plan's latent rules):
    wan22-5b-480p   N=4,290   24 x 128  Wan 2.2 TI2V 5B, 832x480, 41 frames
    wan22-5b-4096   N=4,096   24 x 128  the same heads at N=4096 (the chunked-vs-math target)
    wan22-5b-720p   N=28,520  24 x 128  Wan 2.2 TI2V 5B, 1280x720, 121 frames
    wan-14b-480p    N=32,760  40 x 128  Wan 2.1/2.2 14B, 832x480, 81 frames
    ltx23-22b-720p  N=14,960  32 x 128  LTX-2.3 22B video stream, 1280x704, 129 frames
    reference       N=1024,2048,4096  16 x 64  the reference project's benchmark shape
Model presets (whole models and their steps, their own options: --preset NAME --help; attention_core.bench_models):
    zimage-turbo           Z-Image Turbo: attention at 512-2048 px (+ ComfyUI's sub-quadratic), a DiT step in ComfyUI
    qwen2.5-0.5b-prefill   Qwen 2.5 0.5B prefill at 1K-16K tokens, transformers' Qwen2 through the global patch
    qwen2.5-0.5b-decode    Qwen 2.5 0.5B decode step: one token against a 4K and a 16K cache

Methods: torch math SDPA, torch's default SDPA (fused where it exists), each tier of this engine (`chunked-prev`,
`auto-prev`: the same with the default CPU tiles before issue 18.5, 2^21 scores a forward tile; `chunked-queries`,
`chunked-keys`: the chunked tier with its score layout forced, issue 18.4), and when
importable the peers noflash-attention 1.0.1 (its tier functions, called directly) and ComfyUI's attention.
Memory is measured honestly: on the CPU every case runs in a fresh process whose peak-RSS mark (VmHWM, the
per-process ru_maxrss) is reset once its inputs exist, and reports the peak's growth over that RSS; on a GPU,
torch.cuda.max_memory_allocated over the allocated baseline.
Cases run with OMP_WAIT_POLICY=PASSIVE unless set (the same for every method; see _run_in_subprocess).
Errors are against torch's math SDPA in float64 (or this engine's chunked tier in float64 when the float64
score matrix would not fit, marked "ref=tiled64").
Every case's line names the load it ran at: other processes' runnable threads while it ran ("others", sampled by
attention_core.device.machine_load) and the 1-minute load average. --json and --plot are not written when other
processes kept the machine busy (machine_load's threshold: a quarter of the cores) unless --force-busy; the JSON's
info holds the load either way ("load": mean, max, cores, threshold, busy, forced).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..device import machine_load
from ..device.sync import synchronize
from .plan import PRESETS, preset_shapes

METHODS = ["math", "torch", "chunked", "inplace", "online", "auto", "chunked-prev", "auto-prev", "chunked-queries",
           "chunked-keys", "tuned", "noflash-t1", "noflash-t2",
           "noflash-t3", "comfy-subquad", "comfy-split"]
QUICK_METHODS = ["math", "torch", "chunked", "auto", "tuned", "comfy-subquad"]
PREV_CPU_TARGET = 1 << 21  # the CPU forward tile target before issue 18.5 (chunked-prev, auto-prev)
MIB = 1 << 20
GIB = 1 << 30

def default_comfyui():
    """ComfyUI for the comfy-* methods: $COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the stock 0.33.0 ./dev set up."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for path in (os.environ.get("COMFYUI_LATEST_PATH"), os.environ.get("COMFYUI_PATH"),
                 os.path.join(root, ".cache", "comfyui-0.33.0")):
        if path and os.path.isfile(os.path.join(path, "comfy", "model_management.py")):
            return path
    return None


def method_bytes(method, case, free):
    """Transient bytes `method` needs for `case` (attention_core.plan's rules), or None when it is O(N)."""
    from . import plan
    bh, n = case["batch"] * case["heads"], case["n"]
    e = {"float32": 4, "float64": 8}.get(case["dtype"], 2)
    grad = 2 if case["mode"] == "fwdbwd" else 1
    if method == "math":
        return grad * plan.math_bytes(bh, n, e)
    if method == "comfy-subquad":
        return grad * plan.comfy_subquad(bh, n, e, free)["bytes"]
    if method == "comfy-split":
        sp = plan.comfy_split(bh, n, e, free)
        return sp["bytes"] if sp["bytes"] is not None else float("inf")
    if method == "noflash-t1":
        return 2 * bh * n * n * e // 4  # its tier-1 chunks hold about a quarter of the scores at a time
    return None


# ----------------------------------------------------------------------------------------------- one case
def _inputs(case, torch, requires_grad=False):
    g = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["heads"], case["n"], case["dim"])
    dt = getattr(torch, case["dtype"])
    ts = [torch.randn(*shape, generator=g).to(case["device"], dt) for _ in range(4)]  # q, k, v, dout
    if requires_grad:
        for t in ts[:3]:
            t.requires_grad_(True)
    return ts


def _method_fn(name, case, torch):
    """A callable (q, k, v) -> out for `name`, or a string saying why it is unavailable."""
    from attention_core.device.torch_sdpa import math_sdpa, torch_sdpa  # torch's own, even with the patch on
    if name == "math":
        return lambda q, k, v: math_sdpa(q, k, v)
    if name == "torch":
        return lambda q, k, v: torch_sdpa(q, k, v)
    if name in ("chunked", "inplace", "online", "auto"):
        from attention_core import scaled_dot_product_attention
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier=name)
    if name in ("chunked-prev", "auto-prev"):
        from attention_core.kernel import memory
        from attention_core import scaled_dot_product_attention
        # this case's own process (see _run_in_subprocess): the previous CPU defaults, forward and backward tiles
        # aiming at 2^21 scores
        memory.TARGET_TILE_ELEMS = dict(memory.TARGET_TILE_ELEMS, cpu=PREV_CPU_TARGET)
        memory.BACKWARD_TILE_ELEMS = dict(memory.BACKWARD_TILE_ELEMS, cpu=PREV_CPU_TARGET)
        tier = name[: -len("-prev")]
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier=tier)
    if name in ("chunked-queries", "chunked-keys"):
        import os

        from attention_core.device import profiles
        from attention_core import scaled_dot_product_attention
        os.environ[profiles.ENV_LAYOUT] = name[len("chunked-"):]  # this case's own process (_run_in_subprocess)
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier="chunked")
    if name == "tuned":
        from ..device import profiles
        from . import tune
        entry = profiles.lookup(q_shape=(case["batch"], case["heads"], case["n"], case["dim"]), dtype=case["dtype"],
                                device=case["device"])
        if entry is None:
            return (f"no tuned profile for this device and dtype ({profiles.profile_path()}): "
                    "python -m attention_core.tune")
        return lambda q, k, v: tune.run_blocks(q, k, v, entry)
    if name.startswith("noflash"):
        try:
            import contextlib
            import io
            with contextlib.redirect_stdout(io.StringIO()):
                import noflash_attention as nf  # it patches torch's SDPA on import where it thinks it should
                nf.disable()
            from noflash_attention import patch as nfp
        except Exception as e:  # noqa: BLE001
            return f"not importable ({e.__class__.__name__}); pip install noflash-attention==1.0.1"
        B, H, N = case["batch"], case["heads"], case["n"]
        dt = getattr(torch, case["dtype"])
        if name == "noflash-t1":  # the block size its dispatcher picks for tier 1
            bm = nfp._auto_block_m(B, N, H, dt, budget_factor=2)
            return lambda q, k, v: nfp.chunked_sdpa(q, k, v, None, bm)
        if name == "noflash-t2":
            bm = nfp._auto_block_m(B, N, H, dt, budget_factor=1)
            bn = nfp._auto_block_n(B, bm, H, dt)
            return lambda q, k, v: nfp.chunked_sdpa_online(q, k, v, None, bm, bn)
        bm = nfp._auto_block_m(B, N, H, dt, budget_factor=1)
        return lambda q, k, v: nfp.chunked_sdpa_inplace(q, k, v, None, bm)
    if name.startswith("comfy"):
        path = case.get("comfyui")
        if not path:
            return "no ComfyUI path (--comfyui or COMFYUI_PATH)"
        try:
            fn = _comfy_attention(path, name)
        except Exception as e:  # noqa: BLE001
            return f"ComfyUI import failed: {e}"
        heads = case["heads"]
        return lambda q, k, v: fn(q, k, v, heads, skip_reshape=True, skip_output_reshape=True)
    raise ValueError(f"unknown method {name}")


def _comfy_attention(path, name):
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    if comfy.cli_args.args is not None:
        import torch
        if not torch.cuda.is_available():
            comfy.cli_args.args.cpu = True
    from comfy.ldm.modules import attention
    return attention.attention_sub_quad if name == "comfy-subquad" else attention.attention_split


def _rss():
    import psutil
    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss():
    """Peak RSS of this process image: VmHWM (not inherited across fork+exec, unlike ru_maxrss, which carries
    the parent's peak into the child), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_case(case) -> dict:
    """Run one (method, n, mode) in this process; returns time, peak extra memory and errors."""
    import torch
    torch.set_num_threads(case.get("threads") or torch.get_num_threads())
    res = {k: case[k] for k in ("method", "n", "mode", "heads", "dim", "batch", "dtype", "device")}
    res["repeats"] = case["repeats"]
    fn = _method_fn(case["method"], case, torch)
    if isinstance(fn, str):
        res["skipped"] = fn
        return res
    bwd = case["mode"] == "fwdbwd"
    dev = torch.device(case["device"])
    # warm up on a small problem first: lazy library init and thread pools are not the method's memory
    small = _inputs(dict(case, n=min(case["n"], 128)), torch, requires_grad=bwd)
    try:
        o = fn(*small[:3])
        if bwd:
            o.backward(small[3])
    except Exception:  # noqa: BLE001 - the real run reports it
        pass
    del small
    q, k, v, dout = _inputs(case, torch, requires_grad=bwd)

    def step():
        if bwd:
            for t in (q, k, v):
                t.grad = None
            out = fn(q, k, v)
            out.backward(dout)
            return out.detach()
        with torch.no_grad():
            return fn(q, k, v)

    try:
        if dev.type == "cuda":
            synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            _reset_peak_rss()
            base = _rss()
        t0 = time.perf_counter()
        out = step()
        synchronize(dev)
        first = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _peak_rss()) - base
        times = [first]
        for _ in range(case["repeats"] - 1):
            t0 = time.perf_counter()
            out = step()
            synchronize(dev)
            times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - an OOM or a refusal is a result
        res["error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:160]}"
        return res
    res["ms"] = 1000 * (statistics.median(times[1:]) if len(times) > 1 else times[0])
    res["peak_mb"] = max(0, peak) / MIB
    if not case.get("ref"):
        return res
    ref = torch.load(case["ref"], weights_only=True)
    res["err"] = float((out.double().cpu() - ref["out"]).abs().max())
    if bwd:
        res["grad_err"] = max(float((t.grad.double().cpu() - ref[n]).abs().max()) for t, n in
                              zip((q, k, v), ("dq", "dk", "dv")))
    return res


# ------------------------------------------------------------------------------------------- reference
def make_reference(case, path):
    """float64 output (and gradients) for the case's inputs; torch math when its scores fit, else tiled."""
    import torch
    c = dict(case, dtype="float64", device="cpu")
    q, k, v, dout = _inputs(dict(case, device="cpu"), torch)
    q, k, v, dout = (t.double().requires_grad_(i < 3) for i, t in enumerate((q, k, v, dout)))
    score_bytes = c["batch"] * c["heads"] * c["n"] ** 2 * 8
    if score_bytes * 3 < 6 << 30:
        from attention_core.device.torch_sdpa import math_sdpa
        out = math_sdpa(q, k, v)
        kind = "math64"
    else:
        from attention_core import scaled_dot_product_attention
        out = scaled_dot_product_attention(q, k, v, tier="chunked")
        kind = "tiled64"
    ref = {"out": out.detach()}
    if case["mode"] == "fwdbwd":
        out.backward(dout)
        ref.update(dq=q.grad, dk=k.grad, dv=v.grad)
    torch.save(ref, path)
    return kind


# ------------------------------------------------------------------------------------------------ driver
def _run_in_subprocess(case, timeout):
    cmd = [sys.executable, "-m", "attention_core.bench", "--case", json.dumps(case)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # torch's OpenMP pool spins between ops by default; on small shared VMs (2 vCPUs) spinning workers starve the
    # main thread and make timings bimodal (10x swings run to run). Every method runs with the same setting.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return {k: case[k] for k in ("method", "n", "mode")} | {"error": f"timeout after {timeout}s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        killed = " (killed: out of memory?)" if p.returncode in (-9, 137) else ""
        return {k: case[k] for k in ("method", "n", "mode")} | {"error": f"exit {p.returncode}{killed}: {tail}"}
    return json.loads(lines[-1])


def _label(r):
    """The column a result belongs to: shape and dtype (several presets can share an N)."""
    return f"N={r['n']} {r['heads']}x{r['dim']} {r['dtype']}"


def _table(rows, mode):
    rows = [r for r in rows if r["mode"] == mode]
    if not rows:
        return ""
    labels = list(dict.fromkeys(_label(r) for r in rows))
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    out = [f"\n{'forward' if mode == 'fwd' else 'forward + backward'}  (ms / peak extra MB / max |err| vs fp64)"]
    head = f"{'method':<14}" + "".join(f"{lab:>32}" for lab in labels)
    out += [head, "-" * len(head)]
    for m in methods:
        cells = []
        for lab in labels:
            r = next((x for x in rows if x["method"] == m and _label(x) == lab), None)
            if r is None:
                cells.append("")
            elif "ms" in r:
                err = r.get("grad_err", r.get("err")) if mode == "fwdbwd" else r.get("err")
                shown = f"{err:>8.1e}" if err is not None else f"{'-':>8}"
                cells.append(f"{r['ms']:>9.0f} ms {r['peak_mb']:>7.0f} MB {shown}")
            else:
                cells.append(("skipped" if "skipped" in r else "failed"))
        out.append(f"{m:<14}" + "".join(f"{c:>32}" for c in cells))
    notes = [f"  {r['method']} {_label(r)}: {r.get('skipped') or r.get('error')}" for r in rows if "ms" not in r]
    if notes:
        out += ["", *sorted(set(notes))]
    return "\n".join(out)


def _plot(rows, path, load=None):
    """Bars per shape: time and peak extra memory of every method that ran (log scale), the pack's tiers solid;
    `load` (machine_load's summary, as --json saves it in info) is named under the title."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    groups = [(mode, lab) for mode in ("fwd", "fwdbwd") for lab in dict.fromkeys(_label(r) for r in rows
                                                                                   if r["mode"] == mode)]
    groups = [g for g in groups if any(r["mode"] == g[0] and _label(r) == g[1] and "ms" in r for r in rows)]
    fig, axes = plt.subplots(len(groups), 2, figsize=(12, 3.2 * len(groups) + 0.6), squeeze=False)
    ours = ("chunked", "inplace", "online", "auto", "chunked-prev", "auto-prev", "chunked-queries", "chunked-keys",
            "tuned")
    for row, (mode, lab) in zip(axes, groups):
        got = [(m, r) for m in METHODS for r in rows if r["method"] == m and r["mode"] == mode
               and _label(r) == lab and "ms" in r]
        names = [m for m, _ in got]
        colors = [f"C{METHODS.index(m) % 10}" for m in names]
        for ax, key, what in ((row[0], "ms", "time (ms)"), (row[1], "peak_mb", "peak extra memory (MB)")):
            vals = [max(r[key], 0.1) for _, r in got]
            bars = ax.barh(names, vals, color=colors)
            for b, m in zip(bars, names):
                b.set_hatch("" if m in ours else "//")
            for y, v in enumerate(vals):
                ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)
            ax.set_xscale("log")
            ax.invert_yaxis()
            ax.set_title(f"{'forward' if mode == 'fwd' else 'fwd+bwd'} {lab}: {what}", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.grid(True, axis="x", which="both", alpha=0.3)
    title = "attention methods side by side (solid: this pack; hatched: others); lower is better"
    if load:
        title += "\nmeasured at: " + machine_load.describe(load) + (" (saved anyway: --force-busy)"
                                                                     if load.get("forced") else "")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def merge_rounds(rs):
    """One row from the rounds of a method: median time and memory, largest error, each round's time kept."""
    ok = [r for r in rs if "ms" in r]
    if not ok:
        return rs[0]
    row = dict(ok[0])
    if len(rs) > 1:
        row.update(ms=statistics.median(r["ms"] for r in ok), peak_mb=statistics.median(r["peak_mb"] for r in ok),
                   round_ms=[r["ms"] for r in ok], round_load=[r["load"] for r in ok],
                   round_others=[r.get("others") for r in ok])
        for key in ("err", "grad_err"):
            if any(r.get(key) is not None for r in ok):
                row[key] = max(r[key] for r in ok if r.get(key) is not None)
    return row


def build_plan(a):
    """[(mode, N, heads, head dim, dtype)] from --preset or the explicit --n/--heads/--dim options."""
    dtypes = [d.strip() for d in a.dtype.split(",")]
    shapes = []
    if a.preset:
        for name in a.preset.split(","):
            shapes += [(name.strip(), n, a.heads or h, d) for n, h, d in preset_shapes(name.strip())]
        plan = [("fwd" if a.mode != "fwdbwd" else "fwdbwd", n, h, d, dt, name) for name, n, h, d in shapes
                for dt in dtypes]
        return plan
    plan = []
    if a.mode in ("fwd", "both"):
        plan += [("fwd", int(n), a.heads or 16, a.dim, dt, "") for dt in dtypes for n in a.n.split(",")]
    if a.mode in ("fwdbwd", "both"):
        plan += [("fwdbwd", int(n), a.bwd_heads, a.dim, dt, "") for dt in dtypes for n in a.bwd_n.split(",")]
    return plan


def _load():
    """The 1-minute load average and the CPU count: how busy the machine was while a case ran."""
    try:
        return f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}"
    except OSError:
        return "?"


def load_results(path, with_info=False):
    """The result rows of a run saved with --json (with_info: (rows, its info object or {})); ValueError saying
    what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read it ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    rows = data.get("results") if isinstance(data, dict) else None
    keys = {"method", "mode", "n", "heads", "dim", "dtype"}
    if not isinstance(rows, list) or not all(isinstance(r, dict) and keys <= r.keys() for r in rows):
        raise ValueError("not a run saved with --json (an object whose 'results' lists rows with "
                         f"{', '.join(sorted(keys))})")
    if with_info:
        info = data.get("info")
        return rows, info if isinstance(info, dict) else {}
    return rows


def main(argv=None):
    from . import bench_models, cli_args
    if bench_models.wants(sys.argv[1:] if argv is None else argv):  # a model preset: its own options and tables
        return bench_models.main(argv)
    ap = cli_args.Parser(prog="python -m attention_core.bench", description=__doc__.split("\n\n")[0],
                         epilog="presets: " + ", ".join(PRESETS) + "; model presets (--preset NAME --help for "
                         "their options): " + bench_models.help_lines())
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--preset", type=cli_args.choice_list(PRESETS, "presets"),
                    help="comma-separated presets (real model shapes; see the module docstring)")
    ap.add_argument("--n", type=cli_args.int_list(1), default="1024,2048,4096",
                    help="forward sequence lengths (comma separated)")
    ap.add_argument("--heads", type=cli_args.int_range(1), default=None,
                    help="heads (default 16); with --preset it replaces the preset's heads (a quicker run of the "
                         "same per-head shape; the table shows the heads used)")
    ap.add_argument("--dim", type=cli_args.int_range(1), default=64)
    ap.add_argument("--batch", type=cli_args.int_range(1), default=1)
    ap.add_argument("--bwd-n", type=cli_args.int_list(1), default="1024,2048",
                    help="forward+backward sequence lengths")
    ap.add_argument("--bwd-heads", type=cli_args.int_range(1), default=8)
    ap.add_argument("--dtype", type=cli_args.dtype_list, default=None,
                    help="comma separated; float32 on the CPU, float16 on GPUs by default")
    ap.add_argument("--device", type=cli_args.device, default=None,
                    help="cpu, cuda, cuda:1, ... (default: the accelerator if any)")
    ap.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default=None,
                    help="default: both, or fwd with --preset")
    ap.add_argument("--methods", type=cli_args.choice_list(METHODS, "methods"), default=None,
                    help=f"comma separated, default all: {','.join(METHODS)}")
    ap.add_argument("--repeats", type=cli_args.int_range(1, 1000), default=3,
                    help="timed runs per case after the first (median)")
    ap.add_argument("--rounds", type=cli_args.int_range(1, 100), default=1,
                    help="run every method once per round, rounds alternating the method order, and report the "
                         "median over rounds (for busy machines: load drift hits every method alike)")
    ap.add_argument("--quick", action="store_true",
                    help=f"one timed run, methods {','.join(QUICK_METHODS)} unless --methods, no float64 "
                         "reference above N=8192 (error column '-')")
    ap.add_argument("--no-ref", action="store_true", help="skip the float64 reference (no error column)")
    ap.add_argument("--threads", type=cli_args.int_range(0, 1024), default=0,
                    help="torch threads per case (0: torch's default)")
    ap.add_argument("--timeout", type=cli_args.int_range(1, 7 * 86400), default=900, help="seconds per case")
    ap.add_argument("--comfyui", type=cli_args.comfyui_folder, default=default_comfyui(),
                    help="ComfyUI folder for its attention (default: "
                    "$COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the stock 0.33.0 of ./dev)")
    ap.add_argument("--json", type=cli_args.at_caller(cli_args.output_file), help="write all results here")
    ap.add_argument("--plot", type=cli_args.at_caller(cli_args.output_file),
                    help="write a PNG of time and memory per method here")
    ap.add_argument("--from-json", type=cli_args.at_caller(cli_args.existing_file),
                    help="print the tables (and --plot) of a saved --json run, running nothing")
    ap.add_argument(machine_load.FORCE_FLAG, action="store_true",
                    help="write --json / --plot even when other processes kept the machine busy while it measured "
                         "(their runnable threads above a quarter of the cores on average); the files record the load")
    a = ap.parse_args(argv)
    if a.case:
        try:
            case = json.loads(a.case)
        except ValueError as e:
            cli_args.fail(ap, "--case", f"not JSON ({e}); it is internal: one case, as this module's driver passes it")
        print(json.dumps(run_case(case)))
        return 0
    if a.from_json:
        try:
            rows, saved = load_results(a.from_json, with_info=True)
        except ValueError as e:
            cli_args.fail(ap, "--from-json", f"{a.from_json}: {e}")
        for mode in ("fwd", "fwdbwd"):
            print(_table(rows, mode))
        load = saved.get("load") if isinstance(saved.get("load"), dict) and "cores" in saved["load"] else None
        if load:
            print(f"\nmeasured at: {machine_load.describe(load)}")
        if a.plot and _plot(rows, a.plot, load):
            print(f"wrote {a.plot}")
        return 0
    a.mode = a.mode or ("fwd" if a.preset else "both")
    import torch
    device = a.device or cli_args.default_device()
    a.dtype = a.dtype or ("float32" if device == "cpu" else "float16")
    methods = [m.strip() for m in (a.methods or ",".join(QUICK_METHODS if a.quick else METHODS)).split(",")
               if m.strip()]
    from ..kernel.memory import free_memory
    for mode, n, heads, dim, dtype, _ in build_plan(a):  # inputs that cannot exist: say so before running
        need = 4 * a.batch * heads * n * dim * getattr(torch, dtype).itemsize  # q, k, v and the output gradient
        free = free_memory(torch.device(device))
        if free is not None and need > free:
            flag = ("--preset/--heads/--batch" if a.preset else "--bwd-n/--bwd-heads/--dim/--batch" if mode == "fwdbwd"
                    else "--n/--heads/--dim/--batch")
            cli_args.fail(ap, flag, f"N={n} x {heads} heads x {dim} dims x batch {a.batch} in {dtype}: the inputs "
                                    f"alone take {need / GIB:,.1f} GB, {free / GIB:,.1f} GB free on {device}; "
                                    "choose a smaller shape")
    repeats = 1 if a.quick else max(1, a.repeats)
    rows = []
    info = {"device": device, "dtype": a.dtype, "torch": torch.__version__,
            "threads": a.threads or torch.get_num_threads(), "batch": a.batch, "preset": a.preset,
            "command": "python -m attention_core.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "comfyui": a.comfyui, "load_start": _load()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    print(f"# attention benchmark on {device} ({info.get('gpu', 'CPU')}), {a.dtype}, B={a.batch}, "
          f"torch {torch.__version__}, ComfyUI from {a.comfyui}, load {info['load_start']}", flush=True)
    monitor = machine_load.Monitor(force=a.force_busy)
    with tempfile.TemporaryDirectory() as tmp, monitor:
        for mode, n, heads, dim, dtype, preset in build_plan(a):
            case = dict(mode=mode, n=n, heads=heads, dim=dim, batch=a.batch, dtype=dtype, device=device, seed=n,
                        repeats=1 if a.quick else repeats + 1, threads=a.threads, comfyui=a.comfyui, preset=preset)
            if a.no_ref or (a.quick and n > 8192):
                case["ref"], kind = None, "none"
            else:
                case["ref"] = os.path.join(tmp, f"ref-{mode}-{n}-{heads}-{dim}-{dtype}.pt")
                kind = make_reference(case, case["ref"])
            by_method = {m: [] for m in methods}
            for rnd in range(a.rounds):
                for m in (methods if rnd % 2 == 0 else methods[::-1]):  # alternate the order round to round
                    free = free_memory(torch.device(device)) or 0
                    need = method_bytes(m, case, free)
                    if need is not None and need > 0.9 * free:
                        r = {**{k: case[k] for k in ("n", "mode", "heads", "dim", "dtype")}, "method": m,
                             "skipped": f"needs ~{need / GIB:.1f} GB, {free / GIB:.1f} GB available: not run"}
                    else:
                        with monitor.span() as span:
                            r = _run_in_subprocess(dict(case, method=m), a.timeout)  # a fresh process per case
                        r["others"] = {"mean": span.mean, "max": span.max}
                    r.update(ref=kind, heads=heads, dim=dim, dtype=dtype, preset=preset, load=_load())
                    by_method[m].append(r)
                    err = r.get("grad_err", r.get("err"))
                    shown = (f"{r['ms']:.0f} ms, {r['peak_mb']:.0f} MB, err "
                             f"{'-' if err is None else format(err, '.1e')}"
                             if "ms" in r else (r.get("skipped") or r.get("error")))
                    others = (machine_load.figure_text(r["others"]["mean"], r["others"]["max"]) + ", "
                              if "others" in r else "")
                    print(f"  {mode:<6} N={n:<6} {heads}x{dim} {dtype:<8} {m:<14} {shown}   ({others}load {r['load']}"
                          f"{f', round {rnd + 1}' if a.rounds > 1 else ''})", flush=True)
            rows += [merge_rounds(rs) for rs in by_method.values()]
    info["load_end"] = _load()
    info["load"] = load = monitor.summary()
    for mode in ("fwd", "fwdbwd"):
        t = _table(rows, mode)
        if t:
            print(t)
    print(f"\nmeasured at: {monitor.text()} (load average {info['load_start']} at the start, {info['load_end']} "
          "at the end)")
    if a.json or a.plot:
        refused = machine_load.refusal(load, " / ".join(f for f, v in (("--json", a.json), ("--plot", a.plot))
                                                         if v))
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return 2
    if load["busy"]:
        print(f"warning: machine busy ({machine_load.describe(load)}): these figures are unreliable"
              + (f"; saved anyway ({machine_load.FORCE_FLAG})" if load["forced"] else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1)
        print(f"\nwrote {a.json}")
    if a.plot and _plot(rows, a.plot, load):
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
