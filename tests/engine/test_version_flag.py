"""Every command answers --version with the pack's version (pyproject.toml's, through attention_core.version), as
`python -m attention_core.X --version` prints it, before doing any work."""
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import attention_core

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("plan", "bench", "tune", "calibrate", "report", "selfcheck")


def pyproject_version():
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]


def test_the_package_version_is_pyproject_s():
    assert attention_core.__version__ == pyproject_version()


@pytest.mark.parametrize("command", COMMANDS)
def test_version_flag(command, capsys):
    main = importlib.import_module(f"attention_core.{command}").main
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"python -m attention_core.{command} {pyproject_version()} (tiled-attention)\n"


def test_version_flag_as_a_module():
    out = subprocess.run([sys.executable, "-m", "attention_core.plan", "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["python", "-m", "attention_core.plan", pyproject_version(),
                                                          "(tiled-attention)"], out
