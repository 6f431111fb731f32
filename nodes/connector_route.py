"""The LTX-2 / LTX-2.3 text connectors through Patch Attention's override.

`preprocess_text_embeds` runs the video and audio `Embeddings1DConnector`s while the sampler builds the
conditioning (model_base.LTXAV.extra_conds), after the model is loaded but outside the model's forward, and their
`BasicTransformerBlock1D` calls `attn1(x, mask=..., pe=...)` without `transformer_options`, so ComfyUI's
per-model override never reaches them. The route is an object patch on each connector attention module's forward
(on the patched MODEL clone) that hands it `transformer_options` with the override; calls that pass an override
keep it.
"""
from __future__ import annotations

from .comfy_adapter import OVERRIDE_KEY
from .object_routes import OptionsRoute, forward_parameters, set_routes

CONNECTOR_SUFFIX = "embeddings_connector"
PREFIX = "diffusion_model."


def connector_attention_modules(model_patcher) -> list:
    """Paths (from the patcher's model) of attention modules inside `*embeddings_connector` submodules whose
    forward takes `transformer_options`."""
    diffusion_model = model_patcher.get_model_object("diffusion_model")
    found = []
    for name, module in diffusion_model.named_modules():
        parts = name.split(".")
        if not any(p.endswith(CONNECTOR_SUFFIX) for p in parts[:-1]):
            continue
        params = forward_parameters(module)
        if "transformer_options" in params and any(p in params for p in ("mask", "attention_mask", "context")):
            found.append(PREFIX + name)
    return found


def route_connectors(model_patcher, override):
    """Object patches on `model_patcher` (a clone) routing the connectors' attention to `override`; None removes
    this pack's routes. Returns the number of modules routed."""
    paths = connector_attention_modules(model_patcher)
    if override is None:
        set_routes(model_patcher, paths, ".forward", OptionsRoute, None)
    else:
        set_routes(model_patcher, paths, ".forward", OptionsRoute,
                   lambda forward: OptionsRoute(forward, OVERRIDE_KEY, override))
    return len(paths)
