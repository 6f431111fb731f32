"""The engine as a wheel, checked the way a user gets it: python -m tools.wheel.check [--torch-env VENV ...].

1. the source: a `git clone` of HEAD (default), or with --source worktree the files git lists in the working tree
   (tracked and untracked-not-ignored: what a commit of it would hold), in a temporary folder;
2. `python -m build --wheel` of it and `twine check --strict` of the wheel, with build, twine and setuptools pinned in
   tools/wheel/requirements-wheel-tools.txt, installed (first time, or when the pins change) into
   .cache/wheel-tools, never into the test environments;
3. the wheel's content: `attention_core` (every module of the source's attention_core/, nothing else: no nodes/, no
   tools/) and its dist-info; the version pyproject.toml states; no torch among its requirements;
4. for each --torch-env (a virtual environment with torch installed: the pinned one in .venv, torch 2.5.1 in
   .venv-torch2.5): a fresh venv of the same Python whose site-packages reaches that environment's packages through
   a .pth file, the wheel installed into it with `pip install --no-deps`; `attention_core` must import from the
   fresh venv (never from the checkout) with that torch; then the integrations' tests (every tests/**/test_*.py of
   the source that imports attention_core.integrations, with tests/support beside them) run with pytest from a
   folder outside the checkout, the installed copy asserted by their conftest; the environment's installed
   distributions are the same before and after (nothing installed, upgraded or removed there).

Prints each step and its time; exits 1 with the failed step's output. Needs git and, the first time, PyPI (the
pinned tools). Default --torch-env: the environment of the Python running it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS_REQUIREMENTS = os.path.join(ROOT, "tools", "wheel", "requirements-wheel-tools.txt")
TOOLS_VENV = os.path.join(ROOT, ".cache", "wheel-tools")
DIST_NAME = "tiled-attention"
PACKAGE = "attention_core"
SMOKE_MARK = "attention_core.integrations"  # a test file that imports this is one of the integrations' tests

ENV_PROBE = ("import json, sys, sysconfig, torch; print(json.dumps({'site': sorted({sysconfig.get_path('purelib'), "
             "sysconfig.get_path('platlib')}), 'torch': torch.__version__, 'python': '%d.%d' % sys.version_info[:2]}))")
INSTALLED_PROBE = ("import json, os, sys, torch, attention_core; print(json.dumps({'file': "
                   "os.path.realpath(attention_core.__file__), 'version': attention_core.__version__, "
                   "'torch': torch.__version__, 'prefix': os.path.realpath(sys.prefix)}))")
SMOKE_CONFTEST = '''"""Written by tools/wheel/check.py: these tests run against the installed wheel, never a checkout."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
import attention_core  # noqa: E402

_file = os.path.realpath(attention_core.__file__)
assert _file.startswith(os.path.realpath(sys.prefix) + os.sep), (
    f"attention_core imported from {_file}, not from the wheel installed in {sys.prefix}")
'''


class CheckFailed(Exception):
    pass


def say(msg: str) -> None:
    print(f"[wheel-check] {msg}", flush=True)


def run(cmd, what: str, timeout: int = 600, **kw) -> str:
    """Run cmd; its stdout, or CheckFailed naming `what` with the output's tail."""
    env = kw.pop("env", None)
    if env is None:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kw)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"{what}: timed out after {timeout} s ({' '.join(map(str, cmd))})") from None
    if r.returncode != 0:
        raise CheckFailed(f"{what} failed (exit {r.returncode}): {' '.join(map(str, cmd))}\n"
                          f"{(r.stdout + r.stderr)[-6000:]}")
    return r.stdout


def venv_python(venv: str) -> str:
    return os.path.join(venv, "Scripts", "python.exe") if os.name == "nt" else os.path.join(venv, "bin", "python")


def tools_python(base_python: str = sys.executable) -> str:
    """The tools venv's python (.cache/wheel-tools), made and filled from the pinned list when it changed."""
    py = venv_python(TOOLS_VENV)
    stamp = os.path.join(TOOLS_VENV, ".requirements.txt")
    with open(TOOLS_REQUIREMENTS, encoding="utf-8") as f:
        wanted = f.read()
    if not os.path.exists(py):
        say(f"creating {TOOLS_VENV} (build, twine)")
        run([base_python, "-m", "venv", TOOLS_VENV], "creating the tools venv")
    have = open(stamp, encoding="utf-8").read() if os.path.exists(stamp) else None
    if have != wanted:
        say(f"installing the pinned wheel tools ({os.path.relpath(TOOLS_REQUIREMENTS, ROOT)})")
        run([py, "-m", "pip", "install", "-q", "--no-deps", "-r", TOOLS_REQUIREMENTS], "installing build and twine")
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(wanted)
    return py


def source_tree(dest: str, source: str) -> str:
    """The source to build: a clone of HEAD, or the files git lists in the working tree; returns its folder."""
    src = os.path.join(dest, "src")
    if source == "head":
        run(["git", "clone", "-q", "--no-hardlinks", ROOT, src], "git clone of HEAD")
        return src
    listed = run(["git", "-C", ROOT, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                 "listing the working tree's files")
    for rel in filter(None, listed.split("\0")):
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path):  # deleted but not yet committed
            continue
        os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
        shutil.copy2(path, os.path.join(src, rel))
    return src


def _pyproject_version(src: str) -> str:
    with open(os.path.join(src, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    project = re.search(r"(?ms)^\[project\]\s*$(.*?)(?=^\[)", text + "\n[end]")
    m = project and re.search(r'(?m)^version\s*=\s*"([^"]+)"', project.group(1))
    if not m:
        raise CheckFailed("pyproject.toml has no [project] version")
    return m.group(1)


def build_wheel(tools_py: str, src: str, dist: str) -> str:
    run([tools_py, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src], "python -m build --wheel",
        cwd=src)
    wheels = [f for f in os.listdir(dist) if f.endswith(".whl")]
    if len(wheels) != 1:
        raise CheckFailed(f"python -m build --wheel made {wheels}, not one wheel")
    return os.path.join(dist, wheels[0])


def check_content(wheel: str, src: str) -> dict:
    """The wheel holds the engine alone, all of it, at the version pyproject.toml states, without torch."""
    version = _pyproject_version(src)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
        meta = z.read(meta_name).decode() if meta_name else ""
    dist_info = f"{DIST_NAME.replace('-', '_')}-{version}.dist-info"
    tops = {n.split("/")[0] for n in names}
    if tops != {PACKAGE, dist_info}:
        raise CheckFailed(f"the wheel holds {sorted(tops)}: it must hold {PACKAGE} and {dist_info} alone (the version "
                          f"of pyproject.toml is {version})")
    pkg_root = os.path.join(src, PACKAGE)
    want = {os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
            for d, _, files in os.walk(pkg_root) for f in files if f.endswith(".py")}
    have = {n for n in names if n.endswith(".py")}
    if want - have:
        raise CheckFailed(f"the wheel lacks {sorted(want - have)[:10]}: add their packages to pyproject.toml "
                          f"[tool.setuptools] packages")
    fields = dict(re.findall(r"(?m)^(Name|Version): (.+)$", meta))
    if fields.get("Name") != DIST_NAME or fields.get("Version") != version:
        raise CheckFailed(f"the wheel's metadata says {fields}, pyproject.toml {DIST_NAME} {version}")
    requires = re.findall(r"(?m)^Requires-Dist: (.+)$", meta)
    if any(re.match(r"(torch|torchvision|torchaudio)\b", r, re.I) for r in requires):
        raise CheckFailed(f"the wheel requires torch ({requires}): pip would replace a user's ROCm torch")
    return {"version": version, "modules": len(have), "requires": requires}


def distributions(site_dirs) -> list:
    """The *.dist-info / *.egg-info names (name-version) installed in those folders."""
    found = []
    for d in site_dirs:
        if os.path.isdir(d):
            found += [e for e in os.listdir(d) if e.endswith((".dist-info", ".egg-info"))]
    return sorted(found)


def smoke_tests(src: str, dest: str) -> list:
    """Copy the integrations' tests (test files that import attention_core.integrations) and tests/support into
    dest, with a conftest that asserts the installed copy; returns the copied test files."""
    os.makedirs(dest)
    tests = os.path.join(src, "tests")
    copied = []
    for d, _, files in os.walk(tests):
        for f in sorted(files):
            if f.startswith("test_") and f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    text = fh.read()
                if re.search(r"^WHEEL_SMOKE\s*=\s*False", text, re.M):
                    continue  # a test of checkout files the wheel does not ship (training/ scripts)
                if re.search(r"^\s*(from|import)\s+" + re.escape(SMOKE_MARK), text, re.M):
                    shutil.copy2(os.path.join(d, f), os.path.join(dest, f))
                    copied.append(f)
    if not copied:
        raise CheckFailed(f"no test file under tests/ imports {SMOKE_MARK}: nothing to run from the wheel")
    support = os.path.join(tests, "support")
    if os.path.isdir(support):
        shutil.copytree(support, os.path.join(dest, "support"))
    with open(os.path.join(dest, "conftest.py"), "w", encoding="utf-8") as f:
        f.write(SMOKE_CONFTEST)
    return copied


def check_beside(env: str, wheel: str, src: str, work: str, version: str, smoke_k: str, tools_py: str) -> dict:
    """Install the wheel into a fresh venv beside env's torch, import it from there, run the smoke tests."""
    env_py = venv_python(env)
    if not os.path.exists(env_py):
        raise CheckFailed(f"--torch-env {env}: no {env_py} (create it first: ./dev setup, ./dev test-oldest-torch)")
    info = json.loads(run([env_py, "-c", ENV_PROBE], f"reading {env}'s torch", cwd=work).strip().splitlines()[-1])
    label = "torch-" + re.sub(r"[^0-9A-Za-z.]+", "_", info["torch"])
    before = distributions(info["site"])
    venv = os.path.join(work, f"venv-{label}")
    run([env_py, "-m", "venv", "--without-pip", venv], f"creating a fresh venv beside torch {info['torch']}",
        cwd=work)
    py = venv_python(venv)
    site = json.loads(run([py, "-c", "import json, sysconfig; print(json.dumps(sysconfig.get_path('purelib')))"],
                          "reading the fresh venv's site-packages", cwd=work))
    with open(os.path.join(site, "zz_beside_torch.pth"), "w", encoding="utf-8") as f:
        f.write("\n".join(info["site"]) + "\n")  # after the venv's own site-packages: the wheel's copy comes first
    run([tools_py, "-m", "pip", "--python", py, "install", "-q", "--no-deps", "--no-index", wheel],
        "pip install --no-deps of the wheel into the fresh venv", cwd=work)
    env_vars = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env_vars["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into the environment's package folders
    got = json.loads(run([py, "-c", INSTALLED_PROBE], "importing the installed attention_core", cwd=work,
                         env=env_vars).strip().splitlines()[-1])
    if not got["file"].startswith(os.path.realpath(venv) + os.sep):
        raise CheckFailed(f"attention_core imported from {got['file']}, not from the wheel in {venv}")
    if got["version"] != version or got["torch"] != info["torch"]:
        raise CheckFailed(f"installed: attention_core {got['version']} with torch {got['torch']}; expected "
                          f"{version} with torch {info['torch']}")
    smoke = os.path.join(work, f"smoke-{label}")
    files = smoke_tests(src, smoke)
    cmd = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", smoke, "-o", "addopts=", smoke]
    if smoke_k:
        cmd[-1:-1] = ["-k", smoke_k]
    out = run(cmd, f"the integrations' tests from the wheel beside torch {info['torch']}", cwd=smoke, env=env_vars,
              timeout=900)
    after = distributions(info["site"])
    if after != before:
        raise CheckFailed(f"{env}'s installed packages changed: added {sorted(set(after) - set(before))}, removed "
                          f"{sorted(set(before) - set(after))}")
    tail = [ln for ln in out.strip().splitlines() if ln.strip()][-1]
    return {"torch": info["torch"], "files": files, "pytest": tail}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.wheel.check", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-env", action="append", default=[], metavar="VENV",
                    help="a virtual environment with torch to install the wheel beside (repeatable; default: the "
                         "environment of the Python running this)")
    ap.add_argument("--source", choices=("head", "worktree"), default="head",
                    help="head: a git clone of HEAD (CI); worktree: the files git lists in the working tree")
    ap.add_argument("-k", dest="smoke_k", default="", help="pytest -k expression for the smoke tests (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = ap.parse_args(argv)
    envs = [os.path.abspath(e) for e in args.torch_env] or [sys.prefix]
    work = tempfile.mkdtemp(prefix="tiled-attention-wheel-")
    start = time.monotonic()
    try:
        t = time.monotonic()
        tools_py = tools_python()
        src = source_tree(work, args.source)
        say(f"source: {args.source} ({src}); tools ready in {time.monotonic() - t:.0f} s")
        t = time.monotonic()
        wheel = build_wheel(tools_py, src, os.path.join(work, "dist"))
        run([tools_py, "-m", "twine", "check", "--strict", wheel], "twine check --strict")
        content = check_content(wheel, src)
        say(f"built and twine-checked {os.path.basename(wheel)} in {time.monotonic() - t:.0f} s: {content['modules']} "
            f"modules of {PACKAGE} alone, version {content['version']}, requires {content['requires']}")
        t = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(envs)) as pool:  # one environment per CPU
            jobs = [pool.submit(check_beside, env, wheel, src, work, content["version"], args.smoke_k, tools_py)
                    for env in envs]
            failed = []
            for env, job in zip(envs, jobs):
                try:
                    res = job.result()
                except CheckFailed as e:
                    failed.append(str(e))
                    continue
                say(f"beside torch {res['torch']} ({env}): installed, imported from the fresh venv; "
                    f"{', '.join(res['files'])}: {res['pytest']} ({time.monotonic() - t:.0f} s)")
        if failed:
            raise CheckFailed("\n".join(failed))
    except CheckFailed as e:
        say(f"FAILED: {e}")
        return 1
    finally:
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    say(f"wheel OK ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
