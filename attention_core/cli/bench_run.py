"""The benchmark's runner: every case (one method at one shape) in a fresh process, timed and measured there.

run_case (the child's work, `python -m attention_core.bench --case JSON`): inputs from the case's seed, a warm-up
on a small problem, then peak extra memory of the first call (CPU: peak RSS, VmHWM, reset once the inputs exist;
GPU: torch.cuda.max_memory_allocated over the allocated baseline), the median time of the calls after it, and the
max error against a float64 reference (make_reference). sweep (the parent's): for each case of the run a
reference, then every method once per round, rounds alternating the method order, each in its own process
(_run_in_subprocess), a method that cannot fit skipped (bench_methods.method_bytes), each line printed with the
load it ran at; merge_rounds makes one row per method from its rounds.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from ..device import machine_load
from ..device.sync import synchronize
from .bench_methods import method_bytes, method_fn
from .bench_presets import build_plan

MIB = 1 << 20
GIB = 1 << 30


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
    fn = method_fn(case["method"], case, torch)
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
OMP_WAIT_POLICIES = ("passive", "active", "default")


def child_env(root: str, omp_wait_policy=None) -> dict:
    """The environment a case's fresh process runs in: ours, `root` first on PYTHONPATH, and OpenMP's wait policy.

    omp_wait_policy None: $OMP_WAIT_POLICY when set, else PASSIVE (torch's OpenMP pool spins between ops by default;
    on small shared VMs (2 vCPUs) spinning workers starve the main thread and make timings bimodal, 10x swings run
    to run); "passive" / "active": that policy; "default": the variable removed, so OpenMP's own default runs (spin a
    while, then sleep: what a process started without it, ComfyUI's included, gets). Every method runs with the same."""
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if omp_wait_policy is None:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    elif omp_wait_policy == "default":
        env.pop("OMP_WAIT_POLICY", None)
    elif omp_wait_policy in OMP_WAIT_POLICIES:
        env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    else:
        raise ValueError(f"omp_wait_policy {omp_wait_policy!r}: expected one of {', '.join(OMP_WAIT_POLICIES)}")
    return env


def _run_in_subprocess(case, timeout):
    cmd = [sys.executable, "-m", "attention_core.bench", "--case", json.dumps(case)]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = child_env(root, case.get("omp_wait_policy"))
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


def _load():
    """The 1-minute load average and the CPU count: how busy the machine was while a case ran."""
    try:
        return f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}"
    except OSError:
        return "?"


def run_child(ap, text):
    """The internal `--case JSON` entry: one case, as _run_in_subprocess passes it; its result as one JSON line."""
    from . import cli_args
    try:
        case = json.loads(text)
    except ValueError as e:
        cli_args.fail(ap, "--case", f"not JSON ({e}); it is internal: one case, as this module's driver passes it")
    print(json.dumps(run_case(case)))
    return 0


def sweep(a, device, methods, argv):
    """Run every case of the options `a` with `methods` on `device`: (result rows, the run's info: what --json saves
    beside them, the load while it ran included). Prints a header, then a line per method and round as each ends."""
    import torch
    repeats = 1 if a.quick else max(1, a.repeats)
    rows = []
    info = {"device": device, "dtype": a.dtype, "torch": torch.__version__,
            "threads": a.threads or torch.get_num_threads(), "batch": a.batch, "preset": a.preset,
            "command": "python -m attention_core.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "comfyui": a.comfyui, "load_start": _load(),
            "omp_wait_policy": child_env("", a.omp_wait_policy).get("OMP_WAIT_POLICY", "unset (OpenMP's default)")}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    print(f"# attention benchmark on {device} ({info.get('gpu', 'CPU')}), {a.dtype}, B={a.batch}, "
          f"torch {torch.__version__}, ComfyUI from {a.comfyui}, OMP_WAIT_POLICY {info['omp_wait_policy']}, "
          f"load {info['load_start']}", flush=True)
    monitor = machine_load.Monitor(force=a.force_busy)
    with tempfile.TemporaryDirectory() as tmp, monitor:
        for mode, n, heads, dim, dtype, preset in build_plan(a):
            case = dict(mode=mode, n=n, heads=heads, dim=dim, batch=a.batch, dtype=dtype, device=device, seed=n,
                        repeats=1 if a.quick else repeats + 1, threads=a.threads, comfyui=a.comfyui, preset=preset,
                        omp_wait_policy=a.omp_wait_policy)
            if a.no_ref or (a.quick and n > 8192):
                case["ref"], kind = None, "none"
            else:
                case["ref"] = os.path.join(tmp, f"ref-{mode}-{n}-{heads}-{dim}-{dtype}.pt")
                kind = make_reference(case, case["ref"])
            by_method = {m: [] for m in methods}
            for rnd in range(a.rounds):
                for m in (methods if rnd % 2 == 0 else methods[::-1]):  # alternate the order round to round
                    r = _run_method(case, m, a.timeout, monitor, torch)
                    r.update(ref=kind, heads=heads, dim=dim, dtype=dtype, preset=preset, load=_load())
                    by_method[m].append(r)
                    print(_progress_line(case, m, r) + (f", round {rnd + 1})" if a.rounds > 1 else ")"), flush=True)
            rows += [merge_rounds(rs) for rs in by_method.values()]
    info["load_end"] = _load()
    info["load"] = monitor.summary()
    return rows, info


def _run_method(case, method, timeout, monitor, torch):
    """One method at `case` in a fresh process, with the other processes' load while it ran ("others"); a row
    saying why not when the memory it needs (bench_methods.method_bytes) is not free."""
    from ..kernel.memory import free_memory
    free = free_memory(torch.device(case["device"])) or 0
    need = method_bytes(method, case, free)
    if need is not None and need > 0.9 * free:
        return {**{k: case[k] for k in ("n", "mode", "heads", "dim", "dtype")}, "method": method,
                "skipped": f"needs ~{need / GIB:.1f} GB, {free / GIB:.1f} GB available: not run"}
    with monitor.span() as span:
        r = _run_in_subprocess(dict(case, method=method), timeout)  # a fresh process per case
    r["others"] = {"mean": span.mean, "max": span.max}
    return r


def _progress_line(case, method, r):
    """The line a finished method prints (without its closing parenthesis): its figures or why it did not run,
    and the load it ran at."""
    err = r.get("grad_err", r.get("err"))
    shown = (f"{r['ms']:.0f} ms, {r['peak_mb']:.0f} MB, err {'-' if err is None else format(err, '.1e')}"
             if "ms" in r else (r.get("skipped") or r.get("error")))
    others = machine_load.figure_text(r["others"]["mean"], r["others"]["max"]) + ", " if "others" in r else ""
    return (f"  {case['mode']:<6} N={case['n']:<6} {case['heads']}x{case['dim']} {case['dtype']:<8} {method:<14} "
            f"{shown}   ({others}load {r['load']}")
