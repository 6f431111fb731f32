"""The pack installed the way users install it: through ComfyUI-Manager, in the stock ComfyUI 0.33.0.

One server (0.33.0 with the Manager version its manager_requirements.txt pins, legacy UI on, a temporary
--base-directory whose custom_nodes starts empty) goes through a user's whole round trip:

1. the Manager's "Install via Git URL" (POST /v2/customnode/install/git_url, the URL as the body) clones a
   local bare clone of this repository's HEAD, file://localhost/<tmp>/tiled-attention.git; the folder it
   creates is named after the URL's last part, as it would be for the GitHub URL;
2. the Manager's Restart (POST /v2/manager/reboot, which re-executes ComfyUI in place): the pack's startup
   line, its three nodes in /object_info, its six workflows in /api/workflow_templates (each with its card
   picture served beside it), no import failure;
3. the Manager's Uninstall (the legacy UI's queue: POST /v2/manager/queue/batch {"uninstall": [...]}, then
   the worker runs it): the folder is gone; a fresh start has none of the pack's nodes or templates and no
   import error.

torch, torchvision and torchaudio (`pip freeze`) are the same before and after: the pack's requirements.txt
must never make the Manager's pip touch them. The Manager's config.ini (<base>/user/__manager/config.ini) is
written first: network_mode = offline (no channel lists fetched from the internet), allow_git_url_install =
True (its dedicated switch for git-URL installs, honoured with a loopback --listen), pip rather than uv.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from importlib.metadata import PackageNotFoundError, version

import pytest

from comfy_harness import missing
from tools.comfyui_setup.comfyui import LATEST, ROOT, comfy_path
from tools.comfyui_setup.comfy_server import ComfyServer

FOLDER = "tiled-attention"  # the folder name the Manager derives from .../tiled-attention.git
PACK_NODES = ("TiledAttentionPatch", "TiledFFNChunking", "TiledAttentionInfo")
TORCH_PACKAGES = ("torch", "torchvision", "torchaudio")
MANAGER_CONFIG = """[default]
network_mode = offline
security_level = normal
allow_git_url_install = True
use_uv = False
file_logging = False
"""
STEP_TIMEOUT = 120  # seconds for any one Manager step (clone, queue, restart)


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          timeout=60).stdout.strip()


def _pinned_manager(comfy):
    """The comfyui_manager requirement line of that ComfyUI (manager_requirements.txt), e.g. 'comfyui_manager==4.2.2'."""
    path = os.path.join(comfy, "manager_requirements.txt")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lines = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    return next((ln for ln in lines if ln.lower().replace("-", "_").startswith("comfyui_manager")), None)


def _torch_freeze():
    """The torch, torchvision and torchaudio lines of `pip freeze` in the servers' python."""
    out = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    return sorted(ln for ln in out.splitlines()
                  if ln.split("==")[0].split(" @ ")[0].strip().lower() in TORCH_PACKAGES)


def _committed_workflows():
    names = _git("ls-tree", "--name-only", "HEAD", "workflows/").splitlines()
    return sorted(os.path.basename(n)[:-5] for n in names if n.endswith(".json"))


def _request(srv, path, body=None, content_type="application/json", timeout=STEP_TIMEOUT):
    """POST to the server (no body when body is None); returns (status, text), also for HTTP errors."""
    data = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": content_type} if data is not None else {}
    req = urllib.request.Request(srv.url + path, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _manager_reboot(srv):
    """The Manager's Restart: it re-executes ComfyUI in the same process (os.execv), so the request gets no
    answer; returns the log offset where the new run starts."""
    mark = os.path.getsize(srv.log_path)
    try:
        status, text = _request(srv, "/v2/manager/reboot", timeout=30)
        raise AssertionError(f"/v2/manager/reboot answered {status} instead of restarting: {text[:500]}")
    except (urllib.error.URLError, ConnectionError, OSError):
        pass  # the connection dies with the old server: the restart is under way
    time.sleep(1.0)
    srv.wait_until_up(STEP_TIMEOUT)
    return mark


def _log_since(srv, mark):
    with open(srv.log_path, "rb") as f:
        f.seek(mark)
        return f.read().decode(errors="replace")


def _import_problems(log):
    return [ln for ln in log.splitlines() if "IMPORT FAILED" in ln or "Cannot import" in ln
            or "Traceback" in ln]


@pytest.fixture(scope="module")
def bed(tmp_path_factory):
    """The 0.33.0 server with the Manager and an empty custom_nodes, and a bare clone of this repository's HEAD."""
    comfy = comfy_path(LATEST)
    if comfy is None:
        missing(f"no ComfyUI {LATEST}: run the suite with ./dev test (it sets up the stock ComfyUIs)")
    pin = _pinned_manager(comfy)
    if pin is None:
        missing(f"ComfyUI at {comfy} has no manager_requirements.txt pinning comfyui_manager")
    try:
        have = version("comfyui_manager")
    except PackageNotFoundError:
        have = None
    if "==" in pin and have != pin.split("==", 1)[1].strip():
        missing(f"ComfyUI-Manager {pin} is not installed in {sys.executable} (found {have}): pip install {pin}")
    if shutil.which("git") is None:
        missing("git is not on PATH (ComfyUI-Manager clones with it)")
    if not os.path.isdir(os.path.join(ROOT, ".git")) and not os.path.isfile(os.path.join(ROOT, ".git")):
        missing(f"{ROOT} is not a git checkout: the Manager installs from a clone of its HEAD")

    tmp = tmp_path_factory.mktemp("manager")
    repo = tmp / "remote" / f"{FOLDER}.git"
    _git("clone", "--quiet", "--bare", ROOT, str(repo))
    head = _git("rev-parse", "HEAD")
    assert _git("rev-parse", "HEAD", cwd=str(repo)) == head
    base = tmp / "base"
    (base / "user" / "__manager").mkdir(parents=True)
    (base / "user" / "__manager" / "config.ini").write_text(MANAGER_CONFIG)
    srv = ComfyServer(base, version=LATEST, extra_custom_nodes=(), pack_dir=None,
                      args=["--enable-manager", "--enable-manager-legacy-ui"])
    assert os.listdir(base / "custom_nodes") == []
    freeze = _torch_freeze()
    assert len(freeze) == 3, f"want torch, torchvision, torchaudio in pip freeze, got {freeze}"
    srv.start(timeout=STEP_TIMEOUT)
    try:
        yield dict(srv=srv, url=f"file://localhost{repo}", head=head, freeze=freeze,
                   custom=str(base / "custom_nodes"))
    finally:
        srv.stop()


def test_install_restart_uninstall_through_the_manager(bed):
    srv, custom = bed["srv"], bed["custom"]
    t0 = time.time()
    assert "[ComfyUI-Manager] network_mode: offline" in srv.log(), srv.log()[-3000:]
    info = srv.get("/object_info")
    assert not set(PACK_NODES) & set(info), "pack nodes present before the install"

    # 1. Install via Git URL
    status, text = _request(srv, "/v2/customnode/install/git_url", bed["url"], content_type="text/plain")
    assert status == 200, f"git-URL install answered {status} {text}\n{srv.log()[-3000:]}"
    folder = os.path.join(custom, FOLDER)
    assert os.path.isdir(folder) and not os.path.islink(folder), os.listdir(custom)
    assert _git("rev-parse", "HEAD", cwd=folder) == bed["head"]
    installed = srv.get("/v2/customnode/installed")
    assert installed.get(FOLDER, {}).get("enabled") is True, installed

    # 2. the Manager's Restart: the pack loads from the folder the Manager cloned
    mark = _manager_reboot(srv)
    log = _log_since(srv, mark)
    verdict = [ln for ln in log.splitlines() if "[tiled-attention]" in ln]
    assert verdict, f"no [tiled-attention] startup line after the restart:\n{log[-3000:]}"
    assert any(ln.strip().endswith(os.path.join("custom_nodes", FOLDER)) and "IMPORT FAILED" not in ln
               for ln in log.splitlines()), f"{FOLDER} not in the import times:\n{log[-3000:]}"
    assert not _import_problems(log), "\n".join(_import_problems(log))
    info = srv.get("/object_info")
    for name in PACK_NODES:
        assert name in info, f"{name} missing from /object_info after the Manager install"
        assert info[name]["python_module"] == f"custom_nodes.{FOLDER}", info[name]["python_module"]
    templates = srv.get("/api/workflow_templates")
    assert sorted(templates.get(FOLDER, [])) == _committed_workflows(), templates.get(FOLDER)
    for name in templates[FOLDER]:  # with the picture the Templates browser fetches for each card
        url = f"{srv.url}/api/workflow_templates/{FOLDER}/{urllib.parse.quote(name)}.jpg"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.headers.get_content_type() == "image/jpeg", f"{name}: {r.headers.get_content_type()}"
    assert _torch_freeze() == bed["freeze"], "the Manager's install changed torch"

    # 3. Uninstall, as the legacy UI queues it for a pack it knows only by its URL (version 'unknown': the
    #    folder name is the last part of the pack's first file URL)
    item = {"id": FOLDER, "version": "unknown", "files": [bed["url"][:-len(".git")]], "ui_id": FOLDER,
            "channel": "local", "mode": "local", "selected_version": None, "skip_post_install": False}
    status, text = _request(srv, "/v2/manager/queue/batch", json.dumps({"uninstall": [item]}))
    assert status == 200 and json.loads(text) == {"failed": []}, f"{status} {text}"
    deadline = time.time() + STEP_TIMEOUT
    while srv.get("/v2/manager/queue/status")["is_processing"]:
        assert time.time() < deadline, f"the Manager's queue did not finish:\n{srv.log()[-3000:]}"
        time.sleep(0.5)
    assert not os.path.exists(folder), f"{folder} still there after the uninstall:\n{srv.log()[-3000:]}"
    assert FOLDER not in srv.get("/v2/customnode/installed")

    # a clean start: none of the pack, no import error
    srv.restart(timeout=STEP_TIMEOUT)
    log = srv.run_log()
    assert "[tiled-attention]" not in log and not _import_problems(log), log[-3000:]
    info = srv.get("/object_info")
    assert not set(PACK_NODES) & set(info), "pack nodes still served after the uninstall"
    assert FOLDER not in srv.get("/api/workflow_templates")
    assert _torch_freeze() == bed["freeze"], "torch changed during the Manager round trip"
    print(f"\nManager install, restart, uninstall, clean start: {time.time() - t0:.1f}s")
