"""Attention Info: the detection report as a STRING, for bug reports."""
from __future__ import annotations

import torch

from ..attention_core import detect
from .comfy_adapter import comfy_default_attention


def report_text() -> str:
    try:
        import comfy.model_management as mm
        device = mm.get_torch_device()
    except Exception:  # noqa: BLE001 - outside ComfyUI
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    r = detect(device)
    lines = [r.text(), f"ComfyUI's own attention: {comfy_default_attention()}",
             f"torch: {torch.__version__}" + (f", HIP {torch.version.hip}" if getattr(torch.version, "hip", None)
                                              else (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""))]
    if r.needs_tiled_attention:
        lines.append("Patch Attention (mode auto): runs tiled attention here.")
    else:
        lines.append("Patch Attention (mode auto): leaves attention to ComfyUI here (a fused backend runs); "
                     "choose chunked/online/inplace to force tiled attention.")
    if not r.bf16_hardware and r.vendor == "amd":
        lines.append("bf16: no hardware support; use fp16 weights (--force-fp16 or weight_dtype) for speed.")
    return "\n".join(lines)


class AttentionInfo:
    DESCRIPTION = "What this GPU has: arch, bf16 hardware, working SDPA backends, and what Patch Attention does."
    CATEGORY = "model_patches/attention"
    RETURN_TYPES = ("STRING",)
    OUTPUT_NODE = True
    FUNCTION = "info"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    @classmethod
    def IS_CHANGED(cls):
        return float("nan")

    def info(self):
        text = report_text()
        return {"ui": {"text": [text]}, "result": (text,)}
