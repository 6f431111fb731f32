"""torch's own scaled_dot_product_attention, whatever has been put in torch.nn.functional: the yardstick of the
self-check, the benchmark's baselines and the calibration's.

`torch.nn.functional.scaled_dot_product_attention` IS the builtin `torch._C._nn.scaled_dot_product_attention` until
something replaces the Python attribute (checked on torch 2.5.1 and 2.14.1): this pack's global patch
(attention_core.enable / patched), its process-wide mode inside ComfyUI (Tiled Attention Everywhere), other
libraries' wrappers. None of them can replace the builtin, so code that means "torch's own SDPA" calls it here and
never compares the engine with itself. It honours torch.nn.attention.sdpa_kernel and torch.autocast as the attribute
does; a CausalBias mask dispatches only while the attribute is torch's own (its __torch_function__ checks that the
function called IS the attribute), so give the yardstick is_causal or a materialised mask instead.
"""
from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


def torch_sdpa(*args, **kwargs):
    """torch's own SDPA with the backend torch picks (flash, memory-efficient, cuDNN or math)."""
    return TORCH_SDPA(*args, **kwargs)


def math_sdpa(*args, **kwargs):
    """torch's own SDPA on its math backend (the only one the GPUs this pack is for have)."""
    with sdpa_kernel([SDPBackend.MATH]):
        return TORCH_SDPA(*args, **kwargs)


def default_backend(q, k, v) -> str:
    """The backend torch's default SDPA picks for (q, k, v) as the lower-case SDPBackend name ("math",
    "flash_attention", "efficient_attention", "cudnn_attention", "overrideable"), from torch._fused_sdp_choice (the
    function the builtin asks, torch 2.5.1 to 2.14.1); "unknown" where that function is missing or fails, so a
    caller that must know whether the default is math SDPA treats it as different."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    try:
        return SDPBackend(int(choose(q, k, v))).name.lower()
    except Exception:  # absent (None is not callable), another signature, or an index SDPBackend lacks
        return "unknown"
