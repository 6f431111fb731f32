"""Attention Fit: will a video fit? Tokens, per-call attention and FFN memory, and the settings to use, for a
model family, resolution and frame count (the numbers of `python -m attention_core.plan`),
and the time per step, per block and for the run from this device's calibration (attention_core.estimate), for
all of the model's blocks or `blocks` of them (`plan --blocks`). A size where a sampling stage has no tokens is
refused by plan.estimate, naming the smallest size that works."""
from __future__ import annotations

from ..attention_core.cli import plan
from .api import io


def free_memory_here() -> int:
    """Bytes free on ComfyUI's torch device (its own accounting), for the 'free_gb = 0' default."""
    import comfy.model_management as mm
    return int(mm.get_free_memory(mm.get_torch_device()))


def device_here() -> str:
    """ComfyUI's torch device as a string ("cpu", "cuda:0"): its tile rules and its calibration file."""
    import comfy.model_management as mm
    return str(mm.get_torch_device())


class AttentionFit(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TiledAttentionFit",
            display_name="Attention Fit",
            category="model_patches/attention",
            description=("Will it fit: video tokens, memory of one attention call for math SDPA, ComfyUI's "
                         "sub-quadratic and split attention and each tier of this pack, the FFN activation with "
                         "and without chunking, and the settings to use for the free memory."),
            inputs=[
                io.Combo.Input("model", options=sorted(plan.MODELS), default="wan22-5b",
                               tooltip="wan22-5b: Wan 2.2 TI2V 5B; wan-14b: Wan 2.1/2.2 14B; ltx23-22b: LTX-2.3 "
                                       "22B (video stream); z-image-turbo: Z-Image Turbo 6B (an image: frames 1)"),
                io.Int.Input("width", default=1280, min=16, max=8192, step=16, tooltip="video width in pixels"),
                io.Int.Input("height", default=720, min=16, max=8192, step=16, tooltip="video height in pixels"),
                io.Int.Input("frames", default=121, min=1, max=2049, step=1, tooltip="video length in frames"),
                io.Combo.Input("dtype", options=["fp16", "bf16", "fp32"], default="fp16",
                               tooltip="the dtype attention runs in"),
                io.Float.Input("free_gb", default=0.0, min=0.0, max=4096.0, step=0.5,
                               tooltip="free memory to plan for; 0 = what ComfyUI's device has free now"),
                io.Int.Input("blocks", default=0, min=0, max=plan.MAX_BLOCKS, step=1, optional=True,
                             tooltip="DiT blocks a step runs for the time estimate: 0 = all of the model's (Wan "
                                     "2.2 5B 30, Wan 14B 40, LTX-2.3 48, Z-Image Turbo 30); 1 to compare with a one-block run such "
                                     "as ./dev demo (the report gives the time per block too)"),
            ],
            outputs=[io.String.Output(display_name="report")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, free_gb=0.0, **kwargs):
        return float("nan")  # free_gb 0 reads the free memory now: never cached (the node is cheap)

    @classmethod
    def execute(cls, model, width, height, frames, dtype, free_gb, blocks=0) -> io.NodeOutput:
        spec = plan.MODELS.get(model)
        if spec is not None and (isinstance(blocks, bool) or not isinstance(blocks, int)
                                 or not 0 <= blocks <= spec.layers):
            raise ValueError(f"Attention Fit: {spec.title} has {spec.layers} blocks; set blocks from 1 to "
                             f"{spec.layers}, or 0 for all of them, got {blocks!r}")
        free = int(free_gb * plan.GB) if free_gb > 0 else free_memory_here()
        device = device_here()
        est = plan.estimate(model, width, height, frames, free, 4 if dtype == "fp32" else 2, cpu=device == "cpu",
                            dtype=dtype)
        text = plan.report(est) + "\n\n" + plan.time_report(est, device=device, blocks=blocks or None)
        return io.NodeOutput(text, ui={"text": [text]})
