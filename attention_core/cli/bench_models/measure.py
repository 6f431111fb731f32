"""One measured case in a fresh process, and the interleaved rounds of a model benchmark (its medians).

A case is a JSON object naming a method and a size; a child module's run_case(case) builds what it needs, then calls
measured(fn, device, repeats): peak extra memory of the first call (CPU: the process's peak RSS, VmHWM, reset once
the inputs exist, over the RSS then; GPU: torch.cuda.max_memory_allocated over the allocated memory then) and the
median time of the calls after it (the first alone with repeats=1). Every case runs in its own process
(`python -m <module> --case JSON`), so one method's allocations never lower or raise another's, and with
OMP_WAIT_POLICY=PASSIVE unless set (as attention_core.bench runs its cases). rounds() runs every method once per
round, alternating the order round to round, and reports per method the median over rounds: load drift on a busy
machine hits every method alike.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from ..bench_run import _peak_rss, _reset_peak_rss, _rss, child_env  # the main benchmark's memory readers, child env

MIB = 1 << 20
GIB = 1 << 30


def measured(fn, device: str, repeats: int) -> dict:
    """{"ms", "peak_mb"} of fn() on `device`: the peak extra memory of the first call, the median time of the
    calls after it (repeats - 1 of them; the first call's time when repeats is 1)."""
    import torch
    from ...device.sync import synchronize
    dev = torch.device(device)
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    else:
        _reset_peak_rss()
        base = _rss()
    t0 = time.perf_counter()
    fn()
    synchronize(dev)
    times = [time.perf_counter() - t0]
    peak = (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else _peak_rss()) - base
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        fn()
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    return {"ms": 1000 * (statistics.median(times[1:]) if len(times) > 1 else times[0]),
            "peak_mb": max(0, peak) / MIB}


def child_main(run_case, argv=None) -> int:
    """The `--case JSON` entry of a child module: prints run_case's result as one JSON line."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--case":
        print("internal entry: python -m attention_core.cli.bench_models.<module> --case JSON (the benchmark's driver "
              "passes it); run the benchmark with python -m attention_core.bench --preset NAME", file=sys.stderr)
        return 2
    case = json.loads(argv[1])
    try:
        res = run_case(case)
    except Exception as e:  # noqa: BLE001 - an out-of-memory or a refusal is a result
        res = {"error": f"{e.__class__.__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    print(json.dumps(res))
    return 0


def run_in_process(module: str, case: dict, timeout: float) -> dict:
    """`python -m module --case JSON` in a fresh process: its last JSON line, or an error row."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = child_env(root)
    try:
        p = subprocess.run([sys.executable, "-m", module, "--case", json.dumps(case)], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f}s (--timeout)"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        killed = " (killed: out of memory?)" if p.returncode in (-9, 137) else ""
        return {"error": f"exit {p.returncode}{killed}: {tail[:200]}"}
    return json.loads(lines[-1])


def load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}/{os.cpu_count()}"
    except OSError:
        return "?"


def rounds(cases_by_size: list, methods: list, n_rounds: int, run, monitor, say=print) -> list:
    """Rows (one per size and method) from `n_rounds` interleaved rounds. cases_by_size: [(size label, {method:
    case or a string saying why it is not run})]; run(case) -> result dict (ms, peak_mb, ... or error)."""
    from ...device import machine_load
    rows = []
    for label, cases in cases_by_size:
        got = {m: [] for m in methods}
        for rnd in range(n_rounds):
            for m in (methods if rnd % 2 == 0 else methods[::-1]):
                case = cases[m]
                if isinstance(case, str):
                    if rnd == 0:
                        got[m].append({"skipped": case})
                        say(f"  {label:<12} {m:<14} not run: {case}")
                    continue
                with monitor.span() as span:
                    r = run(case)
                r.update(others={"mean": span.mean, "max": span.max}, load=load_average())
                got[m].append(r)
                shown = f"{r['ms']:,.0f} ms, {r['peak_mb']:,.0f} MB" if "ms" in r else r.get("error")
                extra = f", engine calls {r['routed']}" if r.get("routed") is not None else ""
                say(f"  {label:<12} {m:<14} {shown}{extra}   ({machine_load.figure_text(span.mean, span.max)}, "
                    f"load {r['load']}{f', round {rnd + 1}' if n_rounds > 1 else ''})")
        for m in methods:
            rows.append(dict(merge(got[m]), size=label, method=m))
    return rows


def merge(rs: list) -> dict:
    """One row from a method's rounds: median time and memory, each round's time and load kept."""
    ok = [r for r in rs if "ms" in r]
    if not ok:
        return dict(rs[0]) if rs else {"skipped": "not run"}
    row = dict(ok[0])
    row.update(ms=statistics.median(r["ms"] for r in ok), peak_mb=statistics.median(r["peak_mb"] for r in ok),
               round_ms=[r["ms"] for r in ok], round_load=[r["load"] for r in ok], rounds=len(ok))
    return row


def table(rows: list, methods: list, labels: dict, title: str, base: str = "math", ours: str = "engine") -> str:
    """A Markdown table: one line per size, a "time / peak extra memory" cell per method, then `ours` against
    `base` (speed-up and memory ratio) where both ran."""
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    head = ["size", *[labels.get(m, m) for m in methods]]
    with_ratio = base in methods and ours in methods
    if with_ratio:
        head.append(f"{labels.get(ours, ours)} vs {labels.get(base, base)}")
    out = [f"\n{title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for s in sizes:
        by = {r["method"]: r for r in rows if r["size"] == s}
        cells = [s]
        for m in methods:
            r = by.get(m, {})
            if "ms" in r:
                calls = (f", {r['routed']}/{r.get('expected', '?')} calls in the engine"
                         if m == ours and r.get("routed") is not None else "")
                cells.append(f"{r['ms']:,.0f} ms / {r['peak_mb']:,.0f} MB{calls}")
            else:
                why = r.get("skipped") or r.get("error") or "not run"
                cells.append("out of memory" if "memory" in why.lower() else "not run")
                notes.append(f"{s} {labels.get(m, m)}: {why}")
        if with_ratio:
            a, b = by.get(ours, {}), by.get(base, {})
            if "ms" in a and "ms" in b and a["ms"] > 0:
                mem = f", {a['peak_mb'] / b['peak_mb']:.2f}x the memory" if b["peak_mb"] >= 1 else ""
                cells.append(f"{b['ms'] / a['ms']:.2f}x as fast{mem}")
            elif "ms" in a:
                cells.append(f"only {labels.get(ours, ours)} ran")
            else:
                cells.append("-")
        out.append("| " + " | ".join(cells) + " |")
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return "\n".join(out)


def plot(rows: list, methods: list, labels: dict, path: str, title: str, load_text: str = "") -> bool:
    """Time and peak extra memory per size and method (log scale), as attention_core.bench draws its charts."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(13, 1.6 + 0.32 * len(sizes) * len(methods)), squeeze=False,
                             sharey=True)
    for ax, key, what in ((axes[0][0], "ms", "time (ms)"), (axes[0][1], "peak_mb", "peak extra memory (MB)")):
        names, vals, colors = [], [], []
        for s in sizes:
            for i, m in enumerate(methods):
                r = next((x for x in rows if x["size"] == s and x["method"] == m), {})
                names.append(f"{s}  {labels.get(m, m)}")
                vals.append(max(r[key], 0.1) if key in r else 0)
                colors.append(f"C{i}")
        bars = ax.barh(names, vals, color=colors)
        ax.set_xscale("log")
        ran = [v for v in vals if v]
        if ran:
            ax.set_xlim(min(ran) / 2, max(ran) * 4)  # room for the figures after the bars
        for b, v in zip(bars, vals):
            y = b.get_y() + b.get_height() / 2
            if v:
                ax.text(v, y, f" {v:,.0f}", va="center", fontsize=7)
            else:
                ax.text(0.01, y, "not run (out of memory or not available)", va="center", fontsize=7,
                        transform=ax.get_yaxis_transform())
        ax.invert_yaxis() if key == "ms" else None
        ax.set_title(what, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(True, axis="x", which="both", alpha=0.3)
    import textwrap
    text = textwrap.fill(title, 150) + ("\n" + textwrap.fill("measured at: " + load_text, 150) if load_text else "")
    fig.suptitle(text, fontsize=9)
    fig.subplots_adjust(left=0.2, right=0.98, wspace=0.08, top=1 - 0.95 / fig.get_figheight(), bottom=0.35 /
                        fig.get_figheight())
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
