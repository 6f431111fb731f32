"""./dev demo's chart (tools/demo/demo_chart.py) reads at a glance: rendered from the demo's real JSON (the committed
docs/bench-demo-*.json) and from extreme ones (very long configuration names, figures of very different magnitude,
a busy machine, a GPU run, missing figures), no text leaves the figure, no two texts overlap, every value sits on
its bar inside its panel, and the headline is one line; what the chart leaves out is printed by the demo and saved
in demo.json. The renders go to test-artifacts/demo-chart/ for a person to look at."""
import argparse
import copy
import json
import os

import pytest

from tools.demo import demo_chart

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
ARTIFACTS = os.path.join(ROOT, "test-artifacts", "demo-chart")
COMMITTED = ("bench-demo-wan22-default", "bench-demo-wan22-480p")


def committed(name):
    with open(os.path.join(DOCS, name + ".json")) as f:
        return json.load(f)


def extreme_names():
    """The default run, as a busy machine reports it, with configuration names far longer than the demo's, one a
    single unbroken word."""
    d = committed("bench-demo-wan22-default")
    d["busy"] = ("other processes kept 0.6 threads runnable on average (max 3) on 2 cores while it measured, above "
                 "0.5 (a quarter of the cores)")
    names = ["ComfyUI sub-quadratic attention as started with --use-quad-cross-attention on a machine without "
             "fused SDPA kernels of any kind",
             "Patch Attention (chunked) with a very long explanation of its mode, its tiles, its budget and more",
             "Patch_Attention_plus_FFN_Chunking_with_sixty_four_chunks_and_no_spaces_at_all_in_its_name"]
    for r, name in zip(d["results"], names):
        r["label"] = name
    d["configs"] = [[r["label"], r["role"]] for r in d["results"]]
    return d


def extreme_magnitudes():
    """Four configurations whose figures span seven orders of magnitude, 255/255 frames, no later step, no frame
    comparison, a first step far above its later ones; quiet machine, on a GPU (VRAM)."""
    d = committed("bench-demo-wan22-default")
    base = d["results"][0]
    d["results"] = [
        dict(base, label="ComfyUI sub-quadratic", role="default", peak_gb=12345.678, growth_gb=9999.0, step_s=98765.4,
             first_s=99999.9, max_diff=0.0),
        dict(base, label="math SDPA", role="math", peak_gb=0.000432, growth_gb=0.0001, step_s=0.0031, first_s=0.004,
             max_diff=1.0),
        dict(base, label="Patch Attention (auto)", role="recommended", peak_gb=0.012, growth_gb=0.001, step_s=0.42,
             first_s=1234567.0, max_diff=None),
        dict(base, label="Patch Attention + FFN Chunking (64 chunks)", role="ffn", peak_gb=7.5, growth_gb=1.0,
             step_s=None, first_s=87654.3, max_diff=0.5)]
    d["configs"] = [[r["label"], r["role"]] for r in d["results"]]
    d.update(busy=None, gpu=True, real=True, tokens=28520, repeats=12, steps=40)
    return d


def busy_long_reason():
    """The default run's figures, as a busy machine would report them (both reasons, long) on 64 cores."""
    d = committed("bench-demo-wan22-default")
    d["busy"] = ("load average 123.4 on 64 cores before the demo started; other processes kept 98.7 threads runnable "
                 "on average (max 128) on 64 cores while it measured, above 16 (a quarter of the cores)")
    d["cores"] = 64
    return d


def two_configurations_same_figures():
    """Only the two compared configurations, with figures within 5 % of each other (the 'about the same' words:
    the longest headline)."""
    d = committed("bench-demo-wan22-default")
    d["results"] = copy.deepcopy(d["results"][:2])
    d["results"][1].update(peak_gb=d["results"][0]["peak_gb"] * 0.98, step_s=d["results"][0]["step_s"] * 1.01,
                           max_diff=None)
    d["configs"] = d["configs"][:2]
    d["busy"] = None
    return d


REPORTS = {**{name: (lambda name=name: committed(name)) for name in COMMITTED},
           "extreme-names": extreme_names, "extreme-magnitudes": extreme_magnitudes,
           "busy-long-reason": busy_long_reason, "two-configurations-same": two_configurations_same_figures}


def drawn_texts(fig):
    """Every text the figure draws (after fig.canvas.draw()): titles, tick labels, value labels, headline,
    context; empty or hidden texts and tick labels outside the axis' view are left out (they are not drawn)."""
    from matplotlib.text import Text
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not lo - 1e-9 <= tick.get_loc() <= hi + 1e-9:
                    hidden.update((id(tick.label1), id(tick.label2)))
    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden]


def layout_problems(fig):
    """Each text outside the figure, each pair of texts that overlap (by more than half a pixel each way) and each
    text placed in a panel (value labels, the panel's title) that is wider than the panel or leaves it sideways, as
    sentences; [] when the figure is clean."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = drawn_texts(fig)
    boxes = [(t, t.get_window_extent(renderer)) for t in texts]
    figure_box = fig.bbox
    problems = []
    for t, b in boxes:
        if b.x0 < figure_box.x0 - 0.5 or b.y0 < figure_box.y0 - 0.5 or b.x1 > figure_box.x1 + 0.5 or \
                b.y1 > figure_box.y1 + 0.5:
            problems.append(f"outside the figure {tuple(figure_box.bounds)}: {t.get_text()!r} at {tuple(b.bounds)}")
    for i, (t, b) in enumerate(boxes):
        for u, c in boxes[i + 1:]:
            if min(b.x1, c.x1) - max(b.x0, c.x0) > 0.5 and min(b.y1, c.y1) - max(b.y0, c.y0) > 0.5:
                problems.append(f"overlap: {t.get_text()!r} and {u.get_text()!r}")
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        for t in ax.texts + [ax.title]:
            b = t.get_window_extent(renderer)
            if t.get_text().strip() and (b.x0 < box.x0 - 0.5 or b.x1 > box.x1 + 0.5):
                problems.append(f"leaves its panel: {t.get_text()!r}")
    return problems


@pytest.fixture(scope="module", autouse=True)
def matplotlib_in_the_clone():
    """matplotlib's cache in the clone's .cache/matplotlib, as the demo keeps it (before matplotlib is imported)."""
    from tools.demo.demo import use_clone_for_matplotlib
    use_clone_for_matplotlib()


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_no_text_leaves_the_figure_or_overlaps_another(name):
    d = REPORTS[name]()
    fig = demo_chart.figure_from_report(d)
    os.makedirs(ARTIFACTS, exist_ok=True)
    demo_chart.save(fig, os.path.join(ARTIFACTS, name + ".png"))
    assert layout_problems(fig) == []
    headline = fig.texts[0].get_text()
    assert headline == demo_chart.headline(d["results"] if "configs" in d else
                                           demo_chart.from_report(d)["results"], d.get("busy"))
    assert "\n" not in headline  # one line, whatever the names, figures and busy reason


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_every_value_is_written_on_its_bar(name):
    """Each panel writes one label per configuration, at its bar's end (the numbers are on the bars), and the
    configurations' names (wrapped, with their role) are the first panel's tick labels."""
    d = REPORTS[name]()
    r = demo_chart.from_report(d)
    fig = demo_chart.figure_from_report(d)
    fig.canvas.draw()
    specs = demo_chart.panels(r["results"], r["what"], r["busy"])
    for ax, (title, _, values, texts, _) in zip(fig.axes, specs):
        assert ax.get_title() == title
        assert [t.get_text().strip() for t in ax.texts] == texts
        assert [t.get_position()[0] for t in ax.texts] == pytest.approx(values)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [demo_chart.bar_label(x) for x in r["results"]]
    peaks = fig.axes[0].texts
    assert all(t.get_text().strip().endswith(" GB") for t in peaks)


def test_the_committed_reports_say_what_the_readme_says():
    """docs/benchmarks.md's two demo charts: the default run (quiet, speeds compared) and the quiet 480p run of the
    previous demo."""
    default = demo_chart.from_report(committed("bench-demo-wan22-default"))
    assert default["headline"] == ("Recommended vs ComfyUI's default: 1.6× less memory, frames within 1/255, "
                                   "1.1× faster")
    assert default["context"] == ("Wan 2.2 5B at real width (1 block) · CPU, 2 cores · 2,340 tokens · 2 rounds "
                                  "of 3 steps")
    memory, steps, frames = demo_chart.panels(default["results"], default["what"], default["busy"])[:3]
    assert steps[0] == "Time per step (median)" and steps[1] != demo_chart.BUSY_COLOR
    assert steps[3] == ["5.5 s", "4.9 s", "4.9 s (first step 14 s)"]
    assert memory[3] == ["4.64 GB", "2.99 GB", "2.75 GB"] and frames[3] == ["reference", "1/255", "1/255"]
    old = demo_chart.from_report(committed("bench-demo-wan22-480p"))
    assert old["headline"] == "Recommended vs ComfyUI's default: 2.7× less memory, identical frames, 1.4× faster"
    assert [x["role"] for x in old["results"]] == ["default", "math", "recommended", "ffn"]
    panels = demo_chart.panels(old["results"], old["what"], old["busy"])
    assert panels[0][3] == ["9.24 GB", "10.17 GB", "3.46 GB", "3.05 GB"]
    assert panels[1][3] == ["38.7 s", "45.3 s", "27.5 s", "no later step (first step 75 s)"]
    assert panels[2][3] == ["reference", "1/255", "identical", "identical"]


@pytest.mark.parametrize("name", COMMITTED)
def test_the_committed_pictures_are_drawn_from_their_json_with_this_layout(name):
    """docs/<name>.png is what `python -m tools.demo.demo_chart docs/<name>.json docs/<name>.png` draws now (same
    size, pixels equal but for font rasterisation)."""
    import numpy as np
    from PIL import Image
    path = os.path.join(ARTIFACTS, name + "-redrawn.png")
    os.makedirs(ARTIFACTS, exist_ok=True)
    demo_chart.draw_report(committed(name), path)
    new = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
    old = np.asarray(Image.open(os.path.join(DOCS, name + ".png")).convert("RGB"), dtype=np.int16)
    assert old.shape == new.shape, f"docs/{name}.png is not drawn with the current layout: redraw it"
    assert (abs(old - new) > 32).mean() < 0.002


def test_the_frame_difference_axis_has_a_floor_and_scales_above_it():
    """A difference of 1/255 (invisible in a frame) looks small: the panel spans at least 8/255; a large one
    fills most of the panel."""
    d = committed("bench-demo-wan22-default")
    fig = demo_chart.figure_from_report(d)
    assert fig.axes[2].get_xlim()[1] >= demo_chart.FRAME_DIFF_FLOOR == 8 / 255
    for r in d["results"][1:]:
        r["max_diff"] = 0.5
    end = demo_chart.figure_from_report(d).axes[2].get_xlim()[1]
    assert 0.5 < end < 0.8


def test_names_are_wrapped_with_their_role_and_cut_with_an_ellipsis():
    r = dict(label="Patch Attention + FFN Chunking (4 chunks)", role="ffn")
    assert demo_chart.bar_label(r) == "Patch Attention + FFN\nChunking (4 chunks)"
    assert demo_chart.bar_label(dict(label="ComfyUI sub-quadratic", role="default")) == \
        "ComfyUI sub-quadratic\n(ComfyUI's default)"
    long = demo_chart.bar_label(dict(label="word " * 40, role="recommended")).split("\n")
    assert len(long) == demo_chart.LABEL_LINES + 1 and long[-2].endswith("…") and long[-1] == "(recommended)"
    assert all(len(line) <= demo_chart.LABEL_CHARS for line in long)


def test_what_leaves_the_figure_is_in_the_notes():
    """The panel explanations, the busy reason and every full name and first step are in the notes."""
    d = extreme_names()
    notes = "\n".join(demo_chart.words(d)["notes"])
    assert d["busy"] in notes
    assert "median of every step but each run's first" in notes and "1/255 = 0.0039" in notes and "8/255" in notes
    assert "RSS of the server" in notes
    for r in d["results"]:
        assert f"Bar '{r['label']}'" in notes and f"{r['peak_gb']:.2f} GB" in notes
        assert f"first step {r['first_s']:.1f} s" in notes
    assert "VRAM in use" in "\n".join(demo_chart.words(extreme_magnitudes())["notes"])


def test_the_demo_prints_and_saves_what_the_chart_leaves_out_and_draws_it_from_its_json(tmp_path, capsys):
    """The demo's report (the code after a run): demo.json holds the long headline and the chart's headline,
    context and notes, all printed; demo.png is exactly the chart of the saved demo.json."""
    import numpy as np
    from PIL import Image

    from tools.demo.demo import report
    d = committed("bench-demo-wan22-default")
    meta = {k: v for k, v in d.items() if k not in ("busy", "headline", "results")}
    # runs that summarize to a busy run: other processes kept 3 threads runnable on 2 cores
    runs = [dict(label=label, rep=0, secs=40.0, first_step=first, later_steps=[step, step], peak=peak * 2**30,
                 growth=peak / 2 * 2**30, others=[3, 3], pngs=[])
            for label, first, step, peak in (("ComfyUI sub-quadratic", 10.1, 10.1, 4.73),
                                             ("Patch Attention (chunked)", 9.8, 9.7, 3.07),
                                             ("Patch Attention + FFN Chunking (4 chunks)", 28.9, 9.9, 2.80))]
    a = argparse.Namespace(workdir=str(tmp_path), out_dir=str(tmp_path / "out"), chart=None, json=None)
    report(meta, runs, a)
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "demo.json").read_text())
    assert saved["chart"] == demo_chart.words(saved)
    assert saved["chart"]["headline"].endswith("speed: machine busy") and saved["busy"]
    for line in saved["headline"] + saved["chart"]["notes"] + [saved["chart"]["headline"], saved["busy"]]:
        assert line in out
    png = tmp_path / "again.png"
    demo_chart.draw_report(saved, str(png))
    assert np.array_equal(np.asarray(Image.open(png)), np.asarray(Image.open(tmp_path / "out" / "demo.png")))
