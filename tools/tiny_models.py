"""Tiny random-weight models of the real architectures, written as the files ComfyUI's loaders expect.

- Wan 2.2 TI2V-5B DiT: ComfyUI detects it from the state dict (head.modulation, 48 in/out channels -> WAN22_T2V);
  head_dim is always 128 there, so width = 128 x heads.
- LTX-Video DiT: detected from adaln_single keys; a `config` in the file metadata sets the sizes.
Deterministic: seeded normal weights, norm weights 1.
"""
import json
import os

import torch


def fill_random(sd, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sd.items():
        if not v.is_floating_point():
            out[k] = v.clone()
        elif v.ndim == 1 and any(s in k for s in ("norm", "gamma", "scale")) and "bias" not in k:
            out[k] = torch.ones(v.shape, dtype=v.dtype)
        else:
            out[k] = (torch.randn(v.shape, generator=g) * std).to(v.dtype)
    return out


def wan22_5b_state_dict(heads=2, layers=2, ffn_dim=64, seed=0, qk_gain=2.5):
    """A Wan 2.2 TI2V-5B-architecture DiT (the real 5B: 24 heads, 30 layers, ffn 14336).

    Wan RMS-normalises q and k over the model width, so logits have a standard deviation of about qk_gain**2:
    2.5 makes attention far from uniform, so the sampled latents depend strongly on it (uniform attention moves
    them by about half their standard deviation)."""
    import comfy.ldm.wan.model as wan
    import comfy.ops
    m = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=48, out_dim=48, dim=128 * heads,
                     ffn_dim=ffn_dim, num_heads=heads, num_layers=layers, text_dim=4096, freq_dim=256,
                     operations=comfy.ops.disable_weight_init, device="cpu", dtype=torch.float32)
    sd = fill_random(m.state_dict(), seed=seed, std=0.05)
    for k in sd:
        if k.endswith(("norm_q.weight", "norm_k.weight")):
            sd[k] = torch.full_like(sd[k], qk_gain)
    return sd


def write_wan22_5b(path, **kw):
    from safetensors.torch import save_file
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(wan22_5b_state_dict(**kw), path)
    return path


LTXV_CONFIG = {"num_attention_heads": 2, "attention_head_dim": 16, "cross_attention_dim": 32, "num_layers": 2}


def write_ltxv(path, config=None, seed=0):
    """An LTX-Video DiT; its sizes travel in the file's metadata as LTXV single files carry them."""
    import comfy.ldm.lightricks.model as ltx
    import comfy.ops
    from safetensors.torch import save_file
    cfg = dict(config or LTXV_CONFIG)
    m = ltx.LTXVModel(in_channels=128, caption_channels=4096, operations=comfy.ops.disable_weight_init,
                      device="cpu", dtype=torch.float32, **cfg)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(fill_random(m.state_dict(), seed=seed, std=0.05), path,
              metadata={"config": json.dumps({"transformer": cfg})})
    return path


# ------------------------------------------------------------------ text encoder and VAE (need the test shim)
MARK_TE = "tiny_test.umt5_config"
MARK_VAE = "tiny_test.wan_vae_dims"
UMT5_TINY = {"d_ff": 16, "d_kv": 8, "num_heads": 2, "num_layers": 2, "vocab_size": 384}
WAN_VAE_TINY = {"dim": 8, "dec_dim": 8}


def _marker(obj):
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).clone()


def spiece_model(vocab_size=384) -> bytes:
    """A tiny sentencepiece tokenizer with UMT5's special ids (pad 0, eos 1, unk 2); trained in ~10 ms."""
    import io

    import sentencepiece as spm
    text = ["a cat sitting on a mat", "a dog running in the park", "video of a red car driving at night",
            "the quick brown fox jumps over the lazy dog", "a beautiful landscape with mountains and a lake",
            "portrait of an astronaut riding a horse", "text to video test prompt 0123456789"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, vocab_size=vocab_size,
                                   model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2, character_coverage=1.0,
                                   byte_fallback=True)
    return buf.getvalue()


def write_umt5(path, cfg=None, seed=0):
    """UMT5 (Wan's text encoder) at width 4096 (fixed by the DiT) with few, narrow layers, its tokenizer inside
    as `spiece_model` (as in the real file), and the detection key ComfyUI looks for (block 23)."""
    import comfy.ops
    import comfy.text_encoders.t5 as t5
    from safetensors.torch import save_file
    cfg = dict(cfg or UMT5_TINY)
    full = {"d_model": 4096, "dense_act_fn": "gelu_pytorch_tanh", "is_gated_act": True, "model_type": "umt5", **cfg}
    m = t5.T5(full, dtype=torch.float32, device="cpu", operations=comfy.ops.manual_cast)
    sd = {k: v.half().contiguous() for k, v in fill_random(m.state_dict(), seed=seed, std=0.05).items()}
    # the key (and shape) ComfyUI detects UMT5-XXL by: 0.33.0 reads its first dim (10240), 0.3.75 its last (4096);
    # not a weight of the tiny model, so the loader ignores its values (fp8: 40 MB rather than 80)
    sd.setdefault("encoder.block.23.layer.1.DenseReluDense.wi_1.weight",
                  torch.zeros(10240, 4096, dtype=torch.float8_e4m3fn))
    sd["spiece_model"] = torch.frombuffer(bytearray(spiece_model(cfg["vocab_size"])), dtype=torch.uint8).clone()
    sd[MARK_TE] = _marker(cfg)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path)
    return path


def write_wan22_vae(path, dims=None, seed=0):
    """The real Wan 2.2 VAE architecture (48 latent channels, x16 space, x4 time) with narrow convolutions."""
    import comfy.ldm.wan.vae2_2 as v2
    from safetensors.torch import save_file
    dims = dict(dims or WAN_VAE_TINY)
    m = v2.WanVAE(z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                  temperal_downsample=[False, True, True], dropout=0.0, **dims)
    sd = fill_random(m.state_dict(), seed=seed, std=0.05)
    sd[MARK_VAE] = _marker(dims)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path)
    return path


def write_wan22_model_set(models_dir):
    """The three files the bundled Wan 2.2 workflows load, under the names and folders they expect."""
    return {
        "unet": write_wan22_5b(os.path.join(models_dir, "diffusion_models", "wan2.2_ti2v_5B_fp16.safetensors")),
        "clip": write_umt5(os.path.join(models_dir, "text_encoders", "umt5_xxl_fp8_e4m3fn_scaled.safetensors")),
        "vae": write_wan22_vae(os.path.join(models_dir, "vae", "wan2.2_vae.safetensors")),
    }
