"""Every attention call of the text encoder and the VAE through the pack, in the real ComfyUI (either test
version): the tiny UMT5 (Wan's text encoder) and the tiny Wan 2.2 VAE loaded by ComfyUI's own loaders, attention
calls counted where ComfyUI's own functions run (tests/support/attention_calls.py) and where the pack's run; a tiny
Gemma 3 text stack and a tiny LTX-2.3 (LTXAV) model built here from ComfyUI's own classes.

Runs under both test ComfyUIs (0.33.0 and 0.3.75); what 0.3.75 lacks skips as "not applicable".
"""
import asyncio

import pytest
import torch

from attention_calls import count_comfy_attention
from tools.comfyui_setup.comfyui import inprocess_version

pytestmark = pytest.mark.comfy_inprocess  # run again against 0.3.75 by test_inprocess_on_oldest.py


@pytest.fixture(scope="module")
def counts(pack):
    with count_comfy_attention() as c:  # models are built inside: the VAE picks its function at build time
        yield c


@pytest.fixture(scope="module")
def node(pack):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    by_id = {n.GET_SCHEMA().node_id: n for n in nodes}
    return lambda node_id, *args: by_id[node_id].execute(*args)[0]


@pytest.fixture(scope="module")
def clip(tmp_path_factory, counts):
    import comfy.sd
    import tools.fixtures.tiny_model_loaders  # noqa: F401 - the test-only loader shim: the tiny sizes reach the loader
    from tools.fixtures.tiny_models import write_umt5
    path = write_umt5(str(tmp_path_factory.mktemp("te") / "umt5_tiny.safetensors"))
    c = comfy.sd.load_clip(ckpt_paths=[path], clip_type=comfy.sd.CLIPType.WAN)
    assert type(c.cond_stage_model).__name__ == "WanTEModel"
    return c


@pytest.fixture(scope="module")
def vae(tmp_path_factory, counts):
    import comfy.sd
    import comfy.utils
    import tools.fixtures.tiny_model_loaders  # noqa: F401
    from tools.fixtures.tiny_models import write_wan22_vae
    path = write_wan22_vae(str(tmp_path_factory.mktemp("vae") / "wan22_vae_tiny.safetensors"))
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(path))


def stats_of(patcher):
    routes = [p for p in patcher.object_patches.values() if hasattr(p, "inner")]
    assert routes, "no pack route among the object patches"
    s = routes[0].settings
    return s.stats


def encode(clip, text="a cat sitting on a mat"):
    return clip.encode_from_tokens_scheduled(clip.tokenize(text))[0][0]


def test_text_encoder_every_call_through_the_pack_and_gone_after(clip, node, counts):
    counts.reset()
    ref = encode(clip)
    before = counts.total
    assert before == 2, counts.by_function  # 2 UMT5 layers, one self-attention each
    patched = node("TiledAttentionPatchCLIP", clip, "chunked", 0, "keep", 0)
    counts.reset()
    out = encode(patched)
    stats = stats_of(patched.patcher)
    assert counts.total == 0, counts.by_function
    assert stats == {"engine": 2, "passthrough": 0}
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    # the CLIP that went in is untouched, and the patch is gone when it runs again
    assert not any(hasattr(p, "inner") for p in clip.patcher.object_patches.values())
    counts.reset()
    again = encode(clip)
    assert counts.total == before and stats == {"engine": 2, "passthrough": 0}
    assert torch.equal(again, ref)


def test_text_encoder_min_tokens_and_off_pass_to_comfy(clip, node, counts):
    patched = node("TiledAttentionPatchCLIP", clip, "chunked", 0, "keep", 10 ** 6)
    counts.reset()
    encode(patched)
    assert counts.total == 2 and stats_of(patched.patcher) == {"engine": 0, "passthrough": 2}
    off = node("TiledAttentionPatchCLIP", patched, "off", 0, "keep", 0)
    assert not any(hasattr(p, "inner") for p in off.patcher.object_patches.values())
    counts.reset()
    encode(off)
    assert counts.total == 2


def test_text_encoder_later_node_wins(clip, node):
    first = node("TiledAttentionPatchCLIP", clip, "online", 0, "keep", 10 ** 6)
    second = node("TiledAttentionPatchCLIP", first, "chunked", 0, "keep", 0)
    for key, route in second.patcher.object_patches.items():
        if hasattr(route, "inner"):
            assert not hasattr(route.inner, "inner"), f"{key}: a route wrapped in a route"
    encode(second)
    assert stats_of(second.patcher)["engine"] == 2 and stats_of(first.patcher)["engine"] == 0


def decode(vae, latent):
    with torch.no_grad():
        return vae.decode(latent)


def test_vae_every_call_through_the_pack_and_gone_after(vae, node, counts):
    latent = torch.randn(1, 48, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    counts.reset()
    ref = decode(vae, latent)
    before = counts.total
    assert before >= 2, counts.by_function  # the decoder's middle attention block, per latent frame
    patched = node("TiledAttentionPatchVAE", vae, "chunked", 0, "keep", 0)
    assert patched is not vae and patched.patcher is not vae.patcher
    counts.reset()
    out = decode(patched, latent)
    stats = stats_of(patched.patcher)
    assert counts.total == 0, counts.by_function
    assert stats["engine"] == before and stats["passthrough"] == 0
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    assert not vae.patcher.object_patches
    counts.reset()
    again = decode(vae, latent)
    assert counts.total == before and stats["engine"] == before
    assert torch.equal(again, ref)


def test_vae_min_tokens_and_off_after_chunked_give_comfys_attention_back(vae, node, counts):
    """Patch Attention (VAE) with min_tokens above the VAE's tokens passes every call to ComfyUI; the same node with
    mode off after a chunked one removes the routes (ComfyUI's attention, the same frames bit for bit), while the
    chunked copy it was given keeps routing."""
    latent = torch.randn(1, 48, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    counts.reset()
    ref = decode(vae, latent)
    before = counts.total
    passing = node("TiledAttentionPatchVAE", vae, "chunked", 0, "keep", 10 ** 6)
    counts.reset()
    assert torch.equal(decode(passing, latent), ref)
    assert counts.total == before and stats_of(passing.patcher) == {"engine": 0, "passthrough": before}
    chunked = node("TiledAttentionPatchVAE", vae, "chunked", 0, "keep", 0)
    off = node("TiledAttentionPatchVAE", chunked, "off", 0, "keep", 0)
    assert off is not chunked and off.patcher is not chunked.patcher
    assert not any(hasattr(p, "inner") for p in off.patcher.object_patches.values()), off.patcher.object_patches
    assert any(hasattr(p, "inner") for p in chunked.patcher.object_patches.values())
    counts.reset()
    assert torch.equal(decode(off, latent), ref)
    assert counts.total == before, counts.by_function  # every call is ComfyUI's again
    counts.reset()
    decode(chunked, latent)
    assert counts.total == 0 and stats_of(chunked.patcher)["engine"] == before


def test_vae_route_matches_comfy_attention_on_its_shapes(vae, node):
    """The block-level function on [B, C, T, H, W]-style inputs (the decode above may saturate)."""
    patched = node("TiledAttentionPatchVAE", vae, "online", 0, "keep", 0)
    key = next(k for k, p in patched.patcher.object_patches.items() if hasattr(p, "inner"))
    route = patched.patcher.object_patches[key]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 16, 5, 7, generator=g) for _ in range(3))
    ref = route.inner(q, k, v)
    out = route(q, k, v)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()


def test_registered_backend_changes_no_default(pack, counts):
    import comfy.ldm.modules.attention as attention
    assert asyncio.run(pack.comfy_entrypoint()) is not None  # a second load: registration is idempotent
    tiled = attention.get_attention_function("tiled")
    comfy_own = {n for n in dir(attention) if n.startswith("attention_") and n != "attention_tiled"}
    # ComfyUI's selection is still its own (names: the counting fixture wraps the functions, keeping names)
    for fn in (attention.optimized_attention, attention.optimized_attention_masked,
               attention.optimized_attention_for_device(torch.device("cpu"), small_input=True),
               attention.optimized_attention_for_device(torch.device("cpu"), mask=True)):
        assert fn is not tiled and fn.__name__ in comfy_own, fn.__name__
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 33, 4 * 8, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(2, 33, 4, 8).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).reshape(2, 33, 32)
    counts.reset()
    engine_before = tiled.settings.stats["engine"]
    out = tiled(q, k, v, 4)
    assert counts.total == 0 and tiled.settings.stats["engine"] == engine_before + 1
    assert torch.allclose(out, ref, atol=1e-5)


def shell_clip(model):
    """A CLIP object around `model` as CLIP.clone() builds one (own ModelPatcher), for text stacks built here."""
    import comfy.model_patcher
    import comfy.sd
    c = comfy.sd.CLIP(no_init=True)
    c.patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                                 offload_device=torch.device("cpu"))
    c.cond_stage_model, c.tokenizer, c.layer_idx = model, None, None
    c.tokenizer_options, c.use_clip_schedule, c.apply_hooks_to_conds = {}, False, None
    return c


def randomize(module, seed, std):
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=g) * std


def test_gemma3_text_stack_routed(node, counts):
    """LTX-2.3's text encoder is Gemma 3 12B (0.3.75 has Gemma 3 4B: the same Llama2_ stack): grouped-query
    attention, padding mask, sliding-window layers, [B, H, N, D] calls."""
    import comfy.model_management as mm
    import comfy.ops
    import comfy.text_encoders.llama as llama
    config_class = getattr(llama, "Gemma3_12B_Config", None) or llama.Gemma3_4B_Config
    cfg = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    cfg.head_dim, cfg.sliding_attention = 8, [4, False]
    stack = llama.Llama2_(cfg, device="cpu", dtype=torch.float32, ops=comfy.ops.manual_cast)
    randomize(stack, 0, 0.2)
    clip = shell_clip(stack)
    g = torch.Generator().manual_seed(1)
    ids, mask = torch.randint(0, 64, (1, 12), generator=g), torch.ones(1, 12)
    if inprocess_version() == "0.3.75":
        # 0.3.75 masks with -inf: a left-padded row sees no key and ComfyUI's attention_basic turns it into NaN,
        # which then reaches every row through the next layer's values (the engine returns 0 there, as torch's
        # SDPA does); right padding keeps every row attending to something
        mask[:, -3:] = 0
    else:
        mask[:, :3] = 0  # left padding, as LTX-2.3's Gemma tokenizer pads (masked with finfo.min / 4)

    def run(c):
        mm.load_models_gpu([c.patcher])
        with torch.no_grad():
            return c.patcher.model(ids, attention_mask=mask)[0]
    counts.reset()
    ref = run(clip)
    assert counts.total == 2, counts.by_function
    patched = node("TiledAttentionPatchCLIP", clip, "chunked", 0, "keep", 0)
    counts.reset()
    out = run(patched)
    assert counts.total == 0 and stats_of(patched.patcher) == {"engine": 2, "passthrough": 0}, counts.by_function
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), (out - ref).abs().max()
    counts.reset()
    assert torch.equal(run(clip), ref) and counts.total == 2


def test_ltx23_text_connectors_routed(node, counts):
    """The LTX-2.3 video and audio text connectors run in LTXAV.extra_conds (while the sampler builds the
    conditioning), outside transformer_options: Patch Attention on the MODEL routes them too."""
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models as sm
    if not hasattr(sm, "LTXAV"):
        pytest.skip(f"not applicable: ComfyUI {inprocess_version()} has no LTX-2 (no text connectors)")
    cfg = {"image_model": "ltxav", "num_layers": 1, "attention_head_dim": 8, "num_attention_heads": 2,
           "audio_attention_head_dim": 8, "audio_num_attention_heads": 2, "cross_attention_dim": 16,
           "audio_cross_attention_dim": 16, "caption_channels": 16, "connector_attention_head_dim": 8,
           "connector_num_attention_heads": 2, "in_channels": 128, "audio_in_channels": 128}
    model_config = sm.LTXAV(cfg)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({})
    randomize(model, 2, 0.1)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"),
                                               offload_device=torch.device("cpu"))
    context = torch.randn(1, 20, 16, generator=torch.Generator().manual_seed(3))  # unprocessed Gemma features

    def conditioning(m):
        mm.load_models_gpu([m])
        with torch.no_grad():
            return m.model.extra_conds(cross_attn=context, device=torch.device("cpu"))["c_crossattn"].cond
    counts.reset()
    ref = conditioning(patcher)
    assert counts.total == 4, counts.by_function  # 2 connectors x 2 blocks
    patched = node("TiledAttentionPatch", patcher, "chunked", 0, "keep", 0)
    counts.reset()
    out = conditioning(patched)
    stats = patched.model_options["transformer_options"]["optimized_attention_override"]._tiled_attention.stats
    assert counts.total == 0 and stats == {"engine": 4, "passthrough": 0}, counts.by_function
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out - ref).abs().max()
    off = node("TiledAttentionPatch", patched, "off", 0, "keep", 0)
    assert not any(hasattr(p, "inner") for p in off.object_patches.values())
    counts.reset()
    assert torch.equal(conditioning(patcher), ref) and counts.total == 4
