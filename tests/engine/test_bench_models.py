"""The model presets of `python -m attention_core.bench` (attention_core/bench_models, issue 35 items 3 and 4) run at
tiny sizes: their tables are well formed Markdown with a number in every cell of every method that ran, the JSON holds
a time and a peak memory per case, and the engine's cases say every attention call of the model ran in the engine
(counted where it ran: the global patch's stats for Qwen2, the engine's count key for ComfyUI's NextDiT)."""
import importlib.util
import json
import os
import re

import pytest

from attention_core.cli import bench
from attention_core.cli.bench_models import PRESETS, wants


def _comfyuis():
    if os.environ.get("TILED_ATTENTION_NO_COMFYUI"):  # set by ./dev test-oldest-torch: the engine's env alone
        pytest.skip("not applicable: the oldest-torch environment (./dev test-oldest-torch) has the engine alone; "
                    "the Z-Image presets run with ComfyUI in ./dev test")
    paths = [os.environ.get(v) for v in ("COMFYUI_LATEST_PATH", "COMFYUI_PATH")]
    return [p for p in dict.fromkeys(paths) if p and os.path.isfile(os.path.join(p, "comfy", "model_management.py"))]


def _run(capsys, tmp_path, *args):
    out = tmp_path / "run.json"
    assert bench.main(["--preset", *args, "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    return text, json.loads(out.read_text())


def _tables(text):
    """{title line: [[cells] per row]} of the Markdown tables printed."""
    tables, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| size |"):
            assert re.fullmatch(r"\|(---\|)+", lines[i + 1]), lines[i + 1]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip("|").split("|")])
            width = line.count("|") - 1
            assert all(len(r) == width for r in rows), (line, rows)
            tables[lines[i - 2]] = (line, rows)
    return tables


def _cell_ok(cell):
    return re.fullmatch(r"[\d,]+ ms / [\d,]+ MB(, \d+/\d+ calls in the engine)?", cell)


def test_help_lists_the_model_presets(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in PRESETS:
        assert name in text
    assert wants(["--preset", "zimage-turbo"]) and wants(["--preset=qwen2.5-0.5b-decode"])
    assert not wants(["--preset", "wan22-5b-480p"])


@pytest.mark.parametrize("preset, sizes", [("qwen2.5-0.5b-prefill", "64,128"), ("qwen2.5-0.5b-decode", "64")])
def test_qwen_presets_run_and_route_every_call(capsys, tmp_path, preset, sizes):
    text, saved = _run(capsys, tmp_path, preset, "--sizes", sizes)
    (head, rows), = _tables(text).values()
    assert head.split("|")[2:5] == [" math SDPA ", " engine (global patch) ", " torch default SDPA "]
    assert [r[0] for r in rows] == sizes.split(",")
    for r in rows:
        assert all(_cell_ok(c) for c in r[1:4]), r
        assert re.fullmatch(r"[\d.]+x as fast(, [\d.]+x the memory)?", r[4]), r
    results, = saved["results"].values()
    assert len(results) == 3 * len(rows)
    for r in results:
        assert r["ms"] > 0 and r["peak_mb"] >= 0, r
        if r["method"] == "engine":  # one SDPA call per layer per run, all in the engine, none passed on
            assert r["routed"] == r["expected"] == 1 and r["passed"] == 0, r
    assert saved["info"]["preset"] == preset and "load" in saved["info"]


def test_qwen_math_over_the_memory_budget_is_said(capsys, tmp_path):
    png = tmp_path / "chart.png"
    text, saved = _run(capsys, tmp_path, "qwen2.5-0.5b-prefill", "--sizes", "256", "--methods", "math,engine",
                       "--memory-budget-gb", "0.001", "--plot", str(png))
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:  # the oldest-torch environment has no matplotlib: the run says so on stderr and writes no chart
        assert not png.exists()
    (head, rows), = _tables(text).values()
    assert rows[0][1] == "out of memory" and _cell_ok(rows[0][2]) and rows[0][3] == "only engine (global patch) ran"
    assert "over the 0.0 GB budget (--memory-budget-gb): out of memory here" in text


def test_zimage_preset_runs_attention_and_a_dit_step(capsys, tmp_path):
    comfyuis = _comfyuis()
    if not comfyuis:
        pytest.skip("no test ComfyUI (COMFYUI_LATEST_PATH / COMFYUI_PATH): ./dev setup makes them")
    text, saved = _run(capsys, tmp_path, "zimage-turbo", "--sizes", "64", "--comfyui", comfyuis[0])
    tables = _tables(text)
    assert len(tables) == 2
    (attn_head, attn_rows), (dit_head, dit_rows) = tables.values()
    assert "math SDPA | engine | torch default SDPA | ComfyUI sub-quadratic" in attn_head
    # 64 px: 4 x 4 image tokens padded to 32, plus 128 text tokens
    assert attn_rows[0][0] == "64² (160)" and all(_cell_ok(c) for c in attn_rows[0][1:5]), attn_rows
    assert "ComfyUI's attention (unpatched) | math SDPA | engine (patched)" in dit_head
    assert all(_cell_ok(c) for c in dit_rows[0][1:4]), dit_rows
    dit = {r["method"]: r for r in saved["results"]["dit"]}
    assert dit["engine"]["routed"] == dit["engine"]["expected"] == 1, dit["engine"]
    assert dit["comfy"]["attention"].startswith("attention_"), dit["comfy"]  # ComfyUI's own choice, unpatched
    assert {r["method"] for r in saved["results"]["attention"] if "ms" in r} == {"math", "auto", "torch",
                                                                               "comfy-subquad"}


@pytest.mark.parametrize("which", [0, 1], ids=["latest", "oldest"])
def test_zimage_dit_step_routes_every_call_in_each_comfyui(which):
    """ComfyUI's own NextDiT (both test ComfyUIs have Z-Image's), a main block and a refiner block of each kind:
    each of the three attention calls of the step goes to the engine through the override."""
    comfyuis = _comfyuis()
    if len(comfyuis) <= which:
        pytest.skip("no test ComfyUI (COMFYUI_LATEST_PATH / COMFYUI_PATH): ./dev setup makes them")
    from attention_core.cli.bench_models import measure
    case = dict(method="engine", side=64, text=32, width=256, depth=1, refiners=1, dtype="float32", device="cpu",
                repeats=2, threads=0, comfyui=comfyuis[which])
    r = measure.run_in_process("attention_core.cli.bench_models.zimage", case, 600)
    assert r.get("routed") == r.get("expected") == 3 * 2, r
