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


def wan22_5b_state_dict(heads=2, layers=2, ffn_dim=64, seed=0):
    """A Wan 2.2 TI2V-5B-architecture DiT (the real 5B: 24 heads, 30 layers, ffn 14336)."""
    import comfy.ldm.wan.model as wan
    import comfy.ops
    m = wan.WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=48, out_dim=48, dim=128 * heads,
                     ffn_dim=ffn_dim, num_heads=heads, num_layers=layers, text_dim=4096, freq_dim=256,
                     operations=comfy.ops.disable_weight_init, device="cpu", dtype=torch.float32)
    return fill_random(m.state_dict(), seed=seed, std=0.05)


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
