"""`pip install` of the repository brings the engine alone: a wheel with `attention_core` (importable and working
without ComfyUI, the repository or PYTHONPATH), never `nodes` (which would shadow ComfyUI's nodes.py) and never torch
as a dependency (a ROCm user's torch must stay)."""
import os
import shutil
import subprocess
import sys
import zipfile

from tools.comfyui_setup.comfyui import ROOT

CHECK = """
import torch, attention_core
q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
out = attention_core.scaled_dot_product_attention(q, k, v, tier="chunked")
assert (out - ref).abs().max() < 1e-5, (out - ref).abs().max()
print(attention_core.__file__)
print(attention_core.__version__)  # no pyproject.toml beside an installed wheel: the metadata's, the same line's
"""


def test_wheel_holds_the_engine_alone_and_it_works_installed(tmp_path):
    wheels, site, src = tmp_path / "wheels", tmp_path / "site", tmp_path / "src"
    # built from a copy: setuptools writes build/ and *.egg-info beside pyproject.toml, never into the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", "build", "*.egg-info",
                                                               "test-artifacts", "__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        tops = {n.split("/")[0] for n in z.namelist()}
        meta = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    assert tops == {"attention_core", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert not [r for r in requires if "torch" in r.lower()], requires
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                           str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().startswith(str(site)), run.stdout
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert run.stdout.split()[-1] == tomllib.load(f)["project"]["version"], run.stdout
