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
                                      (["--steps", "0"], "--steps must be >= 1"),
                                      (["--preset", "1080p"], "invalid choice")])
def test_other_bad_arguments(argv, msg, capsys):
    from tools.demo import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_defaults_are_the_480p_workflow_at_real_width():
    from tools.demo import PRESETS, REAL_WIDTH, parse_args
    a = parse_args([])
    assert PRESETS[a.preset] == (832, 480, 41) and a.blocks == 2 and a.repeats >= 2
    assert REAL_WIDTH == {"heads": 24, "ffn_dim": 14336}


def test_step_time_read_from_the_sampler_progress_bar():
    from tools.demo import step_seconds
    log = "  0%|          | 0/2 [00:00<?, ?it/s]\r 50%|#####     | 1/2 [00:41<00:41, 41.20s/it]\r" \
          "100%|##########| 2/2 [01:20<00:00, 40.10s/it]\n"
    assert step_seconds(log) == pytest.approx(40.10)
    assert step_seconds("100%|##| 4/4 [00:01<00:00,  2.50it/s]") == pytest.approx(0.4)
    assert step_seconds("nothing here") is None
