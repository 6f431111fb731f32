"""This pack's object patches follow every ComfyUI clone that owns a different model onto that model.

Each of this pack's object patches (FFN Chunking's ChunkedFFN, the text-encoder, connector and VAE attention
routes) wraps a bound method of a module of the model it was made on. `ModelPatcher.clone()` copies the object
patches as they are, which is right while the clone shares the model; but some clones load or copy a model of
their own and still copy the patches: `clone(force_deepcopy=True)` (core Train LoRA), `clone(disable_dynamic=True)`
of a dynamic-VRAM model (core TorchCompileModel, hooks, multi-GPU), `clone(model_override=...)`, the multi-GPU
`deepclone_multigpu` and `match_multigpu_clones` (ComfyUI 0.33.0). Left alone, such a clone would compute with the
ORIGINAL model's modules: its LoRAs dropped, its training on the wrong (inference) weights.

Every one of those goes through `clone()`, which ends by calling the patcher's ON_CLONE callbacks (ComfyUI 0.3.x
and later) with (original, clone). The callback registered here does nothing when the clone shares the model; else
it replaces each of this pack's patches on the clone by the same patch bound to the module at the same path of the
clone's model. Other packs' patches are left as they are.
"""
from __future__ import annotations

import inspect
import types

import torch

CALLBACK_KEY = "tiled-attention"


def register(patcher) -> None:
    """Make every later clone of `patcher` with a model of its own rebind this pack's object patches (idempotent;
    nothing outside ComfyUI or where clones have no callbacks)."""
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:  # not inside ComfyUI
        return
    call = getattr(CallbacksMP, "ON_CLONE", None)
    if call is None or not hasattr(patcher, "add_callback_with_key"):
        return
    patcher.remove_callbacks_with_key(call, CALLBACK_KEY)
    patcher.add_callback_with_key(call, CALLBACK_KEY, rebind_object_patches)


def rebind_object_patches(original, clone) -> None:
    """ON_CLONE callback: when `clone.model` is not `original.model`, each of this pack's object patches on `clone`
    that wraps a method of a module of `original.model` is replaced by a copy wrapping the same method of the
    module at the same path of `clone.model`. Raises when the clone's model has no module at that path."""
    if clone.model is original.model:
        return
    paths = {id(m): name for name, m in original.model.named_modules()}
    for key, patch in list(clone.object_patches.items()):
        new = _rebound(patch, paths, clone.model, key)
        if new is not patch:
            clone.object_patches[key] = new


def _rebound(fn, paths, new_root, key):
    """`fn` bound to new_root's module at the path its module had in the original model (through this pack's
    wrappers: classes with WRAPS, the attribute holding the wrapped function, and rewrapped(fn)); `fn` itself when
    there is nothing to rebind."""
    attr = getattr(type(fn), "WRAPS", None)
    if attr is not None and hasattr(fn, "rewrapped"):
        inner = getattr(fn, attr)
        new_inner = _rebound(inner, paths, new_root, key)
        return fn if new_inner is inner else fn.rewrapped(new_inner)
    if inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module) and id(fn.__self__) in paths:
        path = paths[id(fn.__self__)]
        try:
            module = new_root.get_submodule(path)
        except AttributeError:
            raise RuntimeError(
                f"tiled-attention: a clone of this {type(new_root).__name__} holds a different model without the "
                f"module '{path}' that this pack's object patch '{key}' wraps, so the patch cannot follow it. "
                f"Apply the pack's node (FFN Chunking / Patch Attention) after the node that replaces the model."
            ) from None
        return types.MethodType(fn.__func__, module)
    return fn
