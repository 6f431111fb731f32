"""The nodes inside a real ComfyUI (0.33.0 in-process; 0.3.75 through tests/comfy/test_inprocess_on_oldest.py): real
loaders, real Wan 2.2 5B / LTX-Video classes, real sampler; the nodes as ComfyUI's V3 loader gets them
(comfy_entrypoint)."""
import asyncio
import copy

import pytest
import torch

from comfy_harness import comfy_nodes, load_tiny, require_comfy
from tools.fixtures.tiny_models import write_ltxv, write_wan22_5b

pytestmark = pytest.mark.comfy_inprocess


def node_classes(pack):
    """{node id: class} as ComfyUI's loader builds it from the pack's comfy_entrypoint."""
    extension = asyncio.run(pack.comfy_entrypoint())
    return {cls.GET_SCHEMA().node_id: cls for cls in asyncio.run(extension.get_node_list())}


def run_node(pack, node_id, *args):
    return node_classes(pack)[node_id].execute(*args)


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan22_tiny.safetensors", "WAN22_T2V")


@pytest.fixture(scope="module")
def ltxv(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_ltxv, "ltxv_tiny.safetensors", "LTXV")


def patch_node(pack, model, mode="chunked", budget=0, half="keep", min_tokens=0):
    return run_node(pack, "TiledAttentionPatch", model, mode, budget, half, min_tokens)[0]


def settings_of(model):
    fn = model.model_options["transformer_options"]["optimized_attention_override"]
    return fn._tiled_attention


def sample(model, latent, cond, seed=0, steps=2, cfg=3.0):
    nodes = comfy_nodes()
    positive = [[cond[0], dict(cond[1])]]
    negative = [[torch.zeros_like(cond[0]), dict(cond[1])]]
    return nodes.KSampler().sample(model, seed, steps, cfg, "euler", "simple", positive, negative,
                                   {"samples": latent})[0]["samples"]


def wan_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 48, 3, 16, 16, generator=g), (torch.randn(1, 12, 4096, generator=g), {})


def ltxv_inputs():
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[:, 7:] = 0  # padded text tokens: LTX turns this into an additive (B, 1, 1, Nk) mask
    return torch.randn(1, 128, 2, 4, 4, generator=g), (torch.randn(1, 10, 4096, generator=g),
                                                      {"attention_mask": mask})


def test_nodes_registered_with_old_ids_inputs_and_tooltips(pack):
    classes = node_classes(pack)
    assert {"TiledAttentionPatch", "TiledFFNChunking", "TiledAttentionInfo"} <= set(classes)
    assert set(classes) == {"TiledAttentionPatch", "TiledAttentionPatchCLIP", "TiledAttentionPatchVAE",
                            "TiledFFNChunking", "TiledAttentionInfo", "TiledAttentionFit", "TiledAttentionEverywhere"}
    old_inputs = {"TiledAttentionPatch": ["model", "mode", "memory_budget_mb", "half_precision", "min_tokens"],
                  "TiledFFNChunking": ["model", "chunks", "enabled"], "TiledAttentionInfo": []}
    for node_id, cls in classes.items():
        info = cls.GET_NODE_INFO_V1()
        assert info["category"] == "model_patches/attention" and info["description"]
        if node_id in old_inputs:
            assert info["input_order"].get("required", []) == old_inputs[node_id]
        for name, spec in info["input"].get("required", {}).items():
            assert spec[1].get("tooltip"), f"{node_id}.{name} has no tooltip"
    patch = classes["TiledAttentionPatch"].GET_NODE_INFO_V1()["input"]["required"]
    def options(spec):  # V3 combos: ("COMBO", {"options": [...]}); V1: ([...], {})
        return spec[0] if isinstance(spec[0], list) else spec[1]["options"]
    assert options(patch["mode"]) == ["auto", "chunked", "online", "inplace", "off"]
    assert options(patch["half_precision"]) == ["keep", "bf16_to_fp16", "fp32"]
    assert patch["min_tokens"][1]["default"] == 1024


def test_modes_and_precisions_follow_the_engine(pack):
    """The node's modes are the engine's tiers plus off; its half_precision values map to the engine's names
    (the node's keep is the engine's auto, not the engine's input dtype)."""
    from tiled_attention_pack.attention_core import TIER_CHOICES
    from tiled_attention_pack.attention_core.kernel.numerics import choose_numerics
    adapter = pack.nodes.comfy_adapter
    assert set(adapter.MODES) == set(TIER_CHOICES) | {"off"}
    assert adapter._PRECISION == {"keep": "auto", "bf16_to_fp16": "fp16", "fp32": "fp32"}
    for engine_name in adapter._PRECISION.values():
        choose_numerics(torch.bfloat16, torch.device("cpu"), engine_name)  # a name the engine knows


def test_nodes_pin_a_stable_comfy_api(pack):
    """Every comfy_api import of the nodes names one versioned API, never `latest`."""
    import ast
    import glob
    import os
    imports = set()
    for path in glob.glob(os.path.join(os.path.dirname(pack.nodes.__file__), "*.py")):
        for n in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("comfy_api"):
                imports.add(n.module)
            elif isinstance(n, ast.Import):
                imports.update(a.name for a in n.names if a.name.startswith("comfy_api"))
    assert imports == {"comfy_api.v0_0_2"}, imports
    import comfy_api.v0_0_2
    assert pack.nodes.api.io is comfy_api.v0_0_2.io


@pytest.mark.parametrize("mode", ["chunked", "online", "inplace", "auto"])
def test_wan_sampler_matches_and_every_call_site_uses_engine(pack, wan, mode, monkeypatch):
    if mode == "auto":
        monkeypatch.setenv("TILED_ATTENTION", "force")  # the CPU has a fused backend; force the verdict
    latent, cond = wan_inputs()
    ref = sample(wan, latent, cond)
    patched = patch_node(pack, wan, mode)
    out = sample(patched, latent, cond)
    stats = settings_of(patched).stats
    # 2 steps x cond+uncond batched x 2 blocks x (self + cross attention)
    assert stats["engine"] >= 2 * 2 * 2 and stats["passthrough"] == 0
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    before = dict(stats)
    sample(wan, latent, cond)  # the same loaded model without the node
    assert stats == before
    assert "optimized_attention_override" not in wan.model_options["transformer_options"]


def test_ltxv_with_text_mask_matches(pack, ltxv):
    latent, cond = ltxv_inputs()
    ref = sample(ltxv, latent, cond)
    patched = patch_node(pack, ltxv, "online")
    out = sample(patched, latent, cond)
    stats = settings_of(patched).stats
    assert stats["engine"] >= 2 * 2 * 2 and stats["passthrough"] == 0  # attn1 + masked attn2, 2 blocks
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()


def test_devices_split_heads_and_match(pack, wan):
    """devices: the heads of each call split over several devices (two CPU "devices" here: the same code path,
    threads and copies, as two GPUs)."""
    latent, cond = wan_inputs()
    ref = sample(wan, latent, cond, steps=1)
    patched = run_node(pack, "TiledAttentionPatch", wan, "chunked", 0, "keep", 0, "cpu, cpu")[0]
    assert settings_of(patched).devices == (torch.device("cpu"), torch.device("cpu"))
    import tiled_attention_pack.attention_core.multidevice as md
    calls = []
    real = md.plan_head_split

    def counted(*a, **k):
        groups = real(*a, **k)
        calls.append(len(groups))
        return groups
    md.plan_head_split = counted
    try:
        out = sample(patched, latent, cond, steps=1)
    finally:
        md.plan_head_split = real
    assert calls and all(n == 2 for n in calls)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    with pytest.raises(ValueError, match="devices"):
        run_node(pack, "TiledAttentionPatch", wan, "chunked", 0, "keep", 0, "cpu, nodevice:x")


def test_min_tokens_and_auto_pass_through(pack, wan, monkeypatch):
    monkeypatch.setenv("TILED_ATTENTION", "off")
    latent, cond = wan_inputs()
    patched = patch_node(pack, wan, "auto")
    sample(patched, latent, cond, steps=1)
    assert settings_of(patched).stats["engine"] == 0 and settings_of(patched).stats["passthrough"] > 0
    patched = patch_node(pack, wan, "chunked", min_tokens=10 ** 6)
    sample(patched, latent, cond, steps=1)
    assert settings_of(patched).stats["engine"] == 0


def test_chain_keeps_options_and_later_node_wins(pack, wan):
    other = wan.clone()
    marker = []

    def foreign(func, *args, **kwargs):
        marker.append(1)
        return func(*args, **kwargs)
    other.model_options["transformer_options"]["optimized_attention_override"] = foreign
    other.model_options["transformer_options"]["my_option"] = 42
    first = patch_node(pack, other, "online", min_tokens=10 ** 6)  # passes everything through
    second = patch_node(pack, first, "chunked")
    to = second.model_options["transformer_options"]
    assert to["my_option"] == 42
    assert settings_of(second).mode == "chunked"
    latent, cond = wan_inputs()
    sample(first, latent, cond, steps=1)
    assert marker, "a pass-through goes to the override that was there before"
    off = patch_node(pack, second, "off")
    assert off.model_options["transformer_options"]["optimized_attention_override"] is foreign
    assert settings_of(first).mode == "online"  # the earlier clone is untouched


def test_override_called_as_newest_comfyui_calls_it(pack):
    """Keyword heads/mask, scale, enable_gqa, low_precision_attention, preferred_attention, containers."""
    from tiled_attention_pack.nodes.comfy_adapter import PatchSettings, make_override

    class Container:  # AttentionTensorContainer's interface
        def __init__(self, t):
            self.t = t

        def take(self):
            t, self.t = self.t, None
            return t
    fn = make_override(PatchSettings(mode="chunked"))
    assert not hasattr(fn, "container_function")
    torch.manual_seed(3)
    b, n, m, h, d = 2, 9, 7, 4, 8
    q, k, v = torch.randn(b, n, h * d), torch.randn(b, m, 2 * d), torch.randn(b, m, 2 * d)
    mask = torch.zeros(b, 1, 1, m)
    mask[..., -2:] = -torch.finfo(torch.float32).max
    out = fn(None, Container(q), Container(k), Container(v), heads=h, mask=mask, scale=0.3, enable_gqa=True,
             low_precision_attention=False, preferred_attention=object(), transformer_options={},
             _inside_attn_wrapper=True)
    qh = q.view(b, n, h, d).transpose(1, 2)
    kh = k.view(b, m, 2, d).transpose(1, 2)
    vh = v.view(b, m, 2, d).transpose(1, 2)
    ref = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, mask, scale=0.3, enable_gqa=True)
    assert out.shape == (b, n, h * d) and out.is_contiguous()
    assert torch.allclose(out, ref.transpose(1, 2).reshape(b, n, h * d), atol=1e-5)
    # [B, H, N, D] in and out, positional heads and 2-D bool mask
    bm = torch.rand(n, m) > 0.3
    out4 = fn(None, qh, kh.repeat_interleave(2, 1), vh.repeat_interleave(2, 1), h, bm, None, True, True)
    ref4 = torch.nn.functional.scaled_dot_product_attention(qh, kh.repeat_interleave(2, 1),
                                                            vh.repeat_interleave(2, 1), bm)
    assert torch.allclose(out4, ref4, atol=1e-5)


def test_override_as_comfy_wrap_attn_calls_it(pack):
    """Through ComfyUI's own wrapper: optimized_attention(..., transformer_options={override})."""
    from comfy.ldm.modules import attention
    settings = pack.nodes.comfy_adapter.PatchSettings(mode="online")
    fn = pack.nodes.comfy_adapter.make_override(settings)
    q = torch.randn(1, 20, 64)
    out = attention.optimized_attention(q, q, q, 2, transformer_options={"optimized_attention_override": fn})
    ref = attention.optimized_attention(q, q, q, 2)
    assert settings.stats["engine"] == 1 and torch.allclose(out, ref, atol=1e-5)


def test_clone_deepcopy_keeps_one_override(pack, wan):
    patched = patch_node(pack, wan, "chunked")
    clone = patched.clone()
    assert settings_of(clone) is settings_of(patched)
    assert copy.deepcopy(patched.model_options)["transformer_options"]["optimized_attention_override"]


def test_memory_error_names_node_and_settings(pack, wan, monkeypatch):
    import tiled_attention_pack.attention_core.kernel.memory as mem
    monkeypatch.setattr(mem, "bytes_per_score", lambda *a, **k: 1 << 40)  # nothing fits
    patched = patch_node(pack, wan, "online", budget=64)
    latent, cond = wan_inputs()
    with pytest.raises(MemoryError) as e:
        sample(patched, latent, cond, steps=1)
    msg = str(e.value)
    assert "Patch Attention (tiled)" in msg and "memory_budget_mb=64" in msg and "heads" in msg


def test_ffn_chunking_exact_restored_and_lora_applies(pack, wan, tmp_path):
    import comfy.model_management
    import comfy.sd
    from tiled_attention_pack.attention_core.ffn import ChunkedFFN
    keys = set(wan.model.state_dict())
    latent, cond = wan_inputs()
    ref = sample(wan, latent, cond, steps=1)
    chunked = run_node(pack, "TiledFFNChunking", wan, 4, True)[0]
    patches = [k for k in chunked.object_patches if k.endswith(".ffn.forward")]
    assert len(patches) == 2
    out = sample(chunked, latent, cond, steps=1)
    assert torch.allclose(out, ref, atol=1e-5)
    wrappers = [chunked.object_patches[k] for k in patches]
    assert all(w.verified and w.calls_chunked > 0 for w in wrappers)
    assert set(chunked.model.state_dict()) == keys
    comfy.model_management.unload_all_models()
    for i in range(2):
        assert not isinstance(wan.model.diffusion_model.blocks[i].ffn.forward, ChunkedFFN)
    # a LoRA on the FFN weights, applied after the node, changes the output exactly as without the node
    g = torch.Generator().manual_seed(5)
    lora = {}
    for i in range(2):
        w = wan.model.diffusion_model.blocks[i].ffn[0].weight
        lora[f"diffusion_model.blocks.{i}.ffn.0.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g)
        lora[f"diffusion_model.blocks.{i}.ffn.0.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g)
    with_lora, _ = comfy.sd.load_lora_for_models(wan, None, lora, 1.0, 0)
    chunked_lora, _ = comfy.sd.load_lora_for_models(chunked, None, lora, 1.0, 0)
    a = sample(with_lora, latent, cond, steps=1)
    b = sample(chunked_lora, latent, cond, steps=1)
    assert not torch.allclose(a, ref, atol=1e-3)
    assert torch.allclose(a, b, atol=1e-5)


def test_ffn_chunking_follows_a_multigpu_deep_clone(pack, wan):
    """ComfyUI's multi-GPU clone loads a fresh model and copies the object patches as they are; each ChunkedFFN
    on the clone must wrap the clone's own module, not the original model's (on the first GPU)."""
    import comfy.model_patcher
    if not hasattr(comfy.model_patcher.ModelPatcher, "deepclone_multigpu"):
        pytest.skip("not applicable: this ComfyUI has no multi-GPU deep clones")
    latent, cond = wan_inputs()
    chunked = run_node(pack, "TiledFFNChunking", wan, 4, True)[0]
    ref = sample(chunked, latent, cond, steps=1)
    clone = chunked.deepclone_multigpu(new_load_device=torch.device("cpu"))
    assert clone.model is not chunked.model
    keys = [k for k in clone.object_patches if k.endswith(".ffn.forward")]
    assert len(keys) == 2
    for key in keys:
        wrapper = clone.object_patches[key]
        assert wrapper.forward.__self__ is clone.model.get_submodule(key[:-len(".forward")]), key
        assert chunked.object_patches[key].forward.__self__ is chunked.model.get_submodule(key[:-len(".forward")])
    out = sample(clone, latent, cond, steps=1)
    assert torch.allclose(out, ref, atol=1e-5)
    assert all(clone.object_patches[k].calls_chunked > 0 for k in keys)


def test_ffn_chunking_finds_ltx_ff(pack, ltxv):
    m = run_node(pack, "TiledFFNChunking", ltxv, 0, True)[0]
    assert sorted(k for k in m.object_patches) == [f"diffusion_model.transformer_blocks.{i}.ff.forward"
                                                  for i in range(2)]
    assert run_node(pack, "TiledFFNChunking", ltxv, 0, False)[0].object_patches == {}


def test_info_node_reports(pack):
    out = run_node(pack, "TiledAttentionInfo")
    text = out[0]
    assert out.ui == {"text": [text]}
    assert "needs tiled attention" in text and "ComfyUI's own attention: attention_" in text
    import tomllib  # the first line names the pack and its version, pyproject.toml's (what a bug report needs)

    from tools.comfyui_setup.comfyui import ROOT
    with open(f"{ROOT}/pyproject.toml", "rb") as f:
        assert text.splitlines()[0] == f"tiled-attention {tomllib.load(f)['project']['version']}"
