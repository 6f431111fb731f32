"""The two bundled Z-Image Turbo workflows end to end in both test ComfyUIs (0.3.75 and 0.33.0 both have Z-Image:
supported_models.ZImage, comfy/text_encoders/z_image.py): converted by tools/workflow_api.py, shrunk in size only
(64x64, 2 steps), queued through /prompt with tiny random-weight files of the real architectures under the names
the workflows load (tools/fixtures/tiny_models_zimage.py: ComfyUI's own NextDiT, Qwen3_4B and Flux VAE classes at
reduced width and depth).

Each workflow runs three times: with every pack node off (ComfyUI's own attention, the census counts where each
call went), with the pack on (mode chunked, min_tokens 0), and with the pack on and its engine broken on purpose.
With the pack on, the census (tools/fixtures/tiny_model_loaders/attention_census.py) shows every attention call of
the DiT (the refiners' and main layers' JointAttention) and of the Qwen 3 text encoder computed by the engine, as
many as reached ComfyUI's attention without it, and none left outside; the Flux VAE's mid-block attention is
routed too. The sampled latent with the pack agrees with the one without it within TOL_EPS fp32 epsilon of its
largest value (torch's own spread between two exact attention algorithms; measured: printed), and the broken
engine misses that bound by orders of magnitude.
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

WORKFLOWS = {"Z-Image Turbo Image 1024x1024": (64, 64), "Z-Image Turbo Image 1536x1536": (80, 64)}
STEPS = 2
PACK_NODES = ("TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE")
TOL_EPS = 1000
BOUND = TOL_EPS * torch.finfo(torch.float32).eps
DIT_SITES = ("JointTransformerBlock.attention",)  # the refiners' and the main layers' attention modules
WRITE = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
         "from tools.fixtures.tiny_models_zimage import write_zimage_model_set; "
         "write_zimage_model_set(sys.argv[1] + '/models')")


def with_pack(prompt, mode):
    for node in prompt.values():
        if node["class_type"] in PACK_NODES:
            node["inputs"]["mode"], node["inputs"]["min_tokens"] = mode, 0
    return prompt


@pytest.fixture(scope="module", params=VERSIONS)
def server(request, tmp_path_factory):
    version = request.param
    if comfy_path(version) is None:
        missing(f"no ComfyUI {version} (./dev setup)")
    base = tmp_path_factory.mktemp(f"zimage_{version}")
    made = subprocess.run([sys.executable, "-c", WRITE, str(base), version], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, f"tools/fixtures/tiny_models_zimage.py failed:\n{made.stderr[-3000:]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        srv = ComfyServer(base, version=version).start()
    srv.runs = {}
    yield srv
    srv.stop()


def run(server, name, variant):
    """variant: "off" (pack nodes off), "on" (chunked, min_tokens 0) or "uniform" (on, engine broken)."""
    key = (name, variant)
    if key not in server.runs:
        with open(os.path.join(ROOT, "workflows", name + ".json"), encoding="utf-8") as f:
            prompt = workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))
        tag = f"{name.replace(' ', '_')}/{variant}"
        p = with_pack(resized(prompt, tag, size=WORKFLOWS[name], steps=STEPS), "off" if variant == "off" else
                      "chunked")
        if variant == "uniform":  # its own budget: ComfyUI's cache must not hand back the good run's samples
            for node in p.values():
                if node["class_type"] == "TiledAttentionPatch":
                    node["inputs"]["memory_budget_mb"] = 4096
        pid, _entry = server.queue_prompt(p, None if variant in ("off", "on")
                                          else {"tiled_attention_test_break": variant})
        census = attention_census(server.log()).get(pid)
        assert census is not None, "no [attention-census] line: is tools/fixtures/tiny_model_loaders loaded?"
        (latent,) = saved_latents(server.base, tag)
        server.runs[key] = {"census": {k: {s: sum(n.values()) for s, n in census.get(k, {}).items()}
                                       for k in ("engine", "comfy", "torch_sdpa")}, "latent": latent}
    return server.runs[key]


def deviation(a, b):
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_zimage_every_attention_call_of_dit_and_text_encoder_through_the_engine(server, name):
    off, on = run(server, name, "off")["census"], run(server, name, "on")["census"]
    print(f"\n{server.version} {name}\n  pack off: {json.dumps(off)}\n  pack on:  {json.dumps(on)}")
    assert off["engine"] == {}, off
    dit = {s: n for s, n in off["comfy"].items() if s in DIT_SITES}
    text = {s: n for s, n in off["comfy"].items() if s not in DIT_SITES}
    assert dit and sum(dit.values()) > 0, f"no DiT attention reached ComfyUI's attention without the pack: {off}"
    assert text and all("attn" in s for s in text), f"the Qwen 3 encoder's attention not seen: {off}"
    # with the pack: nothing reaches ComfyUI's attention or torch's SDPA, and the engine ran exactly those calls
    assert on["comfy"] == {} and on["torch_sdpa"] == {}, on
    for site, calls in dit.items():
        assert on["engine"].get(site) == calls, f"{site}: {calls} calls without the pack, {on['engine'].get(site)} " \
                                                f"in the engine with it"
    # the encoder's and the VAE's routes are plain functions: their engine calls count under the route's file
    te = sum(n for s, n in on["engine"].items() if "text_encoder_route" in s)
    vae = sum(n for s, n in on["engine"].items() if "vae_route" in s)
    assert te == sum(text.values()), f"{sum(text.values())} text encoder calls without the pack, {te} routed: {on}"
    assert vae >= 1, f"the Flux VAE's mid-block attention did not run in the engine: {on['engine']}"
    assert sum(on["engine"].values()) == sum(dit.values()) + te + vae, on["engine"]


@pytest.mark.parametrize("name", list(WORKFLOWS))
def test_zimage_patched_image_matches_comfy_attention(server, name, record_property):
    a, b = run(server, name, "on")["latent"], run(server, name, "off")["latent"]
    assert a.shape == b.shape == (1, 16, WORKFLOWS[name][1] // 8, WORKFLOWS[name][0] // 8), (a.shape, b.shape)
    dev = deviation(a, b)
    record_property("deviation", dev)
    print(f"\n{server.version} {name}: sampled latent deviates by {dev:.3e} of its max "
          f"= {dev / torch.finfo(torch.float32).eps:.1f} fp32 eps (bound {TOL_EPS})")
    assert dev <= BOUND, f"patched latent differs by {dev:.3e} of its max (bound {BOUND:.3e})"


def test_zimage_comparison_notices_a_broken_engine(server):
    name = "Z-Image Turbo Image 1024x1024"
    broken, plain = run(server, name, "uniform"), run(server, name, "off")
    assert sum(broken["census"]["engine"].values()) > 0
    dev = deviation(broken["latent"], plain["latent"])
    print(f"\n{server.version} broken engine: deviation {dev:.3e} (bound {BOUND:.3e})")
    assert dev > 100 * BOUND, f"engine broken yet the latent is within {dev:.3e} of the reference"
