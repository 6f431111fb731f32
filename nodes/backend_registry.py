"""The engine as a named ComfyUI attention backend ("tiled"), for ComfyUI's own backend selection.

ComfyUI keeps a registry of attention functions (`comfy.ldm.modules.attention.register_attention_function`, read by
`get_attention_function(name)`; e.g. the Model Attention Backend node and `ModelPatcher.set_model_optimized_attention`
pick from it). Registering adds a name only: ComfyUI's default `optimized_attention` and every model's options stay
as they were until something selects "tiled". Versions without the registry are left alone.
"""
from __future__ import annotations

import logging

from .comfy_adapter import PatchSettings, make_override

NAME = "tiled"
log = logging.getLogger("tiled_attention")


def tiled_backend(settings: PatchSettings = None):
    """An attention function with ComfyUI's backend signature (q, k, v, heads, mask=None, attn_precision=None,
    skip_reshape=False, skip_output_reshape=False, **kwargs) that always runs the engine (tier auto)."""
    override = make_override(settings or PatchSettings(mode="chunked", node="attention backend 'tiled'"))

    def attention_tiled(*args, **kwargs):
        return override(None, *args, **kwargs)
    attention_tiled.settings = getattr(override, "_tiled_attention")
    return attention_tiled


def register() -> bool:
    """Register the engine under NAME when this ComfyUI has the registry and the name is free. True when the
    name is (now) ours."""
    try:
        from comfy.ldm.modules import attention
    except ImportError:
        return False
    registry = getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", None)
    add = getattr(attention, "register_attention_function", None)
    if registry is None or add is None:
        log.info("[tiled-attention] this ComfyUI has no attention backend registry; the nodes work without it")
        return False
    existing = registry.get(NAME)
    if existing is not None:
        return getattr(existing, "settings", None) is not None and existing.__name__ == "attention_tiled"
    fn = tiled_backend()
    wrap = getattr(attention, "wrap_attn", None)
    wrapped = wrap(fn) if wrap is not None else fn
    wrapped.settings = fn.settings
    add(NAME, wrapped)
    return True
