"""Patch Attention nodes: the pack's tiled attention for a MODEL (diffusion model + LTX-2 text connectors), a CLIP
(text encoder) or a VAE (its attention blocks). Each patches a clone; the input object is untouched."""
from __future__ import annotations

from . import override_notice
from .api import io
from .comfy_adapter import HALF_POLICIES, MODES, PatchSettings, install
from .connector_route import route_connectors
from .text_encoder_route import patch_clip
from .vae_route import patch_vae

CATEGORY = "model_patches/attention"


def settings_inputs(min_tokens_default: int, what: str) -> list:
    """The widgets the three Patch Attention nodes share (names and choices are part of saved workflows)."""
    return [
        io.Combo.Input("mode", options=list(MODES), default="auto", tooltip=(
            f"auto: tiled attention for the {what} only where this GPU has no fused attention, tier chosen from "
            "free memory. chunked: fastest tier. inplace: softmax in the score tile; less memory than chunked on a "
            "GPU (the same on the CPU). online: FlashAttention-2 recurrence; least memory at the default tile size, "
            "and its tiles shrink the furthest (auto falls back to it when nothing else fits). off: remove this "
            "pack's patch.")),
        io.Int.Input("memory_budget_mb", default=0, min=0, max=1048576, step=64, tooltip=(
            "Memory the attention tiles may use, in MB. 0 = from the memory free at each call.")),
        io.Combo.Input("half_precision", options=list(HALF_POLICIES), default="keep", tooltip=(
            "keep: compute in the model's dtype (bf16 becomes fp16 only on GPUs without bf16 hardware, when values "
            "fit). bf16_to_fp16: always, when values fit. fp32: compute half-precision attention in fp32.")),
        io.Int.Input("min_tokens", default=min_tokens_default, min=0, max=1000000, tooltip=(
            "Attention over fewer tokens than this keeps ComfyUI's own attention. 0 = every call runs tiled.")),
    ]


def parse_devices(node, devices: str) -> tuple:
    """"cuda:0, cuda:1" -> (device("cuda:0"), device("cuda:1")); "" -> () (the model's own device)."""
    import torch
    names = [d.strip() for d in (devices or "").split(",") if d.strip()]
    out = []
    for name in names:
        try:
            device = torch.device(name)
        except RuntimeError as e:
            raise ValueError(f"{node}: devices must list torch devices separated by commas, e.g. 'cuda:0, cuda:1'; "
                             f"{name!r} is not one ({e})") from e
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{node}: devices lists {name}, but this machine has {torch.cuda.device_count()} "
                             f"CUDA/ROCm device(s); leave devices empty to use the model's device only")
        out.append(device)
    return tuple(out)


def make_settings(node, mode, memory_budget_mb, half_precision, min_tokens, devices="") -> PatchSettings:
    if mode not in MODES:
        raise ValueError(f"{node}: mode must be one of {MODES}, got {mode!r}")
    if half_precision not in HALF_POLICIES:
        raise ValueError(f"{node}: half_precision must be one of {HALF_POLICIES}, got {half_precision!r}")
    return PatchSettings(mode=mode, memory_budget_mb=int(memory_budget_mb), half_precision=half_precision,
                         min_tokens=int(min_tokens), node=node, devices=parse_devices(node, devices))


class PatchAttention(io.ComfyNode):
    NODE = "Patch Attention (tiled)"

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="TiledAttentionPatch",
            display_name=cls.NODE,
            category=CATEGORY,
            description=("Runs the model's attention through exact tiled attention with O(N) memory, for GPUs "
                         "without fused attention (MI50/MI60/Radeon VII gfx906, Vega, RDNA1, RDNA2), including the "
                         "LTX-2 text connectors that run while the sampler builds the conditioning. Patches a "
                         "clone: the same model elsewhere in the graph is untouched. A later attention node in a "
                         "chain wins."),
            inputs=[io.Model.Input("model", tooltip=(
                "The diffusion model to patch (Wan, LTX, Flux, SD... any model that uses ComfyUI's optimized "
                "attention)."))] + settings_inputs(1024, "model") + [
                io.String.Input("devices", default="", optional=True, tooltip=(
                    "Empty: attention runs on the model's device. One device, e.g. 'cuda:1': it runs there; "
                    "several, e.g. 'cuda:0, cuda:1': each attention call's heads are split over them. Exact "
                    "either way (q, k, v copied there and the result back); for machines with several GPUs."))],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, mode, memory_budget_mb, half_precision, min_tokens, devices="") -> io.NodeOutput:
        settings = make_settings(cls.NODE, mode, memory_budget_mb, half_precision, min_tokens, devices)
        replaced = override_notice.earlier_patch(model)
        m = install(model, settings)
        override = m.model_options.get("transformer_options", {}).get("optimized_attention_override")
        route_connectors(m, override if mode != "off" else None)
        # sampling without this override in force (a later node replaced it) is said once per prompt
        override_notice.watch(m, override if mode != "off" else None, cls.NODE, replaced)
        return io.NodeOutput(m)


class _PatchObject(io.ComfyNode):
    """Patch Attention for an object other than the MODEL: the object in (input INPUT of type SOCKET) and out,
    then the settings every Patch Attention node shares, with min_tokens 0. Subclasses name the object and
    execute its patch."""
    NODE = NODE_ID = INPUT = WHAT = TOOLTIP = DESCRIPTION = ""
    SOCKET = None

    @classmethod
    def define_schema(cls):
        return io.Schema(node_id=cls.NODE_ID, display_name=cls.NODE, category=CATEGORY, description=cls.DESCRIPTION,
                         inputs=[cls.SOCKET.Input(cls.INPUT, tooltip=cls.TOOLTIP)] + settings_inputs(0, cls.WHAT),
                         outputs=[cls.SOCKET.Output()])


class PatchAttentionCLIP(_PatchObject):
    NODE, NODE_ID = "Patch Attention (CLIP, tiled)", "TiledAttentionPatchCLIP"
    SOCKET, INPUT, WHAT = io.Clip, "clip", "text encoder"
    TOOLTIP = "The text encoder (CLIP output of a CLIP / text encoder loader)."
    DESCRIPTION = ("Runs the text encoder's attention (UMT5 for Wan, Gemma 3 for LTX-2.3, T5, CLIP, Llama, Qwen) "
                   "through exact tiled attention, on a clone of the CLIP: the same text encoder elsewhere in the "
                   "graph is untouched, and nothing stays patched after the prompt.")

    @classmethod
    def execute(cls, clip, mode, memory_budget_mb, half_precision, min_tokens) -> io.NodeOutput:
        return io.NodeOutput(patch_clip(clip, make_settings(cls.NODE, mode, memory_budget_mb, half_precision,
                                                            min_tokens)))


class PatchAttentionVAE(_PatchObject):
    NODE, NODE_ID = "Patch Attention (VAE, tiled)", "TiledAttentionPatchVAE"
    SOCKET, INPUT, WHAT = io.Vae, "vae", "VAE"
    TOOLTIP = "The VAE (VAE output of a VAE or checkpoint loader)."
    DESCRIPTION = ("Runs the VAE's attention blocks (Wan 2.1/2.2, SD, SDXL, Flux, HunyuanVideo VAEs) through exact "
                   "tiled attention, on a copy of the VAE: the input VAE is untouched. VAEs without attention blocks "
                   "(the LTX video VAE) pass through unchanged.")

    @classmethod
    def execute(cls, vae, mode, memory_budget_mb, half_precision, min_tokens) -> io.NodeOutput:
        return io.NodeOutput(patch_vae(vae, make_settings(cls.NODE, mode, memory_budget_mb, half_precision,
                                                          min_tokens)))
