"""Attention Info: the detection report as a STRING, for bug reports."""
from __future__ import annotations

import torch

from ..attention_core import __version__, detect
from .api import io
from .comfy_adapter import comfy_default_attention
from .everywhere import describe as everywhere_state
from .override_notice import report_line as override_notice_line


def _device():
    try:
        import comfy.model_management as mm
        return mm.get_torch_device()
    except Exception:  # noqa: BLE001 - outside ComfyUI
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def startup_line() -> str:
    """The pack's start log line: this device's verdict and the process-wide mode."""
    try:
        verdict = detect(_device()).summary()
    except Exception as e:  # noqa: BLE001 - a report must never break ComfyUI's start
        verdict = f"device detection failed: {e}"
    return f"{verdict}; {everywhere_state(stats=False)}"


def report_text() -> str:
    r = detect(_device())
    lines = [f"tiled-attention {__version__}", r.text(), f"ComfyUI's own attention: {comfy_default_attention()}",
             f"torch: {torch.__version__}" + (f", HIP {torch.version.hip}" if getattr(torch.version, "hip", None)
                                              else (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""))]
    if r.needs_tiled_attention:
        lines.append("Patch Attention (mode auto): runs tiled attention here.")
    else:
        lines.append("Patch Attention (mode auto): leaves attention to ComfyUI here (a fused backend runs); "
                     "choose chunked/online/inplace to force tiled attention.")
    lines.append(everywhere_state())
    if not r.bf16_hardware and r.vendor == "amd":
        lines.append("bf16: no hardware support; use fp16 weights (--force-fp16 or weight_dtype) for speed.")
    lines.append(override_notice_line())  # a model that sampled without Patch Attention's override in force
    return "\n".join(lines)


class AttentionInfo(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TiledAttentionInfo",
            display_name="Attention Info",
            category="model_patches/attention",
            description=("What this GPU has: arch, bf16 hardware, working SDPA backends, what Patch Attention "
                         "does, and the latest notice of a model that sampled without Patch Attention's override in "
                         "force (another node replaced it)."),
            inputs=[],
            outputs=[io.String.Output()],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # never cached: the report describes the machine now

    @classmethod
    def execute(cls) -> io.NodeOutput:
        text = report_text()
        return io.NodeOutput(text, ui={"text": [text]})
