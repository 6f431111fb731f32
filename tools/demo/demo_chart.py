"""The demo's chart (demo.png) from its results alone: no ComfyUI, no server, nothing read but the JSON it is given.

    python -m tools.demo.demo_chart demo.json demo.png     # redraw a chart from a saved demo.json

Contract: a picture a person takes in at a glance, at README width (11 x ~3.5 in, DejaVu Sans, 150 dpi): one short
headline (the recommended configuration against ComfyUI's default: peak memory, frames, speed; "speed:
machine busy" when the machine was busy), one grey context line (model, device, tokens, rounds), then
three bar panels sharing the configurations' names (wrapped to LABEL_CHARS characters, at most LABEL_LINES lines,
each with its role): peak memory, seconds per step and the largest frame difference from the default
configuration, every value written on its bar. Nothing is drawn outside the figure and no two texts overlap
(tests/comfy/test_demo_chart.py renders the committed and extreme reports and checks every text's extent): the
layout is measured, not guessed (the label column is as wide as the widest label, each panel's x-axis ends where
its longest value label still fits, the figure is as tall as its rows). What the chart leaves out (what each panel
measures, how s/step is taken, the scale of a frame difference, why the machine was busy, the full names) is in
notes(), which the demo prints and saves in demo.json under "chart".
"""
import argparse
import json
import sys
import textwrap

ROLE_NAMES = {"default": "ComfyUI's default", "recommended": "recommended"}
COLORS = {"default": "#616161", "math": "#9e9e9e", "recommended": "#1e88e5", "ffn": "#0d47a1"}
BUSY_COLOR = "#c62828"
# the frame-difference panel spans at least this much: a difference of a few 255ths is invisible in a frame and
# must look small, not fill the panel
FRAME_DIFF_FLOOR = 8 / 255
LABEL_CHARS, LABEL_LINES = 26, 3
WIDTH_IN, DPI = 11.0, 150
FONT = dict(headline=12, context=10, title=11, label=10, value=10)


def _ratio(ours, theirs, more, less, same):
    """'n.n× <more>' when the default's figure is larger than ours, 'n.n× <less>' when smaller (from 10x on,
    whole: '12×', '1,029×'), `same` within 5 % (the rule of demo_summary's headline); None without both."""
    if not ours or not theirs:
        return None
    r = theirs / ours
    if 1 / 1.05 < r < 1.05:
        return same
    r, words = (r, more) if r > 1 else (1 / r, less)
    return f"{r:.1f}× {words}" if r < 10 else f"{r:,.0f}× {words}"


def diff_255(diff):
    """A frame difference (8-bit frames scaled to 0-1) in 255ths, as the demo says it: '0' or 'n/255' (n >= 1)."""
    return "0" if diff == 0 else f"{max(1, round(diff * 255))}/255"


def headline(results, busy=None):
    """The chart's one-line headline: the recommended configuration against the default one (roles, not names:
    the names are on the bars): peak memory, frames, speed ('speed: machine busy' when `busy`, as the time panel
    says); None when either did not run."""
    by = {r["role"]: r for r in results}
    ours, base = by.get("recommended"), by.get("default")
    if not (ours and base):
        return None
    parts = [_ratio(ours["peak_gb"], base["peak_gb"], "less memory", "more memory", "about the same memory")
             or "memory not compared"]
    diff = ours.get("max_diff")
    parts.append("frames not compared" if diff is None else "identical frames" if diff == 0 else
                 f"frames within {diff_255(diff)}")
    parts.append("speed: machine busy" if busy else
                 _ratio(ours.get("step_s"), base.get("step_s"), "faster", "slower", "about the same speed")
                 or "speed not compared")
    return "Recommended vs ComfyUI's default: " + ", ".join(parts)


def context(meta):
    """The grey line under the headline: what ran, where, how big, how often (from demo.json's meta)."""
    blocks = meta.get("blocks")
    model = ("Wan 2.2 5B" if meta.get("real") else
             f"Wan 2.2 5B at real width ({blocks} block{'s' * (blocks != 1)})" if blocks else "Wan 2.2 5B")
    where = "GPU" if meta.get("gpu") else "CPU" + (f", {meta['cores']} cores" if meta.get("cores") else "")
    parts = [model, where, f"{meta['tokens']:,} tokens"]
    if meta.get("repeats") and meta.get("steps"):
        parts.append(f"{meta['repeats']} round{'s' * (meta['repeats'] != 1)} of {meta['steps']} "
                     f"step{'s' * (meta['steps'] != 1)}")
    return " · ".join(parts)


def bar_label(r):
    """A configuration's name as the chart writes it: wrapped to LABEL_CHARS characters, at most LABEL_LINES lines
    (the rest replaced by '…'; the full name is in the printed table), then its role in brackets if it has one."""
    lines = textwrap.wrap(r["label"], LABEL_CHARS, break_on_hyphens=False) or [""]
    if len(lines) > LABEL_LINES:
        lines = lines[:LABEL_LINES]
        lines[-1] = lines[-1][:LABEL_CHARS - 1].rstrip() + "…"
    if r["role"] in ROLE_NAMES:
        lines.append(f"({ROLE_NAMES[r['role']]})")
    return "\n".join(lines)


def _num(v, unit, decimals):
    """v with `decimals` decimals (thousands separated), or two significant figures where that would show fewer
    (0.0012 s, not 0.0 s), and its unit."""
    if v == 0 or abs(v) >= 10 ** (1 - decimals):
        return f"{v:,.{decimals}f} {unit}"
    return f"{v:.2g} {unit}"


def panels(results, what, busy=None):
    """The three panels as data: [(title, title colour, values, value labels, x-axis floor)]. Peak memory in GB
    (`what`: 'RSS of the server' or 'VRAM in use'); seconds per step (a
    configuration with no later step draws no bar and says its first step; a first step more than 1.5x the later
    ones, i.e. one-off work, is written beside the median); the largest frame difference from the default
    configuration in 255ths, its axis at least FRAME_DIFF_FLOOR long."""
    peaks = [r["peak_gb"] for r in results]
    steps, step_texts = [], []
    for r in results:
        step, first = r.get("step_s"), r.get("first_s")
        steps.append(step or 0)
        if step is None:
            step_texts.append("no later step" + (f" (first step {_num(first, 's', 0)})" if first is not None else ""))
        elif first is not None and first > 1.5 * step:
            step_texts.append(f"{_num(step, 's', 1)} (first step {_num(first, 's', 0)})")
        else:
            step_texts.append(_num(step, "s", 1))
    diffs = [r.get("max_diff") or 0 for r in results]
    diff_texts = ["reference" if r["role"] == "default" else "not compared" if r.get("max_diff") is None else
                  "identical" if r["max_diff"] == 0 else diff_255(r["max_diff"]) for r in results]
    return [(f"Peak {what}", "black", peaks, [_num(p, "GB", 2) for p in peaks], 0),
            ("Time per step (median)" + ("\nmachine busy: not compared" if busy else ""),
             BUSY_COLOR if busy else "black", steps, step_texts, 0),
            ("Max frame difference", "black", diffs, diff_texts, FRAME_DIFF_FLOOR)]


def notes(results, what, busy=None, steps_per_run=None):
    """What the chart leaves out, in sentences the demo prints under the table and saves in demo.json: what each
    panel measures and how, the default configuration the frames are compared with, the busy reason, every
    configuration's full name and first step."""
    ref = next((r["label"] for r in results if r["role"] == "default"), "the default configuration")
    out = [f"Peak memory: the median over the runs of the {what}'s peak (the model and ComfyUI included).",
           "Time per step: the median of every step but each run's first; the first carries one-off work (moving "
           "the model, FFN Chunking's exactness check, first-call planning) and is written beside the bar "
           "('first step') when it took more than 1.5x the later ones.",
           f"Max frame difference: the largest |difference| between a configuration's decoded frames and {ref}'s of "
           "the same seed, 8-bit frames scaled to 0-1 (1/255 = 0.0039, one level of 255); the axis spans at least "
           "8/255, so a difference of a few 255ths, invisible in a frame, looks small."]
    if steps_per_run == 1:
        out[1] = ("Time per step: each run had one step, so each time is that step's, one-off work included; a "
                  "configuration whose step was mostly one-off work is shown as 'no later step' with its time as its "
                  "first.")
    if busy:
        out.append(f"Machine busy: {busy}; the times are unreliable and the speed is not compared.")
    for r in results:
        first = f", first step {r['first_s']:.1f} s" if r.get("first_s") is not None else ""
        role = f" ({ROLE_NAMES[r['role']]})" if r["role"] in ROLE_NAMES else ""
        out.append(f"Bar '{r['label']}'{role}: {r['peak_gb']:.2f} GB peak, "
                   + (f"{r['step_s']:.2f} s/step" if r.get("step_s") is not None else "no later step") + first
                   + ", frames " + ("the reference" if r["role"] == "default" else "not compared"
                                    if r.get("max_diff") is None else f"{r['max_diff']:.4f} from the reference")
                   + ".")
    return out


def _extent(fig, renderer, text, **kw):
    """(width, height) in inches of `text` as the figure would draw it."""
    t = fig.text(0, 0, text, **kw)
    box = t.get_window_extent(renderer)
    t.remove()
    return box.width / fig.dpi, box.height / fig.dpi


def _fit_line(fig, renderer, text, width, **kw):
    """`text`, wrapped at word boundaries into as few lines as fit `width` inches (one, unless it is too long)."""
    if _extent(fig, renderer, text, **kw)[0] <= width:
        return text
    for chars in range(len(text) - 1, 10, -1):
        wrapped = textwrap.fill(text, chars)
        if max(_extent(fig, renderer, line, **kw)[0] for line in wrapped.split("\n")) <= width:
            return wrapped
    return textwrap.fill(text, 10)


def figure(results, what, title=None, subtitle=None, busy=None):
    """The chart as a matplotlib Figure (Agg canvas; pyplot is not used, so nothing global is left behind), laid
    out from measured text extents: see the module's contract."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, 4), dpi=DPI)
    FigureCanvasAgg(fig)
    renderer = fig.canvas.get_renderer()
    margin, gap, pad = 0.15, 0.35, 0.08       # inches: figure edge, between panels, label to axis
    head = dict(fontsize=FONT["headline"], fontweight="bold")
    sub = dict(fontsize=FONT["context"], color="#555555")
    title = _fit_line(fig, renderer, title, WIDTH_IN - 2 * margin, **head) if title else None
    subtitle = _fit_line(fig, renderer, subtitle, WIDTH_IN - 2 * margin, **sub) if subtitle else None
    labels = [bar_label(r) for r in results]
    label_sizes = [_extent(fig, renderer, s, fontsize=FONT["label"]) for s in labels]
    label_w = max(w for w, _ in label_sizes)
    row_h = max(max(h for _, h in label_sizes) + 0.12, 0.42)
    specs = panels(results, what, busy)
    title_h = max(_extent(fig, renderer, t, fontsize=FONT["title"])[1] for t, *_ in specs)
    head_h = (_extent(fig, renderer, title, **head)[1] + 0.06 if title else 0) + \
        (_extent(fig, renderer, subtitle, **sub)[1] + 0.06 if subtitle else 0)
    axes_h = row_h * len(results)
    height = margin + head_h + 0.15 + title_h + 0.08 + axes_h + margin
    fig.set_size_inches(WIDTH_IN, height)
    left = margin + label_w + pad
    panel_w = (WIDTH_IN - left - margin - 2 * gap) / 3
    y = height - margin
    if title:
        fig.text(0.5, y / height, title, ha="center", va="top", **head)
        y -= _extent(fig, renderer, title, **head)[1] + 0.06
    if subtitle:
        fig.text(0.5, y / height, subtitle, ha="center", va="top", **sub)
    colors = [COLORS.get(r["role"], "#9e9e9e") for r in results]
    rows = range(len(results))
    for i, (name, color, values, texts, floor) in enumerate(specs):
        ax = fig.add_axes([(left + i * (panel_w + gap)) / WIDTH_IN, margin / height, panel_w / WIDTH_IN,
                           axes_h / height])
        ax.barh(rows, values, height=0.62, color=colors)
        ax.set_ylim(len(results) - 0.5, -0.5)
        ax.set_yticks(list(rows), labels if i == 0 else [""] * len(results), fontsize=FONT["label"])
        ax.tick_params(axis="y", length=0, pad=pad * 72)
        ax.set_xticks([])
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_title(name, fontsize=FONT["title"], color=color, pad=6)
        # the x-axis ends where every value label, written just past its bar, still fits inside the panel:
        # v/end * W + w <= W for each bar, i.e. end >= v * W / (W - w)
        text_w = [_extent(fig, renderer, " " + t, fontsize=FONT["value"])[0] + 0.05 for t in texts]
        top = max(values) or 1
        end = max([floor, top] + [v * panel_w / max(panel_w - w, 1e-3) for v, w in zip(values, text_w)])
        ax.set_xlim(0, end)
        for row, v, t in zip(rows, values, texts):
            ax.text(v, row, " " + t, va="center", ha="left", fontsize=FONT["value"])
    return fig


def save(fig, path):
    """Write the figure as a PNG at DPI."""
    fig.savefig(path, dpi=DPI)


def _previous_format(d):
    """A report from the demo's first version (docs/bench-demo-wan22-480p.json: 'labels', no roles, no first
    steps; one 1-step run of each configuration) in the current form, as its chart has been drawn since: roles
    from the names, the FFN Chunking run named with its chunks (the previous demo's --ffn-chunks, 4) and its only
    step, mostly FFN Chunking's one-off exactness check, shown as a first step, the others' only step as their time
    per step."""
    roles = {"ComfyUI sub-quadratic": "default", "math SDPA": "math"}
    results = []
    for r in d["results"]:
        r = dict(r)
        if r["label"].startswith("Patch Attention + FFN Chunking"):
            r["role"] = "ffn"
            r["label"] = r["label"] if "chunks" in r["label"] else r["label"] + " (4 chunks)"
            r["first_s"], r["step_s"] = r["step_s"], None
        else:
            r["role"] = roles.get(r["label"], "recommended" if r["label"].startswith("Patch Attention") else "other")
            r.setdefault("first_s", None)
        results.append(r)
    return {**d, "results": results, "configs": [[r["label"], r["role"]] for r in results]}


def from_report(d):
    """What the chart draws and what it leaves to words, from a demo.json (the current demo's, or the previous
    one's: _previous_format): dict(results, what, busy, headline, context, notes)."""
    if "configs" not in d:
        d = _previous_format(d)
    what = "VRAM in use" if d.get("gpu") else "RSS of the server"
    busy, results = d.get("busy"), d["results"]
    return dict(results=results, what=what, busy=busy, headline=headline(results, busy), context=context(d),
                notes=notes(results, what, busy, d.get("steps")))


def words(d):
    """The chart's headline, context line and notes, as the demo prints them and saves them in demo.json
    ("chart"): dict(headline, context, notes)."""
    r = from_report(d)
    return {k: r[k] for k in ("headline", "context", "notes")}


def figure_from_report(d):
    """The chart of a demo.json, as a Figure."""
    r = from_report(d)
    return figure(r["results"], r["what"], r["headline"], r["context"], r["busy"])


def draw_report(d, path):
    """Render a demo.json's chart to `path`."""
    save(figure_from_report(d), path)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.demo.demo_chart", description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="a demo.json written by ./dev demo (or one of docs/bench-demo-*.json)")
    ap.add_argument("png", help="where the chart goes")
    a = ap.parse_args(argv)
    with open(a.report) as f:
        d = json.load(f)
    draw_report(d, a.png)
    w = words(d)
    print("\n".join([w["headline"] or "", w["context"]] + w["notes"] + [f"chart: {a.png}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
