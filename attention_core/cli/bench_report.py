"""The benchmark's report: per mode, a table of every method at every shape (time, peak extra memory, max error
against float64; why a method did not run underneath), a PNG chart of time and memory per method (matplotlib,
optional), the --json file, and the tables and chart again from a saved --json run (--from-json, running nothing).
--json and --plot are refused when other processes kept the machine busy while it measured, unless --force-busy
(machine_load.refusal); the load is printed either way.
"""
from __future__ import annotations

import json
import sys

from ..device import machine_load
from .bench_methods import METHODS


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


def replay(ap, path, plot):
    """--from-json: the tables of the run saved at `path` (and its chart at `plot`), nothing run."""
    from . import cli_args
    try:
        rows, saved = load_results(path, with_info=True)
    except ValueError as e:
        cli_args.fail(ap, "--from-json", f"{path}: {e}")
    for mode in ("fwd", "fwdbwd"):
        print(_table(rows, mode))
    load = saved.get("load") if isinstance(saved.get("load"), dict) and "cores" in saved["load"] else None
    if load:
        print(f"\nmeasured at: {machine_load.describe(load)}")
    if plot and _plot(rows, plot, load):
        print(f"wrote {plot}")
    return 0


def finish(rows, info, json_path, plot):
    """After a run (bench_run.sweep's rows and info): the tables, the load it was measured at, then --json and
    --plot unless other processes kept the machine busy (then exit status 2 and nothing written, unless forced).
    Returns the exit status."""
    load = info["load"]
    for mode in ("fwd", "fwdbwd"):
        t = _table(rows, mode)
        if t:
            print(t)
    print(f"\nmeasured at: {machine_load.describe(load)} (load average {info['load_start']} at the start, "
          f"{info['load_end']} at the end)" + (f", OMP_WAIT_POLICY {info['omp_wait_policy']}"
                                                if info.get("omp_wait_policy") else ""))
    if json_path or plot:
        refused = machine_load.refusal(load, " / ".join(f for f, v in (("--json", json_path), ("--plot", plot))
                                                         if v))
        if refused:
            print(f"error: {refused}", file=sys.stderr)
            return 2
    if load["busy"]:
        print(f"warning: machine busy ({machine_load.describe(load)}): these figures are unreliable"
              + (f"; saved anyway ({machine_load.FORCE_FLAG})" if load["forced"] else ""))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"info": info, "results": rows}, f, indent=1)
        print(f"\nwrote {json_path}")
    if plot and _plot(rows, plot, load):
        print(f"wrote {plot}")
    return 0
