"""Tiled Attention Everywhere end to end, through /prompt of real ComfyUI servers (the stock 0.3.75 and 0.33.0):
the mode switched on at start by TILED_ATTENTION_EVERYWHERE and from the graph by the node, on model code nobody
here wrote, run from the nodes of a test pack the way wrapper packs run it (tools/fixtures/wrapper_pack_standin: a tiny
diffusers WanTransformer3DModel, WanVideoWrapper-style attention in its "sdpa" and "comfy" modes, its sampler under
torch.autocast and its compile option), and the native Wan 2.2 workflow with Patch Attention in the same queue.

Routed / total calls per code path come from the test shim's census line after each prompt (its "everywhere"
entry: the pack's own counters, attention_core.patch.stats()); the stand-ins count their attention calls themselves.
The numbers measured are printed (pytest -s)."""
import json
import os

import pytest
import torch

from comfy_harness import missing
from tools.comfyui_setup.comfy_server import ComfyServer
from tools.comfyui_setup.comfyui import ROOT, VERSIONS, comfy_path
from tools.comfyui_setup.prompt_tools import attention_census, resized, workflow_api

WRITE_WAN = ("import sys; from tools.comfyui_setup.comfyui import import_comfy; import_comfy(sys.argv[2]); "
             "from tools.fixtures.tiny_models import write_wan22_model_set; "
             "write_wan22_model_set(sys.argv[1] + '/models')")


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"comfyui-{v}")
def server(request, tmp_path_factory):
    import subprocess
    import sys
    version = request.param
    if comfy_path(version) is None:
        missing(f"ComfyUI {version} is not set up: run ./dev test")
    base = tmp_path_factory.mktemp(f"everywhere-{version}")
    made = subprocess.run([sys.executable, "-c", WRITE_WAN, str(base), version], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILED_ATTENTION_TEST_CENSUS", "1")
        mp.setenv("TILED_ATTENTION_EVERYWHERE", "online")  # on from the start, default min_tokens (1024)
        mp.delenv("TILED_ATTENTION_TEST_BREAK", raising=False)
        mp.delenv("TILED_ATTENTION", raising=False)
        srv = ComfyServer(base, version=version,
                          extra_custom_nodes=("tiny_model_loaders", "wrapper_pack_standin")).start()
    yield srv
    srv.stop()


def everywhere_of(server, pid):
    return attention_census(server.log())[pid]["everywhere"]


def census_of(server, pid):
    counts = attention_census(server.log())[pid]
    return {kind: {site: sum(n.values()) for site, n in counts.get(kind, {}).items()}
            for kind in ("engine", "comfy")}


def switch(mode, min_tokens=0):
    return {"class_type": "TiledAttentionEverywhere", "inputs": {"mode": mode, "min_tokens": min_tokens}}


def standin_prompt(mode, tag, tokens=64):
    """The switch node, then (through its pass-through) the three stand-in runs."""
    return {
        "1": switch(mode),
        "2": {"class_type": "StandinDiffusersWan", "inputs": {
            "seed": 3, "frames": 2, "height": 8, "width": 8, "dtype": "fp32", "filename_prefix": f"{tag}/diffusers",
            "trigger": ["1", 0]}},
        "3": {"class_type": "StandinWrapperAttention", "inputs": {
            "seed": 4, "tokens": tokens, "attention_mode": "sdpa", "dtype": "bf16", "filename_prefix": f"{tag}/sdpa",
            "trigger": ["1", 0]}},
        "4": {"class_type": "StandinWrapperAttention", "inputs": {
            "seed": 5, "tokens": tokens, "attention_mode": "comfy", "dtype": "fp32",
            "filename_prefix": f"{tag}/comfy", "trigger": ["1", 0]}},
    }


def ui_of(entry, node_id):
    return json.loads(entry["outputs"][node_id]["text"][0])


def saved(entry, node_id):
    from safetensors.torch import load_file
    return load_file(ui_of(entry, node_id)["file"])["out"].double()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def show(server, what, counts):
    print(f"\nComfyUI {server.version}, {what}: {json.dumps(counts)}")


def test_started_on_by_the_environment_variable(server):
    log = server.log()
    line = [ln for ln in log.splitlines() if "[tiled-attention]" in ln and "Tiled Attention Everywhere" in ln]
    assert line and "ON, process-wide (mode online, set by TILED_ATTENTION_EVERYWHERE=online)" in line[0], log[-3000:]
    info = server.get("/object_info")["TiledAttentionEverywhere"]
    assert info["display_name"] == "Tiled Attention Everywhere"
    # as set at start: calls from 1024 tokens on are routed, shorter ones are not
    short = {"1": standin_prompt("off", "x")["3"]}
    short["1"]["inputs"].pop("trigger")
    for tokens, routed in ((512, 0), (1024, 4)):
        short["1"]["inputs"].update(tokens=tokens, filename_prefix=f"start/{tokens}")
        pid, entry = server.queue_prompt(short)
        got = everywhere_of(server, pid)["torch_sdpa"]
        show(server, f"mode set at start (online, min_tokens 1024), stand-in sdpa at {tokens} tokens", got)
        assert ui_of(entry, "1")["attention_calls"] == got["total"] == 4 and got["routed"] == routed, got
        assert sum(census_of(server, pid)["engine"].values()) == routed  # computed by the engine


def test_switch_in_the_graph_routes_every_call_of_packs_with_their_own_model_code(server):
    pid_off, off = server.queue_prompt(standin_prompt("off", "off"))
    assert everywhere_of(server, pid_off) == {}, "mode off: nothing seen, nothing routed"
    assert "Tiled Attention Everywhere: off" in off["outputs"]["1"]["text"][0]
    pid_on, on = server.queue_prompt(standin_prompt("chunked", "on"))
    got = everywhere_of(server, pid_on)
    show(server, "mode chunked from the node: stand-ins (diffusers Wan, sdpa bf16, optimized_attention)", got)
    sdpa_calls = ui_of(on, "2")["attention_calls"] + ui_of(on, "3")["attention_calls"]
    comfy_calls = ui_of(on, "4")["attention_calls"]
    assert sdpa_calls == 8 and comfy_calls == 4
    assert got["torch_sdpa"]["routed"] == got["torch_sdpa"]["total"] == sdpa_calls, got
    assert got["comfy_attention"]["routed"] == got["comfy_attention"]["total"] == comfy_calls, got
    assert sum(census_of(server, pid_on)["engine"].values()) == sdpa_calls + comfy_calls  # by the engine
    assert "mode chunked" in on["outputs"]["1"]["text"][0]
    assert rel(saved(on, "2"), saved(off, "2")) < 1e-5  # fp32: rounding only
    assert rel(saved(on, "4"), saved(off, "4")) < 1e-5
    assert rel(saved(on, "3"), saved(off, "3")) < 2 * torch.finfo(torch.bfloat16).eps  # bf16 attention
    pid, _ = server.queue_prompt({"1": switch("off")})
    pid, again = server.queue_prompt(standin_prompt("off", "off-again"))
    assert everywhere_of(server, pid) == {} and torch.equal(saved(again, "2"), saved(off, "2"))


def sampler_prompt(mode, tag):
    """The switch node, then the stand-in's sampler as WanVideoWrapper runs it with its options set in the graph:
    fp16 base precision under its autocast region with "sdpa"'s bf16 cast (until 2025), bf16 base under autocast
    in the model's dtype with the Lynx-style mask (since), and the same compiled (its compile option: the blocks,
    here with the aot_eager backend)."""
    common = dict(seed=6, tokens=64, attention_mode="sdpa", trigger=["1", 0])
    return {
        "1": switch(mode),
        "2": {"class_type": "StandinWrapperAttention", "inputs": dict(
            common, dtype="bf16", base_precision="fp16", autocast=True, filename_prefix=f"{tag}/fp16-autocast")},
        "3": {"class_type": "StandinWrapperAttention", "inputs": dict(
            common, dtype="none", base_precision="bf16", autocast=True, attn_mask=True,
            filename_prefix=f"{tag}/bf16-autocast-mask")},
        "4": {"class_type": "StandinWrapperAttention", "inputs": dict(
            common, dtype="none", base_precision="bf16", autocast=True, compile="transformer_blocks",
            compile_backend="aot_eager", filename_prefix=f"{tag}/bf16-compiled")},
    }


def test_wrapper_sampler_under_autocast_and_compiled_from_the_graph(server):
    """The stand-in's sampler options through /prompt, mode off then chunked: every eager attention call routed
    and computed by the engine, each returning torch's dtype under the sampler's autocast (fp16 for the bf16-cast
    q, k, v under the fp16 autocast: red on the engine's old rule, which returned bf16), outputs as torch's up to
    half-precision rounding; the compiled blocks run under the mode with the same result, and the pack counts
    their calls as the stand-in does (the count comes from the engine's op, which runs inside the compiled
    graph: red when the pack counted only where Python ran, 8 of 12)."""
    pid_off, off = server.queue_prompt(sampler_prompt("off", "autocast-off"))
    assert everywhere_of(server, pid_off) == {}
    pid_on, on = server.queue_prompt(sampler_prompt("chunked", "autocast-on"))
    got = everywhere_of(server, pid_on)
    show(server, "mode chunked: stand-in sampler under autocast (fp16 + bf16 cast, bf16 + mask, compiled)", got)
    assert ui_of(off, "2")["attention_dtypes"] == ui_of(on, "2")["attention_dtypes"] == ["float16"]
    assert ui_of(off, "3")["attention_dtypes"] == ui_of(on, "3")["attention_dtypes"] == ["bfloat16"]
    assert all(ui_of(on, n)["attention_calls"] == ui_of(off, n)["attention_calls"] == 4 for n in "234")
    calls = sum(ui_of(on, n)["attention_calls"] for n in "234")  # the stand-in's own count, compiled ones too
    # every call counted where the engine's op runs, the compiled blocks' calls included (each compiled call
    # runs tiled_attention::fwd inside the graph): as many as the stand-in made, none passed to torch
    assert got["torch_sdpa"]["routed"] == got["torch_sdpa"]["total"] == calls == 12, got
    assert got["torch_sdpa"]["passed"] == 0, got
    assert sum(census_of(server, pid_on)["engine"].values()) == calls  # computed by the engine
    for n in "234":
        assert rel(saved(on, n), saved(off, n)) < 0.1, n  # half precision through 2 blocks: rounding only
    server.queue_prompt({"1": switch("off")})


def without_pack_nodes(prompt):
    """The prompt with the pack's Patch Attention nodes (MODEL, CLIP, VAE) removed, their consumers wired to their
    inputs."""
    p = json.loads(json.dumps(prompt))
    for nid in [n for n, node in p.items() if node["class_type"] in PATCH_INPUT]:
        source = p.pop(nid)["inputs"][PATCH_INPUT[prompt[nid]["class_type"]]]
        for node in p.values():
            for k, v in node["inputs"].items():
                if isinstance(v, list) and len(v) == 2 and str(v[0]) == nid:
                    node["inputs"][k] = source
    return p


PATCH_INPUT = {"TiledAttentionPatch": "model", "TiledAttentionPatchCLIP": "clip", "TiledAttentionPatchVAE": "vae"}


def wan_prompt(server):
    with open(os.path.join(ROOT, "workflows", "Wan 2.2 5B Text to Video 480p.json")) as f:
        prompt = workflow_api().workflow_to_prompt(json.load(f), server.get("/object_info"))
    return resized(prompt, "wan", size=(64, 64), frames=5, steps=2)


def test_native_wan_in_the_same_queue_keeps_patch_attentions_settings(server):
    server.queue_prompt({"1": switch("chunked", 0)})  # the mode stays on for the next prompts in the queue
    prompt = wan_prompt(server)
    for node in prompt.values():
        if node["class_type"] == "TiledAttentionPatch":  # Patch Attention leaves every DiT call to ComfyUI
            node["inputs"].update(mode="chunked", min_tokens=10 ** 6)
        if node["class_type"] in ("TiledAttentionPatchCLIP", "TiledAttentionPatchVAE"):
            node["inputs"].update(mode="chunked", min_tokens=0)
    pid, _ = server.queue_prompt(prompt)
    got, census = everywhere_of(server, pid), census_of(server, pid)
    show(server, "native Wan 2.2 with Patch Attention (min_tokens 10^6) under mode chunked", got)
    show(server, "  its census (engine / ComfyUI's functions per call site)", census)
    dit = {s: n for s, n in census["comfy"].items() if "WanAttentionBlock" in s}
    assert dit and not any("WanAttentionBlock" in s for s in census["engine"]), census
    assert got["comfy_attention"]["deferred"] == sum(dit.values()) and got["comfy_attention"]["routed"] == 0, got
    # the same workflow without the pack's nodes: the mode takes the DiT and the text encoder
    pid, _ = server.queue_prompt(without_pack_nodes(wan_prompt(server)))
    got = everywhere_of(server, pid)
    show(server, "native Wan 2.2 without Patch Attention under mode chunked", got)
    assert got["comfy_attention"]["routed"] == got["comfy_attention"]["total"] > sum(dit.values()), got
    assert sum(census_of(server, pid)["engine"].values()) == got["comfy_attention"]["routed"]
    server.queue_prompt({"1": switch("off")})
