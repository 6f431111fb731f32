"""The pack inside the real ComfyUI 0.3.75 server: loaded by its own loader, listed in /object_info, and the
bundled Wan 2.2 workflow (converted by nodes/workflow_api.py) queued through /prompt with tiny models of the
real architectures. The same prompt without Patch Attention gives the same frames."""
import importlib.util
import json
import os

import numpy as np
import pytest
from PIL import Image

from comfy_harness import ROOT, require_comfy
from comfy_server import ComfyServer

WAN_T2V = os.path.join(ROOT, "workflows", "wan22_5b_t2v_480p.json")


def workflow_api():
    spec = importlib.util.spec_from_file_location("workflow_api", os.path.join(ROOT, "nodes", "workflow_api.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_comfy()
    from tiny_models import write_wan22_model_set
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
    assert patch["input"]["required"]["mode"][0] == ["auto", "chunked", "online", "inplace", "off"]
    log = server.log()
    ours = [ln for ln in log.splitlines() if "tiled-attention" in ln]
    assert ours and not any("IMPORT FAILED" in ln or "Cannot import" in ln for ln in ours), "\n".join(ours)
    assert "[tiled-attention]" in log  # the startup verdict line


def shrink(prompt, prefix, size=64, frames=5, steps=2):
    """The bundled workflow at test size; tiled attention forced (the CPU has a fused backend)."""
    p = json.loads(json.dumps(prompt))
    for nid, node in list(p.items()):
        ct, inp = node["class_type"], node["inputs"]
        if ct == "Wan22ImageToVideoLatent":
            inp.update(width=size, height=size, length=frames, batch_size=1)
        elif ct in ("KSampler", "KSamplerAdvanced"):
            inp.update(steps=steps)
            if "end_at_step" in inp:
                inp["end_at_step"] = steps
        elif ct == "TiledAttentionPatch":
            inp.update(mode="chunked", min_tokens=0)
        elif ct == "VAEDecodeTiled":
            inp.update(tile_size=128, overlap=32, temporal_size=64, temporal_overlap=8)
        elif ct in ("SaveVideo", "SaveAnimatedWEBP", "SaveWEBM"):
            inp["filename_prefix"] = f"{prefix}/video"
    decoders = [nid for nid, n in p.items() if n["class_type"] in ("VAEDecode", "VAEDecodeTiled")]
    assert decoders, "the workflow decodes its latent"
    p["9001"] = {"class_type": "SaveImage", "inputs": {"images": [decoders[0], 0], "filename_prefix": f"{prefix}/frame"}}
    return p


def without_patch(prompt):
    """The same prompt with every TiledAttentionPatch node removed and its consumers wired to its input."""
    p = json.loads(json.dumps(prompt))
    for nid in [n for n, node in p.items() if node["class_type"] == "TiledAttentionPatch"]:
        source = p.pop(nid)["inputs"]["model"]
        for node in p.values():
            for k, v in node["inputs"].items():
                if isinstance(v, list) and len(v) == 2 and str(v[0]) == nid:
                    node["inputs"][k] = source
    return p


def frames(server, entry):
    out = []
    for node_out in entry["outputs"].values():
        for img in node_out.get("images", []):
            if img["filename"].endswith(".png"):
                path = os.path.join(server.base, "output", img.get("subfolder", ""), img["filename"])
                out.append(np.asarray(Image.open(path), dtype=np.int16))
    return out


def videos(server, entry):
    found = []
    for node_out in entry["outputs"].values():
        for item in node_out.get("images", []) + node_out.get("videos", []) + node_out.get("gifs", []):
            if item["filename"].endswith((".mp4", ".webm", ".webp")):
                found.append(os.path.join(server.base, "output", item.get("subfolder", ""), item["filename"]))
    return found


def test_wan_workflow_end_to_end(server):
    if not os.path.exists(WAN_T2V):
        pytest.skip("workflows/wan22_5b_t2v_480p.json not present")
    api = workflow_api()
    with open(WAN_T2V) as f:
        workflow = json.load(f)
    prompt = api.workflow_to_prompt(workflow, server.get("/object_info"))
    assert any(n["class_type"] == "TiledAttentionPatch" for n in prompt.values())

    patched = server.run_prompt(shrink(prompt, "patched"))
    vids = videos(server, patched)
    assert vids and all(os.path.getsize(v) > 0 for v in vids), patched["outputs"]
    assert "tiled attention running (mode chunked)" in server.log()
    a = frames(server, patched)

    plain = server.run_prompt(shrink(without_patch(prompt), "plain"))
    b = frames(server, plain)
    assert len(a) == len(b) >= 5
    worst = max(int(np.abs(x - y).max()) for x, y in zip(a, b))
    assert worst <= 2, f"frames differ by up to {worst}/255"
