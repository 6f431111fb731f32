"""The pack inside the real ComfyUI 0.3.75 server: loaded by its own loader, listed in /object_info, and the
bundled Wan 2.2 workflow (converted by tools/workflow_api.py) queued through /prompt with tiny models of the
real architectures. The same prompt without Patch Attention gives the same frames."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from comfy_harness import require_comfy
from tools.comfyui import ROOT
from tools.comfy_server import ComfyServer
from tools.prompt_tools import output_files, resized, without_patch, workflow_api

WAN_T2V = os.path.join(ROOT, "workflows", "wan22_5b_t2v_480p.json")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_comfy()
    from tools.tiny_models import write_wan22_model_set
    base = tmp_path_factory.mktemp("comfy")
    write_wan22_model_set(str(base / "models"))
    srv = ComfyServer(base)
    srv.start()
    yield srv
    srv.stop()


def test_pack_loads_through_comfyui_loader(server):
    info = server.get("/object_info")
    for name in ("TiledAttentionPatch", "TiledFFNChunking", "TiledAttentionInfo"):
        assert name in info, name
    patch = info["TiledAttentionPatch"]
    assert patch["display_name"] == "Patch Attention (tiled)"
    mode = patch["input"]["required"]["mode"]  # V3 nodes: ["COMBO", {"options": [...]}]
    assert (mode[1].get("options") if mode[0] == "COMBO" else mode[0]) == ["auto", "chunked", "online", "inplace",
                                                                           "off"]
    log = server.log()
    ours = [ln for ln in log.splitlines() if "tiled-attention" in ln]
    assert ours and not any("IMPORT FAILED" in ln or "Cannot import" in ln for ln in ours), "\n".join(ours)
    assert "[tiled-attention]" in log  # the startup verdict line


def frames(server, entry):
    return [np.asarray(Image.open(f), dtype=np.int16) for f in output_files(server.base, entry, (".png",))]


def test_wan_workflow_end_to_end(server):
    if not os.path.exists(WAN_T2V):
        pytest.skip("workflows/wan22_5b_t2v_480p.json not present")
    api = workflow_api()
    with open(WAN_T2V) as f:
        workflow = json.load(f)
    prompt = api.workflow_to_prompt(workflow, server.get("/object_info"))
    assert any(n["class_type"] == "TiledAttentionPatch" for n in prompt.values())

    small = dict(size=(64, 64), frames=5, steps=2, min_tokens=0)
    patched = server.run_prompt(resized(prompt, "patched", mode="chunked", **small))
    vids = output_files(server.base, patched, (".mp4", ".webm", ".webp"))
    assert vids and all(os.path.getsize(v) > 0 for v in vids), patched["outputs"]
    assert "tiled attention running (mode chunked)" in server.log()
    a = frames(server, patched)

    plain = server.run_prompt(resized(without_patch(prompt), "plain", **small))
    b = frames(server, plain)
    assert len(a) == len(b) >= 5
    worst = max(int(np.abs(x - y).max()) for x, y in zip(a, b))
    assert worst <= 2, f"frames differ by up to {worst}/255"
