"""This pack's object patches follow ComfyUI's multi-GPU deep clones onto the clone's own model.

ComfyUI (0.33.0 and later) makes a model for another GPU with `ModelPatcher.deepclone_multigpu`: it loads a fresh
copy of the model and carries the object patches over as they are. Each of this pack's object patches (FFN
Chunking's ChunkedFFN, the text-encoder, connector and VAE attention routes) wraps a bound method of a module of
the ORIGINAL model, so without help the clone on the second GPU would call the first GPU's module. The
ON_DEEPCLONE_MULTIGPU callback registered here replaces each of them, on the clone, by the same patch bound to
the same module (by its path) of the clone's model. ComfyUI versions without multi-GPU clones have no such
callback; `register` does nothing there.
"""
from __future__ import annotations

import inspect
import types

import torch

CALLBACK_KEY = "tiled-attention"


def register(patcher) -> None:
    """Make `patcher`'s multi-GPU deep clones rebind this pack's object patches (once per patcher)."""
    try:
        from comfy.patcher_extension import CallbacksMP
    except ImportError:  # not inside ComfyUI
        return
    call = getattr(CallbacksMP, "ON_DEEPCLONE_MULTIGPU", None)
    if call is None or not hasattr(patcher, "add_callback_with_key"):
        return
    patcher.remove_callbacks_with_key(call, CALLBACK_KEY)
    patcher.add_callback_with_key(call, CALLBACK_KEY, rebind_object_patches)


def rebind_object_patches(original, clone) -> None:
    """ON_DEEPCLONE_MULTIGPU callback: each of this pack's object patches on `clone` that wraps a method of a
    module of `original.model` is replaced by a copy wrapping the same method of the same module of
    `clone.model`. Other packs' patches are left as they are."""
    if clone.model is original.model:
        return
    paths = {id(m): name for name, m in original.model.named_modules()}
    for key, patch in list(clone.object_patches.items()):
        new = _rebound(patch, paths, clone.model)
        if new is not patch:
            clone.object_patches[key] = new


def _wrapped(patch):
    """(attribute holding the wrapped function, rebuild(patch, new_function)) for this pack's wrappers (classes
    with WRAPS and rewrapped: ChunkedFFN and the routes), else None."""
    attr = getattr(type(patch), "WRAPS", None)
    if attr is None or not hasattr(patch, "rewrapped"):
        return None
    return attr, lambda p, fn: p.rewrapped(fn)


def _rebound(fn, paths, new_root):
    """`fn` bound to new_root's module at the path its module had in the original model (through this pack's
    wrappers); `fn` itself when there is nothing to rebind."""
    wrapped = _wrapped(fn)
    if wrapped is not None:
        attr, rebuild = wrapped
        inner = getattr(fn, attr)
        new_inner = _rebound(inner, paths, new_root)
        return fn if new_inner is inner else rebuild(fn, new_inner)
    if inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module) and id(fn.__self__) in paths:
        module = new_root.get_submodule(paths[id(fn.__self__)])
        return types.MethodType(fn.__func__, module)
    return fn
