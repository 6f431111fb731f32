"""This pack's object patches in ComfyUI clones that own a different model (real ComfyUI, tiny Wan 2.2 5B through
ComfyUI's loader): `clone(force_deepcopy=True)` (core Train LoRA), `clone(disable_dynamic=True)` of a dynamic-VRAM
model and the multi-GPU deep clone load a fresh model and copy the object patches; each patch must then wrap the
clone's own modules, or a LoRA on the clone is silently dropped and training crashes."""
import pytest
import torch

from comfy_harness import comfy_nodes, load_tiny
from tools.fixtures.tiny_models import write_wan22_5b

pytestmark = pytest.mark.comfy_inprocess


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan.safetensors", "WAN22_T2V", inference=True)


def chunk(pack, model, chunks=4):
    return pack.nodes.ffn.chunk_model(model, chunks, True)


def wan_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 48, 3, 16, 16, generator=g), (torch.randn(1, 12, 4096, generator=g), {})


def sample(model, latent, cond):
    positive = [[cond[0], dict(cond[1])]]
    negative = [[torch.zeros_like(cond[0]), dict(cond[1])]]
    with torch.inference_mode():
        return comfy_nodes().KSampler().sample(model, 0, 1, 3.0, "euler", "simple", positive, negative,
                                               {"samples": latent})[0]["samples"]


def ffn_lora(model):
    g = torch.Generator().manual_seed(5)
    lora = {}
    for i, block in enumerate(model.model.diffusion_model.blocks):
        w = block.ffn[0].weight
        lora[f"diffusion_model.blocks.{i}.ffn.0.lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g)
        lora[f"diffusion_model.blocks.{i}.ffn.0.lora_down.weight"] = torch.randn(4, w.shape[1], generator=g)
    return lora


def deep_clone(model):
    import comfy.model_patcher
    import inspect
    if "force_deepcopy" not in inspect.signature(comfy.model_patcher.ModelPatcher.clone).parameters:
        pytest.skip("not applicable: this ComfyUI's ModelPatcher.clone has no force_deepcopy")
    clone = model.clone(force_deepcopy=True)
    assert clone.model is not model.model
    return clone


def test_deep_clone_with_lora_equals_the_unchunked_lora_model(pack, wan):
    import comfy.model_management
    import comfy.sd
    latent, cond = wan_inputs()
    lora = ffn_lora(wan)
    ref = sample(comfy.sd.load_lora_for_models(wan, None, lora, 1.0, 0)[0], latent, cond)
    comfy.model_management.unload_all_models()
    clone = deep_clone(chunk(pack, wan))
    keys = [k for k in clone.object_patches if k.endswith(".ffn.forward")]
    assert len(keys) == 2
    out = sample(comfy.sd.load_lora_for_models(clone, None, lora, 1.0, 0)[0], latent, cond)
    assert torch.allclose(out, ref, atol=1e-5), f"max |diff| {float((out - ref).abs().max()):.3g}"
    assert all(clone.object_patches[k].calls_chunked > 0 for k in keys)
    for key in keys:
        assert clone.object_patches[key].forward.__self__ is clone.model.get_submodule(key[:-len(".forward")])


def test_train_lora_trains_with_ffn_chunking(pack, wan):
    """Core Train LoRA deep-clones the model (force_deepcopy) and trains the clone's weights with gradients on."""
    import comfy.model_management
    from comfy_extras.nodes_train import TrainLoraNode
    chunked = deep_clone(chunk(pack, wan)).parent  # the skip when force_deepcopy does not exist
    latent, cond = wan_inputs()
    args = dict(model=chunked, latents={"samples": latent}, positive=[[cond[0], {}]], batch_size=1,
                grad_accumulation_steps=1, steps=1, learning_rate=1e-3, rank=4, optimizer="AdamW",
                loss_function="MSE", seed=0, training_dtype="fp32", lora_dtype="fp32", quantized_backward=False,
                algorithm="LoRA", gradient_checkpointing=True, checkpoint_depth=1, offloading=False,
                existing_lora="[None]", bucket_mode=False, bypass_mode=False)
    try:
        with torch.inference_mode():  # as ComfyUI's executor runs it
            out = TrainLoraNode.execute(**{k: [v] for k, v in args.items()})
    finally:
        comfy.model_management.unload_all_models()
    lora, losses, steps = out[0], out[1], out[2]
    assert steps == 1 and len(losses["loss"]) == 1 and all(torch.isfinite(torch.tensor(losses["loss"])))
    assert any(k.startswith("diffusion_model.blocks.0.ffn.") for k in lora)


def test_text_encoder_route_follows_a_deep_clone(pack, tmp_path):
    """The attention routes (here Patch Attention (CLIP) on the tiny UMT5) are rebound like FFN Chunking: a weight
    patch on the deep clone's attention reaches the output, as without the pack."""
    import comfy.sd
    import tools.fixtures.tiny_model_loaders  # noqa: F401 - the test-only loader shim: the tiny sizes reach the loader
    from tools.fixtures.tiny_models import write_umt5
    from tiled_attention_pack.nodes.comfy_adapter import PatchSettings
    from tiled_attention_pack.nodes.text_encoder_route import patch_clip
    with torch.inference_mode():
        clip = comfy.sd.load_clip(ckpt_paths=[write_umt5(str(tmp_path / "umt5.safetensors"))],
                                  clip_type=comfy.sd.CLIPType.WAN)
    patched = patch_clip(clip, PatchSettings(mode="chunked"))
    patcher = deep_clone(patched.patcher)
    deep = patched.clone()
    deep.patcher, deep.cond_stage_model = patcher, patcher.model
    keys = [k for k in patcher.object_patches if k.endswith("SelfAttention.forward")]
    assert len(keys) == 2
    g = torch.Generator().manual_seed(3)
    delta = {}
    for k in keys:
        w = clip.patcher.get_model_object(k.replace(".forward", ".q.weight"))
        delta[k.replace(".forward", ".q.weight")] = (torch.randn(w.shape, generator=g),)
    reference = clip.clone()
    reference.add_patches(delta, 1.0)
    deep.add_patches(delta, 1.0)
    tokens = clip.tokenize("a cat sitting on a mat")
    with torch.inference_mode():
        ref = reference.encode_from_tokens_scheduled(tokens)[0][0]
        plain = clip.encode_from_tokens_scheduled(tokens)[0][0]
        out = deep.encode_from_tokens_scheduled(tokens)[0][0]
    assert not torch.allclose(ref, plain, atol=1e-3)
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4), f"max |diff| {float((out - ref).abs().max()):.3g}"
    assert patcher.object_patches[keys[0]].settings.stats["engine"] >= 2
    for key in keys:
        assert patcher.object_patches[key].inner.__self__ is patcher.model.get_submodule(key[:-len(".forward")])
