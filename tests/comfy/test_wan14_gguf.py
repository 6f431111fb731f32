"""Patch Attention on a GGUF-loaded Wan 2.2 14B expert, as the 14B workflows' notes tell users to swap it in: city96's
ComfyUI-GGUF itself (its UnetLoaderGGUF, GGMLOps and GGUFModelPatcher; not a stand-in) in the custom_nodes of a real
ComfyUI 0.33.0, the high-noise expert written as a Q8_0 GGUF file of the tiny architecture
(tools/fixtures/tiny_models_wan14.write_gguf_expert), the bundled text-to-video workflow with that expert's
*Load Diffusion Model* replaced by *Unet Loader (GGUF)* feeding the same Patch Attention.

With the pack on (mode chunked, min_tokens 0) every DiT attention call of both experts ran in the engine, as many as
reached ComfyUI's attention with the pack off, none outside; the sampled latent agrees with the unpatched one within
TOL_EPS fp32 epsilon of its largest value.

Needs ComfyUI-GGUF (TILED_ATTENTION_GGUF_PACK, or a clone at .cache/ComfyUI-GGUF:
`git clone https://github.com/city96/ComfyUI-GGUF .cache/ComfyUI-GGUF`) and the `gguf` package
(tests/requirements-test.txt pins it).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from comfy_harness import missing
from tools.comfyui_setup.comfyui import LATEST, ROOT, comfy_path
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.prompt_tools import attention_census, resized, saved_latents, workflow_api
from tools.fixtures.tiny_models_wan14 import HIGH_LAYERS, LOW_LAYERS

NAME = "Wan 2.2 14B Text to Video 480p"
GGUF_FILE = "wan2.2_t2v_high_noise_14B_Q8_0.gguf"
SITES = ("WanAttentionBlock.self_attn", "WanAttentionBlock.cross_attn")
BOUND = 1000 * torch.finfo(torch.float32).eps
WRITE = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
         "from tools.fixtures.tiny_models_wan14 import write_wan14_model_set, write_gguf_expert; "
         "write_wan14_model_set(sys.argv[1] + '/models', tasks=('t2v',)); "
         f"write_gguf_expert(sys.argv[1] + '/models/unet/{GGUF_FILE}')")


def gguf_pack():
    path = os.environ.get("TILED_ATTENTION_GGUF_PACK") or os.path.join(ROOT, ".cache", "ComfyUI-GGUF")
    if not os.path.isfile(os.path.join(path, "loader.py")):
        missing(f"ComfyUI-GGUF not found at {path}: git clone https://github.com/city96/ComfyUI-GGUF {path} "
                "(or set TILED_ATTENTION_GGUF_PACK)")
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing("the gguf package is absent (tests/requirements-test.txt pins it)")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pack = gguf_pack()
    if comfy_path(LATEST) is None:
        missing(f"no ComfyUI {LATEST} (./dev setup)")
    base = tmp_path_factory.mktemp("wan14_gguf")
    made = subprocess.run([sys.executable, "-c", WRITE, str(base), LATEST], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    os.makedirs(base / "custom_nodes", exist_ok=True)
    os.symlink(os.path.abspath(pack), base / "custom_nodes" / "ComfyUI-GGUF")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        srv = ComfyServer(base, version=LATEST).start()
    yield srv
    srv.stop()


def run(server, mode):
    info = server.get("/object_info")
    assert "UnetLoaderGGUF" in info, "ComfyUI-GGUF did not load:\n" + server.log()[-3000:]
    with open(os.path.join(ROOT, "workflows", NAME + ".json"), encoding="utf-8") as f:
        prompt = workflow_api().workflow_to_prompt(json.load(f), info)
    tag = f"gguf/{mode}"
    p = resized(prompt, tag, size=(64, 64), frames=5, steps=4)
    swapped = 0
    for node in p.values():
        if node["class_type"] in ("TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE"):
            node["inputs"].update(mode=mode, min_tokens=0)
        elif node["class_type"] == "KSamplerAdvanced":
            node["inputs"]["end_at_step" if node["inputs"]["add_noise"] == "enable" else "start_at_step"] = 2
        elif node["class_type"] == "UNETLoader" and "_high_noise_" in node["inputs"]["unet_name"]:
            node["class_type"], node["inputs"] = "UnetLoaderGGUF", {"unet_name": GGUF_FILE}
            swapped += 1
    assert swapped == 1
    pid, _entry = server.queue_prompt(p)
    census = attention_census(server.log()).get(pid)
    return ({k: {s: sum(n.values()) for s, n in census.get(k, {}).items()} for k in ("engine", "comfy", "torch_sdpa")},
            saved_latents(server.base, tag))


def test_patch_attention_on_a_gguf_loaded_expert(server):
    off, plain = run(server, "off")
    on, patched = run(server, "chunked")
    log = server.log()
    assert "gguf qtypes: F32" in log and "Q8_0" in log, "the expert was not loaded from the GGUF file"
    print(f"\npack off: {json.dumps(off)}\npack on:  {json.dumps(on)}")
    for site in SITES:  # the GGUF high expert and the safetensors low expert, 2 steps each
        assert off["comfy"][site] % (HIGH_LAYERS + LOW_LAYERS) == 0 and off["comfy"][site] > 0, off
        assert on["engine"].get(site) == off["comfy"][site], (site, off, on)
    assert on["comfy"] == {} and on["torch_sdpa"] == {}, on
    a, b = patched[0].double(), plain[0].double()
    dev = float((a - b).abs().max() / b.abs().max())
    print(f"GGUF expert: latent deviates by {dev:.3e} of its max = {dev / torch.finfo(torch.float32).eps:.1f} fp32 eps")
    assert dev <= BOUND, dev
