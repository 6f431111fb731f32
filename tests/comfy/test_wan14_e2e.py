"""The two bundled Wan 2.2 14B workflows end to end in both test ComfyUIs, with two tiny experts of the real
architecture (tools/fixtures/tiny_models_wan14.py: ComfyUI's WanModel, the high-noise expert HIGH_LAYERS deep and
the low-noise one LOW_LAYERS, the Wan 2.1 VAE, a tiny UMT5), converted by tools/workflow_api.py and shrunk in size
only (64x64, 5 frames, 4 steps: the high-noise expert samples steps 0-2, the low-noise one 2-4, as the workflows'
0-10 / 10-20 split of 20).

Each workflow runs with the pack off (ComfyUI's own attention, counted), on (mode chunked, min_tokens 0), and on
with the low-noise expert's Patch Attention taken out. With the pack on, every DiT attention call of both experts
ran in the engine, as many as reached ComfyUI's attention without it, and none outside; without the low expert's
patch exactly its share (LOW_LAYERS of HIGH_LAYERS + LOW_LAYERS blocks, at equal steps) reaches ComfyUI's attention
and the high expert's share stays in the engine: each expert's own patch routes it. The sampled latent with the pack
agrees with the one without it within TOL_EPS fp32 epsilon of its largest value.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from comfy_harness import missing
from tools.comfyui_setup.comfyui import VERSIONS, ROOT, comfy_path
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.prompt_tools import attention_census, resized, saved_latents, workflow_api
from tools.fixtures.tiny_models_wan14 import HIGH_LAYERS, LOW_LAYERS

WORKFLOWS = {"Wan 2.2 14B Text to Video 480p": (64, 64), "Wan 2.2 14B Image to Video 480p": (64, 48)}
FRAMES, STEPS, SPLIT = 5, 4, 2
PACK_NODES = ("TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE")
DIT_SITES = ("WanAttentionBlock.self_attn", "WanAttentionBlock.cross_attn")
TOL_EPS = 1000
BOUND = TOL_EPS * torch.finfo(torch.float32).eps
WRITE = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
         "from tools.fixtures.tiny_models_wan14 import write_wan14_model_set; "
         "write_wan14_model_set(sys.argv[1] + '/models')")


@pytest.fixture(scope="module", params=VERSIONS)
def server(request, tmp_path_factory):
    version = request.param
    if comfy_path(version) is None:
        missing(f"no ComfyUI {version} (./dev setup)")
    base = tmp_path_factory.mktemp(f"wan14_{version}")
    made = subprocess.run([sys.executable, "-c", WRITE, str(base), version], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, f"tools/fixtures/tiny_models_wan14.py failed:\n{made.stderr[-3000:]}"
    from PIL import Image
    os.makedirs(base / "input", exist_ok=True)
    Image.new("RGB", (96, 64), (200, 120, 40)).save(base / "input" / "example.png")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        srv = ComfyServer(base, version=version).start()
    srv.runs = {}
    yield srv
    srv.stop()


def expert_patch(prompt, expert):
    """The id of the TiledAttentionPatch whose model comes from the `expert` ("high"/"low") UNETLoader."""
    for nid, node in prompt.items():
        if node["class_type"] == "TiledAttentionPatch":
            loader = prompt[str(node["inputs"]["model"][0])]
            if f"_{expert}_noise_" in loader["inputs"]["unet_name"]:
                return nid
    raise AssertionError(f"no Patch Attention on the {expert}-noise expert")


def run(server, name, variant):
    """variant: "off" (pack nodes off), "on" (chunked, min_tokens 0), "high_only" (on, the low expert unpatched)."""
    key = (name, variant)
    if key not in server.runs:
        with open(os.path.join(ROOT, "workflows", name + ".json"), encoding="utf-8") as f:
            prompt = workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))
        tag = f"{name.replace(' ', '_')}/{variant}"
        p = resized(prompt, tag, size=WORKFLOWS[name], frames=FRAMES, steps=STEPS)
        for node in p.values():
            if node["class_type"] in PACK_NODES:
                node["inputs"]["mode"] = "off" if variant == "off" else "chunked"
                node["inputs"]["min_tokens"] = 0
            if node["class_type"] == "KSamplerAdvanced":  # the 0-10 / 10-20 split of 20 steps, scaled to 4
                if node["inputs"]["add_noise"] == "enable":
                    node["inputs"]["end_at_step"] = SPLIT
                else:
                    node["inputs"]["start_at_step"] = SPLIT
        if variant == "high_only":
            nid = expert_patch(p, "low")
            source = p.pop(nid)["inputs"]["model"]
            for node in p.values():
                for k, v in node["inputs"].items():
                    if isinstance(v, list) and len(v) == 2 and str(v[0]) == nid:
                        node["inputs"][k] = source
        pid, _entry = server.queue_prompt(p)
        census = attention_census(server.log()).get(pid)
        assert census is not None, "no [attention-census] line: is tools/fixtures/tiny_model_loaders loaded?"
        latents = saved_latents(server.base, tag)
        server.runs[key] = {"census": {k: {s: sum(n.values()) for s, n in census.get(k, {}).items()}
                                       for k in ("engine", "comfy", "torch_sdpa")}, "latents": latents}
    return server.runs[key]


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_wan14_both_experts_every_call_through_the_engine(server, name):
    off, on = run(server, name, "off")["census"], run(server, name, "on")["census"]
    print(f"\n{server.version} {name}\n  pack off: {json.dumps(off)}\n  pack on:  {json.dumps(on)}")
    assert off["engine"] == {}, off
    dit = {s: n for s, n in off["comfy"].items() if s in DIT_SITES}
    assert set(dit) == set(DIT_SITES), off
    # equal steps per expert: a block count of HIGH_LAYERS + LOW_LAYERS per step of each
    assert all(n % (HIGH_LAYERS + LOW_LAYERS) == 0 and n > 0 for n in dit.values()), dit
    assert on["comfy"] == {} and on["torch_sdpa"] == {}, on
    for site, calls in dit.items():
        assert on["engine"].get(site) == calls, f"{site}: {calls} without the pack, {on['engine'].get(site)} routed"
    te = sum(n for s, n in on["engine"].items() if "text_encoder_route" in s)
    vae = sum(n for s, n in on["engine"].items() if "vae_route" in s)
    assert te == sum(n for s, n in off["comfy"].items() if s not in DIT_SITES) > 0, (off, on)
    assert vae >= 1, on


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_wan14_each_expert_is_routed_by_its_own_patch(server, name):
    off, half = run(server, name, "off")["census"], run(server, name, "high_only")["census"]
    print(f"\n{server.version} {name}, low expert unpatched: {json.dumps(half)}")
    for site in DIT_SITES:
        total = off["comfy"][site]
        per_block = total // (HIGH_LAYERS + LOW_LAYERS)
        assert half["comfy"].get(site) == per_block * LOW_LAYERS, (site, total, half)
        assert half["engine"].get(site) == per_block * HIGH_LAYERS, (site, total, half)


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_wan14_patched_video_matches_comfy_attention(server, name, record_property):
    a, b = run(server, name, "on")["latents"], run(server, name, "off")["latents"]
    assert len(a) == len(b) == 1 and a[0].shape == b[0].shape, ([x.shape for x in a], [x.shape for x in b])
    w, h = WORKFLOWS[name]
    assert a[0].shape == (1, 16, (FRAMES - 1) // 4 + 1, h // 8, w // 8), a[0].shape
    x, y = a[0].double(), b[0].double()
    dev = float((x - y).abs().max() / y.abs().max())
    record_property("deviation", dev)
    print(f"\n{server.version} {name}: latent deviates by {dev:.3e} of its max "
          f"= {dev / torch.finfo(torch.float32).eps:.1f} fp32 eps (bound {TOL_EPS})")
    assert dev <= BOUND, f"patched latent differs by {dev:.3e} of its max (bound {BOUND:.3e})"
