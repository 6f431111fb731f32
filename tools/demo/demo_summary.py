"""What the demo concludes from its measurements, as pure functions (no ComfyUI, no files): per-step times from the
servers' step clock, medians per configuration, whether the machine was too busy to compare times, and the
headline and table a user reads.

Contract: the headline always compares the pack's recommended configuration (role "recommended": Patch Attention,
FFN Chunking left to free memory) with ComfyUI's default on the GPUs this pack is for (role "default": its
sub-quadratic attention, which is also ComfyUI's default on the CPU), whatever the other configurations measured;
every figure in it names its configuration; memory is compared both ways it was measured (the server's whole peak
and its growth during the prompt); a frame difference is always said of the configuration that has it; a busy
machine (busy_reason: before or while it measured) replaces the speed ratio by a warning. Per-step time is the
median of the steps after each run's first one (the first carries one-off work: moving the model, FFN Chunking's
exactness check, first-call planning); the first step is reported apart.
"""
import re
import statistics

ROLES = ("default", "math", "recommended", "ffn")
# what the demo-only custom node (demo.STEP_CLOCK) prints: the sampler starting, then each finished step
STEP_LINE = re.compile(r"\[demo-step\] (start|(\d+)/(\d+)) (\d+(?:\.\d+)?)")


def step_times(log_text):
    """(first step seconds, [seconds of each later step]) of the last sampler run in a server log chunk, from the
    step clock's lines; (None, []) when no step finished."""
    start, stamps = None, []
    for m in STEP_LINE.finditer(log_text):
        if m.group(1) == "start":
            start, stamps = float(m.group(4)), []
        elif start is not None:
            stamps.append(float(m.group(4)))
    if start is None or not stamps:
        return None, []
    edges = [start] + stamps
    steps = [b - a for a, b in zip(edges, edges[1:])]
    return steps[0], steps[1:]


def busy_reason(cores, load_before=None, others_during=()):
    """Why the machine was too busy for a time comparison, or None when it was quiet enough; every reason that
    holds is named (joined by '; ').

    load_before: os.getloadavg()[0] before the demo started anything (busy when above the core count).
    others_during: samples of how many threads of *other* processes were runnable while the configurations were
    measured (attention_core.device.machine_load.others_runnable: the 1-minute load average cannot tell them from the
    demo's own servers, which keep every core busy); busy when they averaged more than a quarter of the cores
    (machine_load.threshold, the rule bench, tune and calibrate refuse to save by), i.e. took a visible share of
    the CPU from the server.
    """
    from attention_core.device import machine_load  # not at the top: ./dev demo --help must not import torch
    reasons = []
    if load_before is not None and load_before > cores:
        reasons.append(f"load average {load_before:.1f} on {cores} cores before the demo started")
    known = [x for x in others_during if x is not None]
    if known:
        mean, limit = statistics.fmean(known), machine_load.threshold(cores)
        if mean > limit:
            reasons.append(f"other processes kept {mean:.1f} threads runnable on average (max {max(known)}) on "
                           f"{cores} cores while it measured, above {limit:g} (a quarter of the cores)")
    return "; ".join(reasons) or None


def summarize(configs, runs, diffs=None):
    """One dict per configuration that ran, in `configs` order ((label, role) pairs): medians over its runs of the
    peak memory (GB), of the later steps (step_s: every step but each run's first, pooled over the runs) and of
    the wall time; first_s, its first run's first step; max_diff, its largest frame difference from the default
    configuration's frames of the same seed (`diffs`: label -> value or None)."""
    diffs = diffs or {}
    out = []
    for label, role in configs:
        rs = [r for r in runs if r["label"] == label]
        if not rs:
            continue
        later = [s for r in rs for s in r.get("later_steps") or []]
        firsts = [r["first_step"] for r in sorted(rs, key=lambda r: r["rep"]) if r.get("first_step") is not None]
        out.append(dict(label=label, role=role, n=len(rs), n_steps=len(later),
                        peak_gb=statistics.median(r["peak"] for r in rs) / 2**30,
                        growth_gb=statistics.median(r["growth"] for r in rs) / 2**30,
                        step_s=statistics.median(later) if later else None,
                        first_s=firsts[0] if firsts else None,
                        wall_s=statistics.median(r["secs"] for r in rs),
                        max_diff=diffs.get(label)))
    return out


def frames_phrase(diff, ref):
    """How a configuration's frames (8-bit, scaled to 0-1) compare with `ref`'s: 'identical to ref's' or
    'within n/255 of ref's'."""
    if diff is None:
        return f"not compared with {ref}'s"
    if diff == 0:
        return f"identical to {ref}'s"
    return f"within {max(1, round(diff * 255))}/255 of {ref}'s"


def _ratio(ours, theirs, more, less, same):
    """How the pack's figure compares with the default's: 'n.nx <more>' when the default's is larger, 'n.nx <less>'
    when smaller, `same` within 5 %."""
    if not ours or not theirs:
        return f"{same}?"
    r = theirs / ours
    if 1 / 1.05 < r < 1.05:
        return same
    return f"{r:.1f}x {more}" if r > 1 else f"{1 / r:.1f}x {less}"


def _mem(r):
    growth = f" (+{r['growth_gb']:.1f} GB during the prompt)" if r.get("growth_gb") is not None else ""
    return f"{r['peak_gb']:.1f} GB peak{growth}"


def _step(r):
    return f"{r['step_s']:.1f} s/step" if r.get("step_s") is not None else "? s/step"


def headline(results, model, tokens, busy=None, gpu=True):
    """The chart's title and the printed summary: [the comparison of the recommended configuration with the
    default in words, the two configurations' figures, the other configurations' figures]. `busy`: busy_reason()'s
    verdict; `gpu`: the demo ran on a GPU (else the CPU: the default is named as the CPU's). [] when either of the
    two compared configurations did not run."""
    by = {r["role"]: r for r in results}
    ours, base = by.get("recommended"), by.get("default")
    if not (ours and base):
        return []
    ref = base["label"]
    mem = (_ratio(ours["peak_gb"], base["peak_gb"], "less peak memory", "more peak memory",
                  "about the same peak memory") + " (the whole server) and "
           + _ratio(ours.get("growth_gb"), base.get("growth_gb"), "less", "more", "about the same")
           + " growth during the prompt")
    default = ("ComfyUI's default on these GPUs" if gpu else
               "ComfyUI's default on the CPU (and on the GPUs this pack is for)")
    if busy:
        speed = f"speed not compared: machine busy, {busy}"
    else:
        speed = _ratio(ours.get("step_s"), base.get("step_s"), "faster", "slower", "about the same speed")
    lines = [f"{model}, {tokens:,} tokens. The pack's recommended setting, {ours['label']}, vs {default}, {ref}: "
             f"{mem}, {speed}; frames {frames_phrase(ours.get('max_diff'), ref)}.",
             f"{ours['label']}: {_mem(ours)}, {_step(ours)}. {ref}: {_mem(base)}, {_step(base)}."]
    others = []
    for r in results:
        if r["role"] in ("recommended", "default"):
            continue
        text = f"{r['label']}: {_mem(r)}, "
        if r.get("step_s") is None and r.get("first_s") is not None:
            text += f"only a first step timed ({r['first_s']:.0f} s, with one-off work)"
        else:
            text += _step(r)
            if r.get("first_s") is not None and r.get("step_s") is not None and r["first_s"] > 1.5 * r["step_s"]:
                text += f" (its first step: {r['first_s']:.0f} s, one-off work, not in s/step)"
        text += f", its frames {frames_phrase(r.get('max_diff'), ref)}"
        if r["role"] == "math" and r.get("max_diff"):
            text += " (math SDPA's own rounding: the pack is not in that run)"
        others.append(text)
    if others:
        lines.append("; ".join(others) + ".")
    return lines


def table(results, what):
    """The printed table: one row per configuration, every figure under its configuration's name."""
    rows = [f"{'configuration':<44}{'peak ' + what:>24}{'growth':>10}{'s/step':>8}{'steps':>6}"
            f"{'1st step':>9}{'wall':>7}  frames"]
    ref = next((r["label"] for r in results if r["role"] == "default"), "the default")
    for r in results:
        step = f"{r['step_s']:.1f}" if r["step_s"] is not None else "-"
        first = f"{r['first_s']:.1f}" if r["first_s"] is not None else "-"
        rows.append(f"{r['label']:<44}{r['peak_gb']:>21.2f} GB{r['growth_gb']:>7.2f} GB{step:>8}{r['n_steps']:>6}"
                    f"{first:>9}{r['wall_s']:>6.0f}s  {frames_phrase(r['max_diff'], ref)}")
    return rows
