"""The node schemas (/object_info) the workflow tests validate against: the live answer of a real ComfyUI server of
each test version with this pack installed (tools/comfyui_setup/comfy_server.py), one server start per version per test
session.

When no server can start (no ComfyUI set up), the saved stock /object_info in ../shared/comfyui plus the pack's own
schemas (the pack's V3 classes' GET_NODE_INFO_V1, asked of ComfyUI in a subprocess) stand in, with a warning; under
CI=true that fallback is a failure: CI must test against the live servers.
"""
import json
import os
import subprocess
import sys
import tempfile
import warnings

from tools.comfyui_setup.comfyui import ROOT, SHARED, comfy_path

SHARED_COMFYUI = os.path.join(SHARED, "comfyui")
SAVED = {"0.33.0": os.path.join(SHARED_COMFYUI, "object_info-0.33.0.json"),
         "0.3.75": os.path.join(SHARED_COMFYUI, "object_info-0.3.75.json")}
PACK_FOLDER = "tiled-attention"  # the folder name the server's custom_nodes link uses (and users' git clones)
_CACHE = {}


class SchemaUnavailable(RuntimeError):
    pass


def in_ci():
    return os.environ.get("CI", "").lower() == "true"


def live_object_info(version):
    """/object_info of a real ComfyUI `version` with this pack loaded by ComfyUI's own loader."""
    from tools.comfyui_setup.comfy_server import ComfyServer
    with tempfile.TemporaryDirectory(prefix=f"object-info-{version}-") as base:
        with ComfyServer(base, version=version) as server:
            info = server.get("/object_info")
            log = server.log()
    if "TiledAttentionPatch" not in info:
        raise SchemaUnavailable(f"ComfyUI {version} started without this pack's nodes:\n{log[-3000:]}")
    return info


_PACK_PROBE = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests/support")
from comfy_harness import load_pack
pack = load_pack()
nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
print(json.dumps({n.GET_SCHEMA().node_id: n.GET_NODE_INFO_V1() for n in nodes}, default=str))
"""


def pack_object_info(version):
    """The pack's node schemas as ComfyUI `version` builds them from the V3 classes (a subprocess imports it)."""
    env = dict(os.environ, TILED_ATTENTION_TEST_COMFYUI=version)
    out = subprocess.run([sys.executable, "-c", _PACK_PROBE, ROOT], capture_output=True, text=True, timeout=300,
                         env=env)
    if out.returncode != 0:
        raise SchemaUnavailable(f"the pack's schemas could not be built in ComfyUI {version}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def saved_object_info(version, *, with_pack=True):
    """The saved stock /object_info of `version` (../shared/comfyui), with the pack's schemas added."""
    path = SAVED[version]
    if not os.path.exists(path):
        raise SchemaUnavailable(f"{path} is absent (the project's shared/ folder is expected at ../shared)")
    with open(path, encoding="utf-8") as f:
        info = json.load(f)
    if with_pack:
        info.update(pack_object_info(version))
    return info


def object_info(version):
    """Live /object_info of `version` (cached for the session); the saved fallback when no server can start,
    which fails under CI=true. Returns (object_info, source, pack node types) with source "live" or "saved"."""
    if version in _CACHE:
        return _CACHE[version]
    reason = None
    if comfy_path(version) is None:
        reason = f"ComfyUI {version} is not set up (./dev setup)"
    else:
        try:
            info = live_object_info(version)
            _CACHE[version] = (info, "live", pack_node_types(info))
            return _CACHE[version]
        except Exception as e:  # noqa: BLE001 - any failure to start is reported with the fallback
            reason = f"no ComfyUI {version} server could start: {type(e).__name__}: {str(e)[-1500:]}"
    if in_ci():
        raise SchemaUnavailable(f"{reason} (under CI=true the saved /object_info fallback is a failure)")
    warnings.warn(f"{reason}; validating against the saved /object_info of {version} instead")
    if comfy_path(version) is None:  # the pack's schemas need a ComfyUI too; none: the stock file alone
        raise SchemaUnavailable(reason)
    pack = pack_object_info(version)
    info = saved_object_info(version, with_pack=False)
    info.update(pack)
    _CACHE[version] = (info, "saved", set(pack))
    return _CACHE[version]


def object_info_or_skip(version):
    """object_info(version) for a test: where no schema is to be had, the test skips naming why (comfy_harness.missing)
    and fails under CI=true."""
    import pytest

    from comfy_harness import missing
    try:
        return object_info(version)
    except SchemaUnavailable as e:
        if in_ci():
            pytest.fail(str(e))
        missing(str(e))


def pack_node_types(info):
    """Node types that this pack's folder registered in a live /object_info (python_module names the folder)."""
    return {k for k, v in info.items() if str(v.get("python_module", "")).endswith(PACK_FOLDER)}
