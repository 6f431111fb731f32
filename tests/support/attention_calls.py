"""Counts the attention calls that reach ComfyUI's own attention functions (and torch's SDPA) in this process.

`count_comfy_attention()` wraps, for the duration of a `with` block, every ComfyUI attention backend
(`comfy.ldm.modules.attention.attention_*`, the VAE's `normal_attention` / `pytorch_attention` /
`xformers_attention`) wherever a loaded `comfy.*` module holds it, plus `torch.nn.functional.
scaled_dot_product_attention`. Only the outermost call counts (attention_pytorch calling torch's SDPA is one call), and
a call that ComfyUI's wrapper hands to a `transformer_options` override is not ComfyUI's (the override counts it).
Models built inside the block hold the counting wrappers (the VAE picks its function at build time).
"""
import contextlib
import functools
import sys
import threading

import torch

OVERRIDE_KEY = "optimized_attention_override"


class Counts:
    def __init__(self):
        self.by_function = {}
        self.local = threading.local()

    @property
    def total(self):
        return sum(self.by_function.values())

    def reset(self):
        self.by_function.clear()


def _backends():
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.modules.diffusionmodules.model as vae_model
    found = {}
    for name in dir(attention):
        fn = getattr(attention, name)
        if name.startswith("attention_") and callable(fn):
            found[id(fn)] = (f"attention.{name}", fn)
    for name in ("normal_attention", "pytorch_attention", "xformers_attention"):
        fn = getattr(vae_model, name, None)
        if fn is not None:
            found[id(fn)] = (f"vae.{name}", fn)
    return found


def _counting(fn, label, counts):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        options = kwargs.get("transformer_options") or {}
        diverted = OVERRIDE_KEY in options and "_inside_attn_wrapper" not in kwargs
        depth = getattr(counts.local, "depth", 0)
        if depth == 0 and not diverted:
            counts.by_function[label] = counts.by_function.get(label, 0) + 1
        counts.local.depth = depth + 1
        try:
            return fn(*args, **kwargs)
        finally:
            counts.local.depth = depth
    if hasattr(fn, "container_function"):
        counted.container_function = fn.container_function
    return counted


@contextlib.contextmanager
def count_comfy_attention():
    """Yields a Counts whose .total is the number of attention calls ComfyUI's own functions ran."""
    counts = Counts()
    backends = _backends()
    wrappers = {key: _counting(fn, label, counts) for key, (label, fn) in backends.items()}
    restore = []
    for name, module in list(sys.modules.items()):
        if not (name == "comfy" or name.startswith("comfy.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in wrappers and backends[id(value)][1] is value:
                restore.append((module, attr, value))
                setattr(module, attr, wrappers[id(value)])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _counting(sdpa, "torch.sdpa", counts)
    try:
        yield counts
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for module, attr, value in restore:
            setattr(module, attr, value)
