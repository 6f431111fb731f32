"""./dev demo's argument checks run before any ComfyUI starts (the demo itself is not part of the suite)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bogus_mode_is_rejected_by_argparse_before_comfyui_starts(tmp_path):
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "tools.demo.demo", "--mode", "bogus", "--workdir", str(work)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "invalid choice: 'bogus'" in p.stderr
    assert not work.exists()  # nothing was set up, no server started


@pytest.mark.parametrize("argv,msg", [(["--size", "832x480"], "--size must look like"),
                                      (["--steps", "1"], "--steps must be >= 2"),
                                      (["--repeats", "0"], "--repeats must be >= 1"),
                                      (["--ffn-chunks", "-1"], "--ffn-chunks must be >= 0"),
                                      (["--size", "64x64x5", "--preset", "480p"], "give one of them"),
                                      (["--preset", "1080p"], "invalid choice")])
def test_other_bad_arguments(argv, msg, capsys):
    from tools.demo.demo import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_default_is_the_quick_run_and_full_is_the_480p_workflow_at_real_width():
    from tools.demo.demo import PRESETS, REAL_WIDTH, parse_args
    a = parse_args([])
    assert a.frame_size == (832, 480, 21) and a.blocks == 1 and a.steps == 3 and a.repeats == 2 and not a.math
    f = parse_args(["--full"])
    assert f.frame_size == PRESETS["480p"] == (832, 480, 41) and f.preset == "480p"
    assert f.blocks == 2 and f.steps >= 3 and f.repeats >= 3 and f.math
    g = parse_args(["--full", "--no-math", "--blocks", "1"])  # a flag given wins over the profile
    assert not g.math and g.blocks == 1 and g.steps == f.steps
    assert REAL_WIDTH == {"heads": 24, "ffn_dim": 14336}


def test_help_shows_the_defaults_and_the_expected_time(capsys):
    from tools.demo.demo import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "(default: 1; --full: 2)" in out and "(default: 3; --full: 4)" in out and "(default: off; --full: on)" in out
    assert "(default: demo-output)" in out
    assert "Expected time on 2 CPU cores with nothing else running: about 10 min for the default run" in out


def test_without_decode_only_the_sampled_latent_is_saved():
    from tools.demo.demo import configure

    def node(ct, **inputs):
        return {"class_type": ct, "inputs": inputs}
    prompt = {"1": node("UNETLoader", unet_name="w", weight_dtype="default"),
              "2": node("TiledAttentionPatch", model=["1", 0], mode="auto", memory_budget_mb=0,
                        half_precision="keep", min_tokens=1024),
              "3": node("TiledFFNChunking", model=["2", 0], chunks=0, enabled=True),
              "4": node("VAELoader", vae_name="v"),
              "5": node("Wan22ImageToVideoLatent", vae=["4", 0], width=832, height=480, length=41, batch_size=1),
              "6": node("KSampler", model=["3", 0], latent_image=["5", 0], seed=1, steps=20),
              "7": node("VAEDecodeTiled", samples=["6", 0], vae=["4", 0], tile_size=512),
              "8": node("CreateVideo", images=["7", 0], fps=24.0),
              "9": node("SaveVideo", video=["8", 0], filename_prefix="video/x")}
    full = configure(prompt, "x", (832, 480), 21, 3, 1, True, False, "chunked")
    timed = configure(prompt, "x", (832, 480), 21, 3, 1, True, False, "chunked", decode=False)
    kinds = sorted(n["class_type"] for n in full.values())
    assert {"VAEDecodeTiled", "SaveImage", "SaveVideo", "SaveLatent"} <= set(kinds)
    assert sorted(n["class_type"] for n in timed.values()) == sorted(
        k for k in kinds if k not in ("VAEDecodeTiled", "CreateVideo", "SaveVideo", "SaveImage"))
    assert timed["6"]["inputs"]["steps"] == 3 and timed["5"]["inputs"]["length"] == 21
    for n in timed.values():  # nothing points at a removed node
        for v in n["inputs"].values():
            if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
                assert v[0] in timed


def test_a_second_run_reuses_the_model_files_it_wrote(tmp_path):
    import argparse

    from tools.demo.demo import write_models
    models = tmp_path / "models"
    models.mkdir()
    (models / "real-width-1-blocks").touch()  # what the first run leaves
    assert write_models(str(models), argparse.Namespace(models=None, blocks=1)) is None
    assert sorted(os.listdir(models)) == ["real-width-1-blocks"]


def test_relative_output_paths_are_read_from_the_callers_folder(tmp_path, monkeypatch):
    """./dev demo runs from the clone and passes the caller's folder: --out-dir (and --chart, --json, --workdir,
    --models) given relative mean relative to where the user was; absolute ones are kept."""
    from tools.demo.demo import parse_args
    monkeypatch.setenv("TILED_ATTENTION_CALLER_CWD", str(tmp_path))
    a = parse_args(["--chart", "c.png", "--workdir", "/abs/work"])
    assert a.out_dir == str(tmp_path / "demo-output") and a.chart == str(tmp_path / "c.png")
    assert a.workdir == "/abs/work" and a.json is None and a.models is None
    monkeypatch.delenv("TILED_ATTENTION_CALLER_CWD")
    assert parse_args(["--out-dir", "o"]).out_dir == "o"  # run directly: relative to the current folder


def test_report_only_writes_its_chart_where_asked_and_nothing_in_the_home_folder(tmp_path):
    """The demo's report (the same code as after a run) from a saved runs.json, in a real process with an empty
    home folder: the chart and the JSON land in --out-dir relative to the caller's folder, matplotlib's files in
    the clone's .cache/matplotlib, nothing in ~/.cache or ~/.config; a CPU run names the CPU's default."""
    import json
    work, home, caller = tmp_path / "work", tmp_path / "home", tmp_path / "caller"
    for d in (work, home, caller):
        d.mkdir()
    configs = [["ComfyUI sub-quadratic", "default"], ["Patch Attention (chunked)", "recommended"]]
    runs = [dict(label=label, rep=0, secs=60.0, first_step=14.0, later_steps=[13.0, 13.5], peak=peak * 2**30,
                 growth=growth * 2**30, others=[0, 0], pngs=[])
            for label, peak, growth in (("ComfyUI sub-quadratic", 4.77, 2.47), ("Patch Attention (chunked)", 3.09,
                                                                                 0.69))]
    meta = dict(tokens=2340, size=[832, 480, 21], preset=None, blocks=1, steps=3, repeats=1, mode="chunked",
                gpu=False, configs=configs, real=False, cores=2, load_before=0.5)
    (work / "runs.json").write_text(json.dumps({"meta": meta, "runs": runs}))
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME")}
    env.update(HOME=str(home), TILED_ATTENTION_CALLER_CWD=str(caller))
    p = subprocess.run([sys.executable, "-m", "tools.demo.demo", "--report-only", "--workdir", str(work), "--out-dir",
                        "out"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert (caller / "out" / "demo.png").stat().st_size > 0
    saved = json.loads((caller / "out" / "demo.json").read_text())
    assert "vs ComfyUI's default on the CPU (and on the GPUs this pack is for)" in saved["headline"][0]
    assert "1.5x less peak memory (the whole server) and 3.6x less growth during the prompt" in saved["headline"][0]
    assert os.listdir(home) == []
    assert os.path.isdir(os.path.join(ROOT, ".cache", "matplotlib"))
