"""Z-Image Turbo benchmark: the DiT's attention at its real shape, and one real-width DiT step through ComfyUI.

Z-Image Turbo (6B) is ComfyUI's NextDiT (comfy/ldm/lumina/model.py) with the configuration comfy/model_detection.py
reads from the checkpoint: dim 3840, 30 heads (30 key-value heads) of 128, 30 layers plus 2 context- and 2
noise-refiner blocks, patch size 2, 16 latent channels (the Flux VAE: 1/8 of the pixels per side), caption features
of 2560 (Qwen 3 4B), text and image tokens each padded to a multiple of 32. Its main blocks attend over the text and
image tokens together, unmasked: at W x H pixels, (W/16) * (H/16) image tokens plus the prompt's tokens (--text-tokens,
default 128: a prompt of about 100 words).

Table 1, attention alone (each case through attention_core.bench's own case runner, a fresh process each): torch's
math SDPA, this engine (tier auto), torch's default SDPA and ComfyUI's sub-quadratic attention, B=1 x 30 heads x N x
128: time and peak extra memory.
Table 2, one DiT step: ComfyUI's own NextDiT class at the real width (3840, 30 x 128) with --depth main blocks and
--refiners refiner blocks of each kind (the real model has 30 and 2), random weights: ComfyUI's attention as it chose
it on this device ("comfy", e.g. attention_sub_quad on a CPU), torch's math SDPA and this engine, the last two put in
as the transformer_options attention override ComfyUI's own wrappers honour (how the pack's Patch Attention node
reaches the model); the engine's calls counted.
"""
from __future__ import annotations

import os
import sys

from . import measure

NAME = "zimage-turbo"
DIM, HEADS, HEAD_DIM, LAYERS, REFINERS, PATCH, VAE, LATENT_CH, CAP_DIM, PAD = 3840, 30, 128, 30, 2, 2, 8, 16, 2560, 32
ATTN_METHODS = ["math", "auto", "torch", "comfy-subquad"]  # attention_core.bench's method names
ATTN_LABELS = {"math": "math SDPA", "auto": "engine", "torch": "torch default SDPA",
               "comfy-subquad": "ComfyUI sub-quadratic"}
DIT_METHODS = ["comfy", "math", "engine"]
DIT_LABELS = {"comfy": "ComfyUI's attention (unpatched)", "math": "math SDPA", "engine": "engine (patched)"}
SIZES = [512, 1024, 1536, 2048]
DIT_SIZES = [512, 1024]  # the CPU default; give --dit-sizes 512,1024,1536,2048 on a GPU
QUICK_SIZES, QUICK_DIT_WIDTH = [64, 128], 384  # --quick: tiny images, the DiT 3 heads wide (head dim 128 kept)
COUNT_KEY = "bench-models:zimage"  # the engine's count key (attention_core.kernel.counts) of the DiT step's calls


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def tokens(side: int, text: int) -> tuple:
    """(image tokens, text tokens) of a side x side image: latent side/8, 2 x 2 patches, each padded to 32."""
    per_side = side // VAE // PATCH
    return _pad(per_side * per_side), _pad(text)


def comfy_import(path: str):
    """ComfyUI at `path` importable in this process, its arguments unparsed (the CPU where there is no GPU)."""
    if path not in sys.path:
        sys.path.insert(0, path)
    import comfy.options
    comfy.options.enable_args_parsing(False)
    import comfy.cli_args
    import torch
    if comfy.cli_args.args is not None and not torch.cuda.is_available():
        comfy.cli_args.args.cpu = True


def default_comfyui():
    """$COMFYUI_LATEST_PATH, $COMFYUI_PATH, else the 0.33.0 that ./dev sets up (as attention_core.bench picks)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    for path in (os.environ.get("COMFYUI_LATEST_PATH"), os.environ.get("COMFYUI_PATH"),
                 os.path.join(root, ".cache", "comfyui-0.33.0")):
        if path and os.path.isfile(os.path.join(path, "comfy", "model_management.py")):
            return path
    return None


def _override(kind: str):
    """An attention override for transformer_options (ComfyUI's wrap_attn calls it as override(func, q, k, v,
    heads, mask, ...)): the engine (counted under COUNT_KEY) or torch's math SDPA, ComfyUI's layouts both ways."""
    import torch
    from ...device.torch_sdpa import math_sdpa
    from ...sdpa import scaled_dot_product_attention

    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                 **kwargs):
        if not skip_reshape:  # (B, N, heads * d) -> (B, heads, N, d)
            q, k, v = (t.view(t.shape[0], -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.ndim == 2 else mask.unsqueeze(1) if mask.ndim == 3 else mask
            if mask.dtype != torch.bool:
                mask = mask.to(q.dtype)
        if kind == "engine":
            out = scaled_dot_product_attention(q, k, v, mask, count_as=COUNT_KEY)
        else:
            out = math_sdpa(q, k, v, attn_mask=mask)
        if skip_output_reshape:
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)
    return override


def build_dit(case: dict):
    """ComfyUI's NextDiT with Z-Image Turbo's configuration at case["width"], case["depth"] main blocks and
    case["refiners"] refiner blocks of each kind; random weights (normal 0.02, norm weights 1)."""
    import torch
    comfy_import(case["comfyui"])
    import comfy.ops
    from comfy.ldm.lumina.model import NextDiT
    dim = case["width"]
    torch.manual_seed(0)
    model = NextDiT(patch_size=PATCH, in_channels=LATENT_CH, dim=dim, n_layers=case["depth"],
                    n_refiner_layers=case["refiners"], n_heads=dim // HEAD_DIM, n_kv_heads=dim // HEAD_DIM,
                    ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=CAP_DIM,
                    axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True,
                    time_scale=1000.0, pad_tokens_multiple=PAD, image_model="lumina2", device=case["device"],
                    dtype=getattr(torch, case["dtype"]), operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 or "pad_token" in name:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model.eval()


def run_dit_case(case: dict) -> dict:
    """One DiT step (method, image side) in this process: {"ms", "peak_mb", "routed", "attention"}."""
    import torch
    from ...kernel import counts
    if case.get("threads"):
        torch.set_num_threads(case["threads"])
    model = build_dit(case)
    from comfy.ldm.modules import attention
    dtype, device = getattr(torch, case["dtype"]), case["device"]
    gen = torch.Generator().manual_seed(case["side"])

    def inputs(side):
        lat = side // VAE
        x = torch.randn(1, LATENT_CH, lat, lat, generator=gen).to(device, dtype)
        ctx = torch.randn(1, case["text"], CAP_DIM, generator=gen).to(device, dtype)
        return x, ctx

    override = None if case["method"] == "comfy" else _override(case["method"])

    def step(x, ctx):
        opts = {} if override is None else {"optimized_attention_override": override}
        return model(x, torch.tensor([0.5], device=device, dtype=dtype), ctx, case["text"],
                     transformer_options=opts)

    with torch.no_grad():
        step(*inputs(64))  # warm-up: thread pools and lazy init are not the method's time or memory
        counts.reset(COUNT_KEY)
        x, ctx = inputs(case["side"])
        res = measure.measured(lambda: step(x, ctx), device, case["repeats"])
    calls = counts.calls(COUNT_KEY)[0]
    counts.reset(COUNT_KEY)
    chosen = getattr(attention.optimized_attention, "__name__", str(attention.optimized_attention))
    res["attention"] = chosen if case["method"] == "comfy" else case["method"]
    if case["method"] == "engine":
        res.update(routed=calls, expected=(case["depth"] + 2 * case["refiners"]) * case["repeats"])
    return res


def attention_cases(a, elem: int, budget: float) -> list:
    """[(size label, {method: attention_core.bench case, or why not})] of the attention table."""
    out = []
    for side in a.sizes:
        img, txt = tokens(side, a.text_tokens)
        n = img + txt
        per = {}
        for m in a.methods:
            need = 2 * HEADS * n * n * elem if m == "math" else 0
            if need > budget:
                per[m] = (f"math SDPA needs ~{need / measure.GIB:,.1f} GB for the scores, over the "
                          f"{budget / measure.GIB:,.1f} GB budget (--memory-budget-gb): out of memory here")
            elif m == "comfy-subquad" and not a.comfyui:
                per[m] = "no ComfyUI (--comfyui or COMFYUI_PATH)"
            else:
                per[m] = dict(method=m, n=n, mode="fwd", heads=HEADS, dim=HEAD_DIM, batch=1, dtype=a.dtype,
                              device=a.device, seed=n, repeats=a.repeats, threads=a.threads, comfyui=a.comfyui,
                              ref=None)
        out.append((f"{side}² ({n:,})", per))
    return out


def dit_cases(a, elem: int, budget: float) -> list:
    """[(size label, {method: DiT case, or why not})] of the DiT-step table."""
    out = []
    width = QUICK_DIT_WIDTH if a.quick else DIM
    for side in a.dit_sizes:
        img, txt = tokens(side, a.text_tokens)
        n = img + txt
        per = {}
        for m in a.dit_methods:
            need = 2 * (width // HEAD_DIM) * n * n * elem if m == "math" else 0
            if not a.comfyui:
                per[m] = "no ComfyUI (--comfyui or COMFYUI_PATH): the DiT step needs its model class"
            elif need > budget:
                per[m] = (f"math SDPA needs ~{need / measure.GIB:,.1f} GB for the scores, over the "
                          f"{budget / measure.GIB:,.1f} GB budget (--memory-budget-gb): out of memory here")
            else:
                per[m] = dict(method=m, side=side, text=txt, width=width, depth=a.depth, refiners=a.refiners,
                              dtype=a.dtype, device=a.device, repeats=a.repeats, threads=a.threads,
                              comfyui=a.comfyui)
        out.append((f"{side}² ({n:,})", per))
    return out


def describe(a) -> tuple:
    """(attention table title, DiT table title)."""
    width = QUICK_DIT_WIDTH if a.quick else DIM
    return (f"Z-Image Turbo attention: B=1 x {HEADS} heads x N x {HEAD_DIM}, N = image + {_pad(a.text_tokens)} text "
            f"tokens, {a.dtype} on {a.device} (time / peak extra memory)",
            f"Z-Image Turbo DiT step: ComfyUI's NextDiT at width {width} ({width // HEAD_DIM} x {HEAD_DIM} heads), "
            f"{a.depth} of {LAYERS} main blocks and {a.refiners} of {REFINERS} refiner blocks of each kind, random "
            f"weights, {a.dtype} on {a.device} (time / peak extra memory; engine calls counted)")


if __name__ == "__main__":
    sys.exit(measure.child_main(run_dit_case))
