"""Patch Attention (CLIP): a text encoder's attention (CLIP, T5/UMT5, Llama/Gemma 3, BERT, Qwen-VL) through
the engine, on a clone of the CLIP object.

ComfyUI's text encoders pick `optimized_attention_for_device(..., small_input=True)` inside their forward and pass it
down to the attention modules as the `optimized_attention` argument, with no `transformer_options`. The route is an
object patch on each attention module's forward that swaps that argument for the pack's override (the same one
Patch Attention installs on a diffusion model), with ComfyUI's function as the fallback for calls it passes on.
"""
from __future__ import annotations

from .comfy_adapter import PatchSettings, make_override
from .object_routes import ArgumentRoute, leaf_modules_with_parameter, set_routes

PARAMETER = "optimized_attention"


def attention_modules(clip) -> list:
    """Paths (inside clip.patcher.model) of the modules that make the text encoder's attention calls."""
    return leaf_modules_with_parameter(clip.patcher.model, PARAMETER)


def engine_attention(override, original):
    """An `optimized_attention` for one call chain: the override, falling back to `original` (or ComfyUI's own
    small-input attention when the caller passed none)."""

    def tiled_text_encoder_attention(*args, **kwargs):
        fallback = original
        if fallback is None:
            from comfy.ldm.modules.attention import optimized_attention_for_device
            fallback = optimized_attention_for_device(args[0].device, small_input=True)
        return override(fallback, *args, **kwargs)
    return tiled_text_encoder_attention


def patch_clip(clip, settings: PatchSettings):
    """A clone of `clip` whose attention runs through the engine (mode off: this pack's routes removed)."""
    paths = attention_modules(clip)
    if not paths:
        raise ValueError(f"{settings.node}: no attention modules (a forward taking `{PARAMETER}`) found in "
                         f"{type(clip.patcher.model).__name__}; this text encoder calls attention another way. "
                         f"Remove the node for this text encoder.")
    c = clip.clone()
    if settings.mode == "off":
        set_routes(c.patcher, paths, ".forward", ArgumentRoute, None)
        return c
    override = make_override(settings)

    def route(forward):
        r = ArgumentRoute(forward, lambda original: engine_attention(override, original), PARAMETER)
        r.settings = settings
        return r
    set_routes(c.patcher, paths, ".forward", ArgumentRoute, route)
    return c
