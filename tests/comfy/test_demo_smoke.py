"""./dev demo's argument checks run before any ComfyUI starts (the demo itself is not part of the suite)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bogus_mode_is_rejected_by_argparse_before_comfyui_starts(tmp_path):
    work = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "tools.demo", "--mode", "bogus", "--workdir", str(work)], cwd=ROOT,
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
    from tools.demo import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_default_is_the_quick_run_and_full_is_the_480p_workflow_at_real_width():
    from tools.demo import PRESETS, REAL_WIDTH, parse_args
    a = parse_args([])
    assert a.frame_size == (832, 480, 21) and a.blocks == 1 and a.steps == 3 and a.repeats == 2 and not a.math
    f = parse_args(["--full"])
    assert f.frame_size == PRESETS["480p"] == (832, 480, 41) and f.preset == "480p"
    assert f.blocks == 2 and f.steps >= 3 and f.repeats >= 3 and f.math
    g = parse_args(["--full", "--no-math", "--blocks", "1"])  # a flag given wins over the profile
    assert not g.math and g.blocks == 1 and g.steps == f.steps
    assert REAL_WIDTH == {"heads": 24, "ffn_dim": 14336}


def test_help_shows_the_defaults_and_the_expected_time(capsys):
    from tools.demo import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0
    assert "(default: 1; --full: 2)" in out and "(default: 3; --full: 4)" in out and "(default: off; --full: on)" in out
    assert "(default: demo-output)" in out
    assert "Expected time on 2 CPU cores with nothing else running: about 10 min for the default run" in out


def test_without_decode_only_the_sampled_latent_is_saved():
    from tools.demo import configure

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

    from tools.demo import write_models
    models = tmp_path / "models"
    models.mkdir()
    (models / "real-width-1-blocks").touch()  # what the first run leaves
    assert write_models(str(models), argparse.Namespace(models=None, blocks=1)) is None
    assert sorted(os.listdir(models)) == ["real-width-1-blocks"]
