"""Patch Attention: MODEL -> MODEL with this pack's tiled attention as the model's attention override."""
from __future__ import annotations

from .comfy_adapter import HALF_POLICIES, MODES, PatchSettings, install


class PatchAttention:
    DESCRIPTION = ("Runs the model's attention through exact tiled attention with O(N) memory, for GPUs without "
                   "fused attention (MI50/MI60/Radeon VII gfx906, Vega, RDNA1, RDNA2). Patches a clone: the "
                   "same model elsewhere in the graph is untouched. A later attention node in a chain wins.")
    CATEGORY = "model_patches/attention"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model to patch (Wan, LTX, Flux, SD... any model that "
                                           "uses ComfyUI's optimized attention)."}),
            "mode": (list(MODES), {"default": "auto", "tooltip":
                     "auto: tiled attention only where this GPU has no fused attention, tier chosen from free "
                     "memory. chunked: fastest tier. online: least memory (FlashAttention-2 recurrence). "
                     "inplace: softmax in the score tile. off: remove this pack's patch."}),
            "memory_budget_mb": ("INT", {"default": 0, "min": 0, "max": 1048576, "step": 64, "tooltip":
                                 "Memory the attention tiles may use, in MB. 0 = from the memory free at each "
                                 "call."}),
            "half_precision": (list(HALF_POLICIES), {"default": "keep", "tooltip":
                               "keep: compute in the model's dtype (bf16 becomes fp16 only on GPUs without bf16 "
                               "hardware, when values fit). bf16_to_fp16: always, when values fit. fp32: compute "
                               "half-precision attention in fp32."}),
            "min_tokens": ("INT", {"default": 1024, "min": 0, "max": 1000000, "tooltip":
                           "Attention over fewer tokens than this keeps ComfyUI's own attention (small text "
                           "cross-attention, previews)."}),
        }}

    def patch(self, model, mode, memory_budget_mb, half_precision, min_tokens):
        if mode not in MODES:
            raise ValueError(f"Patch Attention (tiled): mode must be one of {MODES}, got {mode!r}")
        if half_precision not in HALF_POLICIES:
            raise ValueError(f"Patch Attention (tiled): half_precision must be one of {HALF_POLICIES}, got "
                             f"{half_precision!r}")
        settings = PatchSettings(mode=mode, memory_budget_mb=int(memory_budget_mb), half_precision=half_precision,
                                 min_tokens=int(min_tokens))
        return (install(model, settings),)
