"""Test-only ComfyUI custom node pack standing in for packs that bring their own model code (ComfyUI-WanVideoWrapper,
diffusers-based packs): never installed for users, it is linked into the test servers' custom_nodes by
tests/comfy/test_everywhere_e2e.py and imported by tests/comfy/test_everywhere_inprocess.py.

Its nodes build models with random weights and run them the way such packs do, outside ComfyUI's model management
and without transformer_options, so that none of the pack's per-model routes can reach them:
  Stand-in: diffusers Wan      a tiny diffusers WanTransformer3DModel (real diffusers model code: its attention
                               processors call torch.nn.functional.scaled_dot_product_attention)
  Stand-in: wrapper attention  a few attention blocks written in WanVideoWrapper's conventions: attention_mode
                               "sdpa" transposes q, k, v to [B, H, N, D], casts them to the attention dtype and calls
                               F.scaled_dot_product_attention with no mask and is_causal=False; "comfy" calls
                               ComfyUI's optimized_attention, bound by name at import, without transformer_options
Each counts its own attention calls (independently of the pack) and saves its output under
output/standin/<prefix>.safetensors; the node's text output is JSON {"attention_calls", "tokens", "file"}.
"""
import json
import os

import torch
import torch.nn.functional as F
from comfy.ldm.modules.attention import optimized_attention  # bound by name at import, as wrapper packs do

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEXT_TOKENS = 8


def randomize(model, seed: int, qk_gain: float = 1.0):
    """Random weights from `seed` through a generator of its own (never torch's global one, which other threads
    and ComfyUI's samplers draw from): matrices N(0, 1/fan_in), vectors N(0, 0.02^2), norm weights kept; q
    projections (and q/k norm weights) scaled by qk_gain so that the attention is sharp and the output depends
    strongly on it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            if name.endswith(("norm_q.weight", "norm_k.weight", "q.weight")):
                p.mul_(qk_gain)
    return model.eval()


def tiny_diffusers_wan(seed: int, layers: int = 2, heads: int = 2, head_dim: int = 16):
    """A diffusers WanTransformer3DModel at tiny sizes with random weights from `seed`, its attention sharp (the
    q/k RMS-norm gains raised)."""
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
                                  in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                  num_layers=layers, rope_max_seq_len=64)
    return randomize(model, seed, qk_gain=2.5)


def count_calls(model, class_name: str) -> list:
    """A one-element list counting the forwards of `model`'s submodules of class `class_name` (each makes one
    attention call), by forward pre-hooks."""
    calls, handles = [0], []

    def hook(*_):
        calls[0] += 1
    for m in model.modules():
        if type(m).__name__ == class_name:
            handles.append(m.register_forward_pre_hook(hook))
    return calls, handles


def diffusers_wan_inputs(seed: int, frames: int, height: int, width: int):
    g = torch.Generator().manual_seed(seed + 1)
    return dict(hidden_states=torch.randn(1, 4, frames, height, width, generator=g),
                timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 32, generator=g))


def run_diffusers_wan(seed: int, frames: int, height: int, width: int, dtype=torch.float32, model=None):
    """(output, attention calls) of the tiny diffusers Wan (built from `seed`, or `model`) on random inputs from
    `seed`, run as a diffusers pack runs it."""
    model = tiny_diffusers_wan(seed) if model is None else model
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    calls, handles = count_calls(model, "WanAttention")
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v)
              for k, v in diffusers_wan_inputs(seed, frames, height, width).items()}
    try:
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
    finally:
        for h in handles:
            h.remove()
    return out.float(), calls[0]


class WrapperAttention(torch.nn.Module):
    """Self- or cross-attention in WanVideoWrapper's conventions (see the module docstring)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.calls = 0

    def forward(self, x, context=None, attention_mode="sdpa", attention_dtype=torch.bfloat16):
        b, n, _ = x.shape
        context = x if context is None else context
        q = self.q(x).view(b, n, self.heads, self.head_dim)
        k = self.k(context).view(b, context.shape[1], self.heads, self.head_dim)
        v = self.v(context).view(b, context.shape[1], self.heads, self.head_dim)
        self.calls += 1
        if attention_mode == "sdpa":
            out = F.scaled_dot_product_attention(q.transpose(1, 2).to(attention_dtype),
                                                 k.transpose(1, 2).to(attention_dtype),
                                                 v.transpose(1, 2).to(attention_dtype),
                                                 attn_mask=None, dropout_p=0.0, is_causal=False)
            out = out.transpose(1, 2).reshape(b, n, -1)
        elif attention_mode == "comfy":
            out = optimized_attention(q.reshape(b, n, -1).to(attention_dtype), k.reshape(b, k.shape[1], -1).to(
                attention_dtype), v.reshape(b, v.shape[1], -1).to(attention_dtype), heads=self.heads)
        else:
            raise ValueError(f"attention_mode must be sdpa or comfy, got {attention_mode!r}")
        return self.o(out.to(x.dtype))


class WrapperTinyModel(torch.nn.Module):
    """Blocks of self-attention then cross-attention to a short text context, with residuals."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList([WrapperAttention(dim, heads), WrapperAttention(dim, heads)]) for _ in range(layers))

    def forward(self, x, context, attention_mode="sdpa", attention_dtype=torch.bfloat16):
        for self_attn, cross_attn in self.blocks:
            x = x + self_attn(x, None, attention_mode, attention_dtype)
            x = x + cross_attn(x, context, attention_mode, attention_dtype)
        return x

    def attention_calls(self) -> int:
        return sum(a.calls for blk in self.blocks for a in blk)


def tiny_wrapper_model(seed: int):
    return randomize(WrapperTinyModel(), seed, qk_gain=4.0)


def run_wrapper_model(seed: int, tokens: int, attention_mode: str = "sdpa", attention_dtype=torch.bfloat16,
                      model=None):
    """(output, attention calls) of the WanVideoWrapper-style blocks (built from `seed`, or `model`; fp32 weights)
    on random inputs from `seed`."""
    model = tiny_wrapper_model(seed) if model is None else model
    before = model.attention_calls()
    g = torch.Generator().manual_seed(seed + 1)
    x, context = torch.randn(1, tokens, 32, generator=g), torch.randn(1, TEXT_TOKENS, 32, generator=g)
    with torch.no_grad():
        out = model(x, context, attention_mode, attention_dtype)
    return out, model.attention_calls() - before


def _save(out, prefix, calls, tokens):
    import folder_paths
    from safetensors.torch import save_file
    path = os.path.join(folder_paths.get_output_directory(), "standin", prefix + ".safetensors")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({"out": out.float().contiguous()}, path)
    text = json.dumps({"attention_calls": calls, "tokens": tokens, "file": path})
    return {"ui": {"text": [text]}, "result": (text,)}


class StandinDiffusersWan:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "frames": ("INT", {"default": 2, "min": 1, "max": 64}),
                             "height": ("INT", {"default": 8, "min": 2, "max": 256, "step": 2}),
                             "width": ("INT", {"default": 8, "min": 2, "max": 256, "step": 2}),
                             "dtype": (list(DTYPES), {"default": "fp32"}),
                             "filename_prefix": ("STRING", {"default": "diffusers_wan"})},
                "optional": {"trigger": ("*",)}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "testing/standin"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def run(self, seed, frames, height, width, dtype, filename_prefix, trigger=None):
        out, calls = run_diffusers_wan(seed, frames, height, width, DTYPES[dtype])
        return _save(out, filename_prefix, calls, frames * (height // 2) * (width // 2))


class StandinWrapperAttention:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31}),
                             "tokens": ("INT", {"default": 64, "min": 1, "max": 1 << 20}),
                             "attention_mode": (["sdpa", "comfy"], {"default": "sdpa"}),
                             "dtype": (list(DTYPES), {"default": "bf16"}),
                             "filename_prefix": ("STRING", {"default": "wrapper"})},
                "optional": {"trigger": ("*",)}}

    RETURN_TYPES = ("STRING",)
    FUNCTION = "run"
    OUTPUT_NODE = True
    CATEGORY = "testing/standin"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def run(self, seed, tokens, attention_mode, dtype, filename_prefix, trigger=None):
        out, calls = run_wrapper_model(seed, tokens, attention_mode, DTYPES[dtype])
        return _save(out, filename_prefix, calls, tokens)


NODE_CLASS_MAPPINGS = {"StandinDiffusersWan": StandinDiffusersWan, "StandinWrapperAttention": StandinWrapperAttention}
NODE_DISPLAY_NAME_MAPPINGS = {"StandinDiffusersWan": "Stand-in: diffusers Wan (test)",
                              "StandinWrapperAttention": "Stand-in: wrapper attention (test)"}
