"""A later node that replaces Patch Attention's override, through /prompt of real ComfyUI servers: the stock 0.33.0 with
its core ModelAttentionBackend node and the stock 0.3.75 (which has none) with another pack's override writer, the
test-only stand-in for KJNodes' Patch Sage Attention (tools/fixtures/sage_override_standin: it writes
`optimized_attention_override` exactly as that node does). A tiny Wan 2.2 5B is sampled in two stages
(KSamplerAdvanced 0-1, 1-2: two sampler calls of one model in one prompt).

After Patch Attention the other node wins and the server log says so once per prompt, naming it; before it, and with two
Patch Attention nodes, nothing is said (the pack's override is in force; the chain rule is an info line); Attention Info
shows the latest notice with its prompt id."""
import os
import subprocess
import sys

import pytest

from comfy_harness import missing
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.comfyui import LATEST, OLDEST, ROOT, comfy_path

WRITE_WAN = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
             "from tools.fixtures.tiny_models import write_wan22_model_set; "
             "write_wan22_model_set(sys.argv[1] + '/models')")
WARNING = "is not in force while this model samples"
STANDIN = "sage_override_standin"  # the stand-in's custom node folder: how the notice names the pack


@pytest.fixture(scope="module", params=[LATEST, OLDEST], ids=lambda v: f"comfyui-{v}")
def server(request, tmp_path_factory):
    version = request.param
    if comfy_path(version) is None:
        missing(f"ComfyUI {version} is not set up: run ./dev test")
    base = tmp_path_factory.mktemp(f"override-{version}")
    made = subprocess.run([sys.executable, "-c", WRITE_WAN, str(base), version], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        for name in ("TILED_ATTENTION_EVERYWHERE", "TILED_ATTENTION", "TILED_ATTENTION_TEST_BREAK"):
            mp.delenv(name, raising=False)
        srv = ComfyServer(base, version=version, extra_custom_nodes=("tiny_model_loaders", STANDIN)).start()
    yield srv
    srv.stop()


def writer(server):
    """The node that writes the override after (or before) Patch Attention: core ModelAttentionBackend where the
    server has it (0.33.0), else the stand-in for KJNodes' Patch Sage Attention (0.3.75)."""
    if server.version == LATEST:
        return {"class_type": "ModelAttentionBackend", "inputs": {"attention": "pytorch attention"}}
    return {"class_type": "StandinPatchSageAttentionKJ", "inputs": {"sage_attention": "auto"}}


def patch_attention(mode="chunked"):
    return {"class_type": "TiledAttentionPatch", "inputs": {"mode": mode, "memory_budget_mb": 0,
                                                           "half_precision": "keep", "min_tokens": 0}}


def two_stage_prompt(chain, seed, tag):
    """UNETLoader -> the `chain` of MODEL nodes -> two KSamplerAdvanced stages on that model -> SaveLatent."""
    p = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                                     "type": "wan", "device": "default"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox in the snow", "clip": ["2", 0]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["2", 0]}},
        "5": {"class_type": "VAELoader", "inputs": {"vae_name": "wan2.2_vae.safetensors"}},
        "6": {"class_type": "Wan22ImageToVideoLatent", "inputs": {"vae": ["5", 0], "width": 64, "height": 64,
                                                                  "length": 1, "batch_size": 1}},
    }
    model = ["1", 0]
    for i, n in enumerate(chain):
        nid = str(10 + i)
        p[nid] = {"class_type": n["class_type"], "inputs": dict(n["inputs"], model=model)}
        model = [nid, 0]
    stage = dict(model=model, noise_seed=seed, steps=2, cfg=3.0, sampler_name="euler", scheduler="simple",
                 positive=["3", 0], negative=["4", 0])
    p["20"] = {"class_type": "KSamplerAdvanced", "inputs": dict(stage, add_noise="enable", latent_image=["6", 0],
                                                                start_at_step=0, end_at_step=1,
                                                                return_with_leftover_noise="enable")}
    p["21"] = {"class_type": "KSamplerAdvanced", "inputs": dict(stage, add_noise="disable", latent_image=["20", 0],
                                                                start_at_step=1, end_at_step=2,
                                                                return_with_leftover_noise="disable")}
    p["30"] = {"class_type": "SaveLatent", "inputs": {"samples": ["21", 0], "filename_prefix": tag}}
    return p


def run(server, prompt):
    """Queue `prompt`; returns (prompt id, the log lines it wrote)."""
    start = len(server.log())
    pid, _ = server.queue_prompt(prompt)
    return pid, server.log()[start:].splitlines()


def warnings_in(lines):
    return [ln for ln in lines if "[tiled-attention]" in ln and WARNING in ln]


def attention_info(server):
    _, entry = server.queue_prompt({"1": {"class_type": "TiledAttentionInfo", "inputs": {}}})
    return entry["outputs"]["1"]["text"][0]


def test_a_later_override_writer_is_named_once_per_prompt(server):
    w = writer(server)
    pid, lines = run(server, two_stage_prompt([patch_attention(), w], seed=1, tag="after/a"))
    warned = warnings_in(lines)
    assert len(warned) == 1, "\n".join(lines[-40:])  # two sampler stages, one notice
    if server.version == LATEST:
        assert "ModelAttentionBackend (ComfyUI core), backend 'pytorch' (attention_pytorch" in warned[0]
    else:
        assert f"custom node '{STANDIN}'" in warned[0] and "attention_override_sage" in warned[0]
    assert "Patch Attention (tiled) #10 (mode chunked) is not in force" in warned[0]  # the node, by its id in the graph
    info = attention_info(server)
    assert f"latest notice (prompt {pid}" in info and WARNING in info

    pid2, lines = run(server, two_stage_prompt([patch_attention(), w], seed=2, tag="after/b"))
    assert len(warnings_in(lines)) == 1  # the next prompt says it again
    assert f"latest notice (prompt {pid2}" in attention_info(server)


SAGE = {"class_type": "StandinPatchSageAttentionKJ", "inputs": {"sage_attention": "auto"}}


def sage_calls(server, latent_prompt=None):
    """The stand-in's kernel calls so far (its StandinSageCalls output node)."""
    p = latent_prompt or {"2": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64,
                                                                             "batch_size": 1}}}
    p = dict(p, **{"99": {"class_type": "StandinSageCalls", "inputs": {"latent": ["2", 0]}}})
    return int(server.queue_prompt(p)[1]["outputs"]["99"]["text"][0])


def test_another_packs_override_after_patch_attention_on_both_versions(server):
    """The stand-in for KJNodes' node in both servers: named by its custom node folder, and it did compute the
    attention (its kernel's call count grew)."""
    before = sage_calls(server)
    p = two_stage_prompt([patch_attention(), SAGE], seed=3, tag="sage/a")
    p["31"] = {"class_type": "StandinSageCalls", "inputs": {"latent": ["21", 0]}}
    pid, lines = run(server, p)
    warned = warnings_in(lines)
    assert len(warned) == 1 and f"custom node '{STANDIN}'" in warned[0], "\n".join(lines[-40:])
    assert "PathchSageAttentionKJStandin.patch.<locals>.attention_override_sage" in warned[0]
    after = int(server.get(f"/history/{pid}")[pid]["outputs"]["31"]["text"][0])
    assert after > before


def test_patch_attention_after_the_writer_wins_silently(server):
    _, lines = run(server, two_stage_prompt([writer(server), patch_attention()], seed=4, tag="before"))
    assert warnings_in(lines) == []
    assert any("tiled attention running (mode chunked)" in ln for ln in lines)


def test_two_patch_attention_nodes_the_later_wins_quietly(server):
    _, lines = run(server, two_stage_prompt([patch_attention("online"), patch_attention("chunked")], seed=5,
                                            tag="two"))
    assert warnings_in(lines) == []
    assert any("replaces the attention override of an earlier Patch Attention (tiled) (mode online)" in ln
               for ln in lines)
    assert any("tiled attention running (mode chunked)" in ln for ln in lines)
