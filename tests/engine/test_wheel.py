"""The engine as a wheel, kept so: tools/wheel/check.py builds it (python -m build) from what git holds, twine-checks
it, installs it into a fresh venv beside this environment's torch (changing nothing installed there) and runs the
integrations' tests from the installed copy; its content rules refuse a wheel that lacks a module, carries more than
the engine or asks for torch; the version is written once, in pyproject.toml."""
import os
import re
import subprocess
import sys
import zipfile

import pytest

import attention_core
from attention_core import version as package_version
from tools.comfyui_setup.comfyui import ROOT
from tools.wheel import check


def _pyproject_version():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    return re.search(r'(?ms)^\[project\].*?^version = "([^"]+)"', text).group(1)


def test_the_version_is_written_once_in_pyproject():
    assert attention_core.__version__ == _pyproject_version()
    for d, _, files in os.walk(os.path.dirname(attention_core.__file__)):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    assert not re.search(r"""(?m)^\s*__version__\s*=\s*["']""", fh.read()), \
                        f"{f}: a second copy of the version (pyproject.toml holds it)"


def test_the_version_of_an_installed_copy_is_its_metadata(monkeypatch, tmp_path):
    """No pyproject.toml of the pack beside the package (a wheel in site-packages): the distribution's metadata,
    else "0+unknown"; another project's pyproject.toml is never read as ours."""
    other = tmp_path / "pyproject.toml"
    other.write_text('[project]\nname = "something-else"\nversion = "9.9.9"\n')
    monkeypatch.setattr(package_version, "PYPROJECT", str(other))
    import importlib.metadata as md
    monkeypatch.setattr(md, "version", lambda name: "7.7.7" if name == "tiled-attention" else md.version(name))
    package_version.version.cache_clear()
    try:
        assert package_version.version() == "7.7.7"

        def missing(name):
            raise md.PackageNotFoundError(name)
        monkeypatch.setattr(md, "version", missing)
        package_version.version.cache_clear()
        assert package_version.version() == package_version.UNKNOWN
    finally:
        package_version.version.cache_clear()


def _fake_wheel(tmp_path, version, extra=(), drop=(), requires=("psutil",)):
    """A wheel-shaped zip of this checkout's attention_core (less `drop`, plus `extra` top-level files)."""
    src = tmp_path / "src"
    (src / "attention_core" / "sub").mkdir(parents=True)
    (src / "pyproject.toml").write_text(f'[project]\nname = "tiled-attention"\nversion = "{version}"\n[x]\n')
    for rel in ("attention_core/__init__.py", "attention_core/sub/__init__.py", "attention_core/sub/mod.py"):
        (src / rel).write_text('"""x"""\n')
    wheel = tmp_path / f"tiled_attention-{version}-py3-none-any.whl"
    dist_info = f"tiled_attention-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: tiled-attention\nVersion: {version}\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(wheel, "w") as z:
        for rel in ("attention_core/__init__.py", "attention_core/sub/__init__.py", "attention_core/sub/mod.py"):
            if rel not in drop:
                z.writestr(rel, '"""x"""\n')
        for rel in extra:
            z.writestr(rel, "")
        z.writestr(f"{dist_info}/METADATA", meta)
    return str(wheel), str(src)


def test_the_content_rules(tmp_path):
    wheel, src = _fake_wheel(tmp_path / "ok", "1.2.3")
    assert check.check_content(wheel, src)["version"] == "1.2.3"
    wheel, src = _fake_wheel(tmp_path / "lacks", "1.2.3", drop=("attention_core/sub/mod.py",))
    with pytest.raises(check.CheckFailed, match=r"lacks \['attention_core/sub/mod.py'\].*\[tool.setuptools\]"):
        check.check_content(wheel, src)
    wheel, src = _fake_wheel(tmp_path / "nodes", "1.2.3", extra=("nodes/__init__.py",))
    with pytest.raises(check.CheckFailed, match="alone"):
        check.check_content(wheel, src)
    wheel, src = _fake_wheel(tmp_path / "torch", "1.2.3", requires=("psutil", "torch>=2.5"))
    with pytest.raises(check.CheckFailed, match="requires torch"):
        check.check_content(wheel, src)


def test_the_wheel_builds_installs_beside_this_torch_and_passes_the_integrations_tests_installed():
    """The whole check against this environment (the pinned torch in the main suite, torch 2.5.1 in the oldest-torch
    run), from the working tree's files as git lists them; the integrations' tests are cut to a sample here (.ci/run
    runs them all, beside both torches, from a clone of HEAD)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "tools.wheel.check", "--source", "worktree", "--torch-env", sys.prefix,
                        "-k", "wan2.2 or flux or refused or compile"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert re.search(r"built and twine-checked tiled_attention-\S+-py3-none-any\.whl", out), out
    assert re.search(r"beside torch \S+ .*installed, imported from the fresh venv; .*\d+ passed", out), out
    assert "failed" not in out.split("beside torch", 1)[1], out
