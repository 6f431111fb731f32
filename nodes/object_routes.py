"""Per-object attention routes: object patches that send one model object's attention calls to the engine.

ComfyUI gives text encoders and VAEs no attention override (their calls carry no `transformer_options`), so each
route is a `ModelPatcher.add_object_patch` on a clone: ComfyUI applies it when that clone is loaded and restores the
original on unpatch, so nothing stays patched between prompts and no other object sees it.

    ArgumentRoute     <module>.forward of a text-encoder attention module: its `optimized_attention` argument
                      (CLIP, T5/UMT5, Llama/Gemma 3, BERT, Qwen-VL) becomes the engine's wrapper
    OptionsRoute      <module>.forward of an attention module called without `transformer_options` (the LTX-2
                      text connectors): the call gets this pack's override in fresh `transformer_options`
"""
from __future__ import annotations

import copy
import inspect

from .clones import register as follow_clones


def forward_parameters(module) -> tuple:
    """Parameter names of the class-level forward of `module` (instance patches are ignored)."""
    try:
        return tuple(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return ()


def leaf_modules_with_parameter(root, parameter: str) -> list:
    """Dotted paths of modules under `root` whose forward takes `parameter` while no submodule's does: the
    modules that make the attention call themselves, not the blocks that only pass the argument down."""
    takes = {name for name, m in root.named_modules() if parameter in forward_parameters(m)}
    return sorted(name for name in takes if not any(o != name and (name == "" or o.startswith(name + "."))
                                                    for o in takes))


def unwrap(obj, route_type):
    """The function a route of `route_type` wraps, or `obj` itself when it is no such route."""
    while isinstance(obj, route_type):
        obj = obj.inner
    return obj


class Rewrappable:
    """A wrapper of one function held in `inner`; rewrapped(fn) is a copy around `fn` (nodes/clones.py)."""
    WRAPS = "inner"

    def rewrapped(self, fn):
        c = copy.copy(self)
        c.inner = fn
        return c


class ArgumentRoute(Rewrappable):
    """Replaces the `optimized_attention` argument of one forward by `make_attention(original)`."""

    def __init__(self, forward, make_attention, parameter="optimized_attention"):
        self.inner = forward
        self.make_attention = make_attention
        self.parameter = parameter
        self.signature = inspect.signature(forward)

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.arguments[self.parameter] = self.make_attention(bound.arguments.get(self.parameter))
        return self.inner(*bound.args, **bound.kwargs)


class OptionsRoute(Rewrappable):
    """Gives one forward `transformer_options` holding `override` when its caller passed none (or options
    without an attention override); calls that carry an override keep theirs."""

    def __init__(self, forward, key, override):
        self.inner = forward
        self.key = key
        self.override = override

    def __call__(self, *args, transformer_options=None, **kwargs):
        options = dict(transformer_options or {})
        options.setdefault(self.key, self.override)
        return self.inner(*args, transformer_options=options, **kwargs)


def set_routes(patcher, paths, suffix, route_type, make_route):
    """Object patches `<path><suffix>` = make_route(original) on `patcher` (a clone), replacing this pack's
    earlier route of the same kind; make_route=None removes this pack's routes, restoring the object patch that
    was there before ours (another pack's) or none."""
    for path in paths:
        key = f"{path}{suffix}" if path else suffix.lstrip(".")
        current = patcher.object_patches.get(key)
        if isinstance(current, route_type):
            had_patch = current.replaced_patch
        else:
            had_patch = current is not None
        if make_route is not None:
            route = make_route(unwrap(patcher.get_model_object(key), route_type))
            route.replaced_patch = had_patch
            patcher.add_object_patch(key, route)
        elif isinstance(current, route_type):
            if had_patch:
                patcher.object_patches[key] = unwrap(current, route_type)
            else:
                del patcher.object_patches[key]
    if make_route is not None and paths:
        follow_clones(patcher)
