"""Patch Attention (VAE): a VAE's attention blocks through the engine, on a copy of the VAE object with its own
ModelPatcher clone.

ComfyUI's VAE attention blocks (SD/SDXL/Flux `AttnBlock`, Wan 2.1/2.2 `AttentionBlock`, HunyuanVideo) hold the
function they call in `self.optimized_attention`, chosen at build time: f(q, k, v) with q, k, v of shape
[B, C, *spatial], one head of width C over the prod(spatial) positions, result in the same shape. The route is an
object patch `<block>.optimized_attention` = VaeAttentionRoute on a clone of the VAE's patcher (`VAE` has no
clone(): the node makes a shallow copy that owns the cloned patcher, so the input VAE is untouched).
"""
from __future__ import annotations

import copy
import logging
import math

from .comfy_adapter import POSITIONAL, PatchSettings, count, pass_on, run_engine, wants_engine
from .object_routes import Rewrappable, set_routes

ATTRIBUTE = "optimized_attention"
log = logging.getLogger("tiled_attention")


class VaeAttentionRoute(Rewrappable):
    """f(q, k, v) of a VAE attention block: the engine on [B, 1, N, C], or `inner` (ComfyUI's) for calls the
    settings pass on."""

    def __init__(self, inner, settings: PatchSettings):
        self.inner = inner
        self.settings = settings

    def __call__(self, q, k, v):
        shape = q.shape
        b, c = shape[0], shape[1]
        n = math.prod(shape[2:])
        if not wants_engine(self.settings, q, n, math.prod(k.shape[2:])):
            count(self.settings, "passthrough")
            return pass_on(self.inner, q, k, v)  # the node decided: the process-wide mode leaves it to ComfyUI
        if count(self.settings, "engine") == 1:
            log.info("[tiled-attention] %s: tiled attention running (mode %s), first call q %s", self.settings.node,
                     self.settings.mode, tuple(shape))
        heads = [t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v)]
        call = dict(zip(POSITIONAL, (*heads, 1, None, None, True, True)))
        out = run_engine(self.settings, call, {})
        return out.transpose(2, 3).reshape(shape)


def attention_blocks(vae) -> list:
    """Paths (inside vae.patcher.model) of the modules holding a callable `optimized_attention`."""
    return sorted(name for name, m in vae.patcher.model.named_modules() if callable(m.__dict__.get(ATTRIBUTE)))


def copy_vae(vae):
    """A shallow copy of `vae` owning a clone of its patcher (object patches on it leave `vae` untouched)."""
    clone = getattr(vae, "clone", None)
    if callable(clone):
        return clone()
    v = copy.copy(vae)
    v.patcher = vae.patcher.clone()
    return v


def patch_vae(vae, settings: PatchSettings):
    """A copy of `vae` whose attention blocks run through the engine (mode off: this pack's routes removed)."""
    if getattr(vae, "patcher", None) is None or getattr(vae, "first_stage_model", None) is None:
        raise ValueError(f"{settings.node}: this VAE has no model (an invalid or empty VAE input).")
    paths = attention_blocks(vae)
    v = copy_vae(vae)
    if settings.mode == "off":
        set_routes(v.patcher, paths, "." + ATTRIBUTE, VaeAttentionRoute, None)
    elif paths:
        set_routes(v.patcher, paths, "." + ATTRIBUTE, VaeAttentionRoute,
                   lambda inner: VaeAttentionRoute(inner, settings))
    return v
