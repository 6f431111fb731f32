"""Every attention call of a bundled workflow through the pack, counted in a real server: the tiny LTX-2.3
text-to-video workflow in ComfyUI 0.33.0 (Gemma 3, the text connectors, the DiT; the LTX video VAE has no attention)
and the tiny Wan 2.2 workflow in the in-process test version (UMT5, the DiT, the VAE), each run with all of the
pack's nodes off and then on (mode chunked, min_tokens 0). The test shim's census
(tools/fixtures/tiny_model_loaders/attention_census.py) counts calls that reached ComfyUI's own attention functions or
torch's SDPA and calls the engine computed; outputs with the pack agree with the run without it."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from comfy_harness import missing
from tools.comfyui_setup.comfyui import LATEST, ROOT, comfy_path, inprocess_version
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.prompt_tools import attention_census, output_files, resized, with_final_latents, workflow_api

PACK_NODES = ("TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE")


def with_pack(prompt, mode):
    for node in prompt.values():
        if node["class_type"] in PACK_NODES:
            node["inputs"]["mode"], node["inputs"]["min_tokens"] = mode, 0
    return prompt


def prompt_of(server, name):
    with open(os.path.join(ROOT, "workflows", name + ".json")) as f:
        return workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))


def census_of(server):
    counts = list(attention_census(server.log()).values())[-1]
    return {kind: {site: sum(n.values()) for site, n in counts.get(kind, {}).items()}
            for kind in ("engine", "comfy", "torch_sdpa")}


def start(tmp_path_factory, version, write):
    if comfy_path(version) is None:
        missing(f"no ComfyUI {version} (./dev setup)")
    base = tmp_path_factory.mktemp(f"routing_{version}")
    made = subprocess.run([sys.executable, "-c", write, str(base), version], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        return ComfyServer(base, version=version).start()


WRITE_LTX = ("import sys; from tools.fixtures.tiny_models_ltx23 import main; "
             "main(['tiny_models_ltx23', sys.argv[1] + '/models', sys.argv[1] + '/input'])")
WRITE_WAN = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
             "from tools.fixtures.tiny_models import write_wan22_model_set; "
             "write_wan22_model_set(sys.argv[1] + '/models')")


@pytest.fixture(scope="module")
def ltx_server(tmp_path_factory):
    if not os.path.exists(os.path.join(ROOT, "tools", "fixtures", "tiny_models_ltx23.py")):
        missing("tools/fixtures/tiny_models_ltx23.py (the tiny LTX-2.3 writers) is absent")
    server = start(tmp_path_factory, LATEST, WRITE_LTX)
    yield server
    server.stop()


def test_ltx23_every_attention_call_through_the_pack(ltx_server):
    name = "LTX-2.3 Text to Video 720p"
    prompt = prompt_of(ltx_server, name)
    runs = {}
    for mode in ("off", "chunked"):
        p = resized(prompt, f"{name}/{mode}", size=(128, 96), frames=9, steps=2, mode=mode, min_tokens=0)
        entry = ltx_server.run_prompt(with_final_latents(with_pack(p, mode), f"{name}/{mode}"))
        from safetensors.torch import load_file
        latents = {os.path.basename(f).split("_")[0]: load_file(f)["latent_tensor"]
                   for f in output_files(ltx_server.base, entry, (".latent",))}
        runs[mode] = (census_of(ltx_server), latents)
    before, after = runs["off"][0], runs["chunked"][0]
    print(f"\nLTX-2.3 t2v, pack off: {json.dumps(before)}\nLTX-2.3 t2v, pack on: {json.dumps(after)}")
    assert before["engine"] == {}
    reached = sum(before["comfy"].values()) + sum(before["torch_sdpa"].values())
    assert any("Gemma" in s for s in before["comfy"]) and "BasicTransformerBlock1D.attn1" in before["comfy"]
    assert after["comfy"] == {} and after["torch_sdpa"] == {}, after
    assert sum(after["engine"].values()) == reached, (before, after)
    for part in ("video", "audio"):
        a, b = runs["chunked"][1][part].double(), runs["off"][1][part].double()
        dev = float((a - b).abs().max() / b.abs().max())
        assert dev <= 1000 * torch.finfo(torch.float32).eps, f"{part} latents deviate by {dev:.3e} of their max"


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory):
    server = start(tmp_path_factory, inprocess_version(), WRITE_WAN)
    yield server
    server.stop()


def test_wan_every_attention_call_through_the_pack(wan_server):
    from PIL import Image
    prompt = prompt_of(wan_server, "Wan 2.2 5B Text to Video 480p")
    runs = {}
    for mode in ("off", "chunked"):
        p = resized(prompt, f"wan/{mode}", size=(64, 64), frames=5, steps=2, mode=mode, min_tokens=0)
        entry = wan_server.run_prompt(with_pack(p, mode))
        frames = [np.asarray(Image.open(f), dtype=np.int16) for f in output_files(wan_server.base, entry, (".png",))]
        runs[mode] = (census_of(wan_server), frames)
    before, after = runs["off"][0], runs["chunked"][0]
    print(f"\nWan 2.2 t2v, pack off: {json.dumps(before)}\nWan 2.2 t2v, pack on: {json.dumps(after)}")
    assert before["engine"] == {} and any("T5" in s for s in before["comfy"])
    assert after["comfy"] == {} and after["torch_sdpa"] == {}, after
    # the census sees ComfyUI's wrapped functions only; the VAE's are plain functions: the VAE's engine calls add
    vae = sum(n for s, n in after["engine"].items() if "vae_route" in s)
    assert vae >= 2 and sum(after["engine"].values()) - vae == sum(before["comfy"].values())
    a, b = runs["chunked"][1], runs["off"][1]
    assert len(a) == len(b) >= 5 and max(int(np.abs(x - y).max()) for x, y in zip(a, b)) <= 2
