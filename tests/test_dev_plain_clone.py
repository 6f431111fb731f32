"""`./dev` from a plain clone (no ../shared beside it): it downloads the stock ComfyUI 0.33.0 and checks it against
tools/comfyui_setup/comfyui-0.33.0.sha256, and `./dev CMD --help` sets nothing up.

The download runs the real `./dev fetch-comfyui` in a copy of the files it needs (dev,
tools/comfyui_setup/fetch_comfyui.py, the manifest), laid out with no shared folder next to it, against the stock
tarball served from a local HTTP server or a file:// URL: no venv is built and nothing is written into this checkout."""
import functools
import http.server
import io
import os
import shutil
import subprocess
import sys
import tarfile
import threading

import pytest

from comfy_harness import missing
from tools.comfyui_setup.comfyui import ROOT, SHARED

TOKENIZERS = ("comfy/text_encoders/llama_tokenizer/tokenizer.json", "comfy/text_encoders/qwen35_tokenizer/vocab.json")
CHANGED, DROPPED = "comfy/model_management.py", "comfy/ldm/lightricks/model.py"
CLONE_FILES = ("dev", "tools/__init__.py", "tools/comfyui_setup/__init__.py", "tools/comfyui_setup/fetch_comfyui.py",
               "tools/comfyui_setup/comfyui-0.33.0.sha256")


@pytest.fixture(scope="module")
def stock_tarball():
    """../shared's stock ComfyUI 0.33.0 tarball, or the one `./dev` downloaded into .cache/ in a plain clone."""
    for path in (os.path.join(SHARED, "comfyui", "ComfyUI-0.33.0.tar.gz"),
                 os.path.join(ROOT, ".cache", "ComfyUI-0.33.0.tar.gz")):
        if os.path.isfile(path):
            return path
    missing("no stock ComfyUI 0.33.0 tarball (../shared/comfyui or .cache/ComfyUI-0.33.0.tar.gz): run ./dev setup")


def rewrite(src, dst, change=None, drop=None, add=()):
    """A copy of the tarball src with one file's bytes changed, one file left out, or files added."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w:gz", compresslevel=1) as tout:
        top = None
        for m in tin.getmembers():
            top = top or m.name.split("/")[0]
            rel = m.name.partition("/")[2]
            if rel == drop:
                continue
            data = tin.extractfile(m).read() if m.isfile() else None
            if rel == change:
                data += b"\n# changed\n"
                m.size = len(data)
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
        for rel in add:
            data = b'{"stand-in": "upstream has this file, ../shared does not"}\n'
            info = tarfile.TarInfo(f"{top}/{rel}")
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))
    return dst


@pytest.fixture(scope="module")
def served(stock_tarball, tmp_path_factory):
    """A local HTTP server on 127.0.0.1 with: upstream.tar.gz (the stock copy plus the two tokenizer files the full
    upstream tree has), changed.tar.gz (one Python file changed), missing.tar.gz (one Python file left out)."""
    root = tmp_path_factory.mktemp("served")
    rewrite(stock_tarball, root / "upstream.tar.gz", add=TOKENIZERS)
    rewrite(stock_tarball, root / "changed.tar.gz", change=CHANGED)
    rewrite(stock_tarball, root / "missing.tar.gz", drop=DROPPED)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def clone(tmp_path):
    """What `./dev fetch-comfyui` needs of a clone, at tmp/clone; tmp/shared (its ../shared) does not exist."""
    for rel in CLONE_FILES:
        os.makedirs(tmp_path / "clone" / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), tmp_path / "clone" / rel)
    return tmp_path / "clone"


def dev(where, *args, url, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TILED_ATTENTION_SHARED", "COMFYUI_PATH", "COMFYUI_LATEST_PATH")}
    env.update(VENV=str(tmp_path / "venv"), PYTHON=sys.executable, TILED_ATTENTION_COMFYUI_URL=url,
               PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([os.path.join(where, "dev"), *args], capture_output=True, text=True, env=env, cwd=where,
                          timeout=300)


@pytest.mark.parametrize("scheme", ["http", "file"])
def test_plain_clone_downloads_comfyui_and_checks_it(clone, served, stock_tarball, tmp_path, scheme):
    url = f"{served}/upstream.tar.gz" if scheme == "http" else "file://" + os.path.abspath(stock_tarball)
    out = dev(clone, "fetch-comfyui", url=url, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"downloading stock ComfyUI 0.33.0 from {url}" in out.stderr
    tree = clone / ".cache" / "comfyui-0.33.0"
    assert '__version__ = "0.33.0"' in (tree / "comfyui_version.py").read_text()
    assert (tree / "comfy" / "ldm" / "lightricks" / "model.py").is_file()
    if scheme == "http":  # files of the full upstream tree that the manifest does not list are accepted
        assert all((tree / rel).is_file() for rel in TOKENIZERS)
    assert sorted(os.listdir(clone / ".cache")) == ["ComfyUI-0.33.0.tar.gz", "comfyui-0.33.0"]  # kept, no .partial
    assert not (tmp_path / "venv").exists()


@pytest.mark.parametrize("damage", ["changed", "missing"])
def test_damaged_download_is_refused_and_leaves_nothing(clone, served, tmp_path, damage):
    out = dev(clone, "fetch-comfyui", url=f"{served}/{damage}.tar.gz", tmp_path=tmp_path)
    assert out.returncode == 2, out.stderr
    error = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, out.stderr
    expected = f"{CHANGED} differs" if damage == "changed" else f"{DROPPED} is missing"
    assert expected in error[0] and "Nothing was installed" in error[0], error[0]
    assert "Traceback" not in out.stderr
    assert os.listdir(clone / ".cache") == []  # no tree, no .partial, no kept download


def test_shared_copy_is_used_offline(clone, stock_tarball, tmp_path):
    os.makedirs(tmp_path / "shared" / "comfyui")
    os.symlink(stock_tarball, tmp_path / "shared" / "comfyui" / "ComfyUI-0.33.0.tar.gz")
    out = dev(clone, "fetch-comfyui", url="http://127.0.0.1:9/unreachable.tar.gz", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "unpacking stock ComfyUI 0.33.0 from" in out.stderr and "downloading" not in out.stderr
    assert (clone / ".cache" / "comfyui-0.33.0" / "comfyui_version.py").is_file()


def test_unreachable_url_says_what_to_do(clone, tmp_path):
    out = dev(clone, "fetch-comfyui", url="http://127.0.0.1:9/unreachable.tar.gz", tmp_path=tmp_path)
    assert out.returncode == 2
    assert "error: could not download http://127.0.0.1:9/unreachable.tar.gz" in out.stderr
    assert "TILED_ATTENTION_SHARED" in out.stderr and "Traceback" not in out.stderr
    assert os.listdir(clone / ".cache") == []


@pytest.mark.parametrize("cmd", ["test", "demo", "bench", "mutate", "setup", "fetch-comfyui"])
def test_help_sets_nothing_up(cmd, tmp_path):
    """`./dev CMD --help` answers at once: no venv is created and torch is never imported (a torch.py that raises
    shadows any installed torch)."""
    (tmp_path / "notorch").mkdir()
    (tmp_path / "notorch" / "torch.py").write_text("raise ImportError('--help must not import torch')\n")
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "PYTHON": sys.executable, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(tmp_path / "notorch")}
    out = subprocess.run([os.path.join(ROOT, "dev"), cmd, "--help"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:"), out.stdout
    assert "[dev]" not in out.stderr, out.stderr  # nothing was set up
    assert not (tmp_path / "venv").exists()


@pytest.fixture
def tiny_server(tmp_path):
    """A local HTTP server of a folder holding one file that is not a tarball (bad.tar.gz)."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "bad.tar.gz").write_bytes(b"<html>not a tarball</html>\n")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_missing_url_names_the_http_status_not_the_network(tiny_server, tmp_path):
    from tools.comfyui_setup import fetch_comfyui
    with pytest.raises(fetch_comfyui.FetchError) as e:
        fetch_comfyui.download(f"{tiny_server}/gone.tar.gz", str(tmp_path / "x.tar.gz"))
    msg = str(e.value)
    assert f"could not download {tiny_server}/gone.tar.gz: the server answered HTTP 404 " in msg
    assert "Without network access" not in msg and "Check the URL" in msg
    assert os.listdir(tmp_path) == ["www"]  # no partial file


def test_a_bad_download_says_to_check_the_url_not_to_delete_it(tiny_server, tmp_path):
    from tools.comfyui_setup import fetch_comfyui
    manifest = tmp_path / "m.sha256"
    manifest.write_text("")
    url = f"{tiny_server}/bad.tar.gz"
    with pytest.raises(fetch_comfyui.FetchError) as e:
        fetch_comfyui.fetch(url, str(tmp_path / "dest"), str(manifest), keep=str(tmp_path / "kept.tar.gz"))
    msg = str(e.value)
    assert msg.startswith(f"what {url} sent is not a readable .tar.gz") and "Check the URL" in msg
    assert "delete it" not in msg
    assert sorted(os.listdir(tmp_path)) == ["m.sha256", "www"]  # nothing kept, nothing half-installed
    with pytest.raises(fetch_comfyui.FetchError) as e:  # a file on disk: deleting it is the advice
        fetch_comfyui.fetch(str(tmp_path / "www" / "bad.tar.gz"), str(tmp_path / "dest"), str(manifest))
    assert "delete it or point at a good copy" in str(e.value)


def fake_venv(tmp_path):
    """A venv ./dev takes as set up (its requirements stamp matches) whose python prints what it was told."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tests", "requirements-test.txt"), venv / ".requirements-test.txt")
    py = venv / "bin" / "python"
    py.write_text('#!/bin/sh\necho "caller=$TILED_ATTENTION_CALLER_CWD mpl=$MPLCONFIGDIR args=$*"\n')
    py.chmod(0o755)
    comfy = tmp_path / "comfy"
    (comfy / "comfy").mkdir(parents=True)
    (comfy / "comfy" / "model_management.py").write_text("")
    return venv, comfy


@pytest.mark.parametrize("cmd,module", [("demo", "tools.demo.demo"), ("bench", "attention_core.bench")])
def test_demo_and_bench_read_relative_paths_from_the_callers_folder(cmd, module, tmp_path):
    """./dev moves into the clone; the demo and the benchmark are told where the user was (their --out-dir,
    --json, ... are relative to it), and matplotlib's files go to the clone's .cache/, not the home folder."""
    venv, comfy = fake_venv(tmp_path)
    here = tmp_path / "my folder"
    here.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "TILED_ATTENTION_CALLER_CWD")}
    env.update(VENV=str(venv), COMFYUI_LATEST_PATH=str(comfy), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([os.path.join(ROOT, "dev"), cmd, "--out-dir", "out"], capture_output=True, text=True,
                         env=env, cwd=here, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (f"caller={here} mpl={os.path.join(ROOT, '.cache', 'matplotlib')} "
                                  f"args=-m {module} --out-dir out")
    # --help (no set-up) is told the same
    env["PYTHON"] = str(venv / "bin" / "python")
    out = subprocess.run([os.path.join(ROOT, "dev"), cmd, "--help"], capture_output=True, text=True, env=env,
                         cwd=here, timeout=60)
    assert out.stdout.startswith(f"caller={here} "), out.stdout
