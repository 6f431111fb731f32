"""Side-by-side attention benchmark: time, peak extra memory and max error vs float64, over sequence lengths.

    python -m attention_core.bench                          # the default sweep on the best device here
    python -m attention_core.bench --n 4096 --heads 16 --mode fwd --json out.json --plot out.png
    python -m attention_core.bench --comfyui /path/to/ComfyUI   # adds ComfyUI's sub-quadratic and split attention

Methods: torch math SDPA, torch's default SDPA (fused where it exists), each tier of this engine, and when
importable the peers noflash-attention 1.0.1 (its tier functions, called directly) and ComfyUI's attention.
Memory is measured honestly: on the CPU every case runs in a fresh process whose peak-RSS mark (VmHWM, the
per-process ru_maxrss) is reset once its inputs exist, and reports the peak's growth over that RSS; on a GPU,
torch.cuda.max_memory_allocated over the allocated baseline.
Cases run with OMP_WAIT_POLICY=PASSIVE unless set (the same for every method; see _run_in_subprocess).
Errors are against torch's math SDPA in float64 (or this engine's chunked tier in float64 when the float64
score matrix would not fit, marked "ref=tiled64").
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

METHODS = ["math", "torch", "chunked", "inplace", "online", "noflash-t1", "noflash-t2", "noflash-t3",
           "comfy-subquad", "comfy-split"]
MIB = 1 << 20


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
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if name == "math":
        def f(q, k, v):
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v)
        return f
    if name == "torch":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    if name in ("chunked", "inplace", "online"):
        from attention_core import scaled_dot_product_attention
        return lambda q, k, v: scaled_dot_product_attention(q, k, v, tier=name)
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

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    try:
        if dev.type == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        else:
            _reset_peak_rss()
            base = _rss()
        t0 = time.perf_counter()
        out = step()
        sync()
        first = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _peak_rss()) - base
        times = [first]
        for _ in range(case["repeats"] - 1):
            t0 = time.perf_counter()
            out = step()
            sync()
            times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - an OOM or a refusal is a result
        res["error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:160]}"
        return res
    res["ms"] = 1000 * (statistics.median(times[1:]) if len(times) > 1 else times[0])
    res["peak_mb"] = max(0, peak) / MIB
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
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.MATH]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
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
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def _table(rows, mode):
    rows = [r for r in rows if r["mode"] == mode]
    if not rows:
        return ""
    ns = sorted({r["n"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    out = [f"\n{'forward' if mode == 'fwd' else 'forward + backward'}  (ms / peak extra MB / max |err| vs fp64)"]
    head = f"{'method':<14}" + "".join(f"{'N=' + str(n):>30}" for n in ns)
    out += [head, "-" * len(head)]
    for m in methods:
        cells = []
        for n in ns:
            r = next((x for x in rows if x["method"] == m and x["n"] == n), None)
            if r is None:
                cells.append("")
            elif "ms" in r:
                err = r.get("grad_err", r["err"]) if mode == "fwdbwd" else r["err"]
                cells.append(f"{r['ms']:>9.0f} ms {r['peak_mb']:>7.0f} MB {err:>8.1e}")
            else:
                cells.append(("skipped" if "skipped" in r else "failed"))
        out.append(f"{m:<14}" + "".join(f"{c:>30}" for c in cells))
    notes = [f"  {r['method']} N={r['n']}: {r.get('skipped') or r.get('error')}" for r in rows
             if "ms" not in r]
    if notes:
        out += ["", *sorted(set(notes))]
    return "\n".join(out)


def _plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m and "ms" in r for r in rows)]
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4 * len(modes)), squeeze=False)
    for row, mode in zip(axes, modes):
        for m in METHODS:
            pts = sorted((r["n"], r["ms"], r["peak_mb"]) for r in rows if r["method"] == m and r["mode"] == mode
                         and "ms" in r)
            if not pts:
                continue
            style = dict(linestyle="-" if m in ("chunked", "inplace", "online") else "--", marker="o", label=m,
                         color=f"C{METHODS.index(m) % 10}")  # one colour per method in every panel
            row[0].plot([p[0] for p in pts], [p[1] for p in pts], **style)
            row[1].plot([p[0] for p in pts], [max(p[2], 0.1) for p in pts], **style)
        title = "forward" if mode == "fwd" else "forward + backward"
        for ax, what in zip(row, ("time (ms)", "peak extra memory (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(what)
            ax.set_title(f"{title}: {what}")
            ax.grid(True, which="both", alpha=0.3)
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m attention_core.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--n", default="1024,2048,4096", help="forward sequence lengths (comma separated)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--bwd-n", default="1024,2048", help="forward+backward sequence lengths")
    ap.add_argument("--bwd-heads", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="float32 on the CPU, float16 on GPUs by default")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator if any)")
    ap.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="both")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per case (0: torch's default)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--comfyui", default=os.environ.get("COMFYUI_PATH"), help="ComfyUI folder for its attention")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--plot", help="write a PNG of time and memory against N here")
    ap.add_argument("--from-json", help="print the tables (and --plot) of a saved --json run, running nothing")
    a = ap.parse_args(argv)
    if a.case:
        print(json.dumps(run_case(json.loads(a.case))))
        return 0
    if a.from_json:
        with open(a.from_json) as f:
            rows = json.load(f)["results"]
        for mode in ("fwd", "fwdbwd"):
            print(_table(rows, mode))
        if a.plot and _plot(rows, a.plot):
            print(f"wrote {a.plot}")
        return 0
    import torch
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype or ("float32" if device == "cpu" else "float16")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    plan = []
    if a.mode in ("fwd", "both"):
        plan += [("fwd", int(n), a.heads) for n in a.n.split(",")]
    if a.mode in ("fwdbwd", "both"):
        plan += [("fwdbwd", int(n), a.bwd_heads) for n in a.bwd_n.split(",")]
    rows = []
    info = {"device": device, "dtype": dtype, "torch": torch.__version__, "threads": a.threads or torch.get_num_threads(),
            "batch": a.batch, "dim": a.dim}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    print(f"# attention benchmark on {device} ({info.get('gpu', 'CPU')}), {dtype}, B={a.batch}, D={a.dim}, "
          f"torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for mode, n, heads in plan:
            case = dict(mode=mode, n=n, heads=heads, dim=a.dim, batch=a.batch, dtype=dtype, device=device, seed=n,
                        repeats=max(1, a.repeats), threads=a.threads, comfyui=a.comfyui)
            case["ref"] = os.path.join(tmp, f"ref-{mode}-{n}.pt")
            kind = make_reference(case, case["ref"])
            for m in methods:
                r = _run_in_subprocess(dict(case, method=m), a.timeout)  # a fresh process per case
                r.update(ref=kind, heads=heads)
                rows.append(r)
                shown = (f"{r['ms']:.0f} ms, {r['peak_mb']:.0f} MB, err {r.get('grad_err', r['err']):.1e}"
                         if "ms" in r else (r.get("skipped") or r.get("error")))
                print(f"  {mode:<6} N={n:<6} H={heads:<3} {m:<14} {shown}", flush=True)
    for mode in ("fwd", "fwdbwd"):
        t = _table(rows, mode)
        if t:
            print(t)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1)
        print(f"\nwrote {a.json}")
    if a.plot and _plot(rows, a.plot):
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
