"""Optional global patch of torch.nn.functional.scaled_dot_product_attention, for code outside ComfyUI.

enable() routes SDPA calls on devices that need tiled attention (or every device with force=True) through the
engine; calls it cannot serve (nested tensors, non-float inputs) and devices with fused attention go to the
original. disable() restores the original. Nothing happens at import.

The patch is on while enable() is in force or any patched() block (in any thread) is open: every block holds a
token, so blocks can nest and overlap across threads in any order and the last one out restores torch's function
(unless enable() holds it). The options in force are the latest still-open block's, else enable()'s. All state
changes happen under one lock.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F

_lock = threading.RLock()
_torch_sdpa = None  # torch's own function, kept once seen (the fallback even after another library wraps ours)
_installed = False  # our function is (or was last put) in F.scaled_dot_product_attention
_global = None  # (force, options) from enable(), None when not enabled
_blocks: list = []  # [(token, force, options)] of open patched() blocks, in entry order
_config = (False, {})  # (force, options) in force; replaced whole, read without the lock


def is_enabled() -> bool:
    return _installed


def _servable(q, k, v) -> bool:
    return all(isinstance(t, torch.Tensor) and not t.is_nested and t.is_floating_point() and t.dim() >= 2
               for t in (q, k, v))


def _wants_engine(device: torch.device, force: bool) -> bool:
    if force:
        return True
    from .detection import needs_tiled
    return needs_tiled(device)


def _is_causal_bias(attn_mask) -> bool:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch
        return False
    return isinstance(attn_mask, CausalBias)


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  **kwargs):
    if not kwargs and _is_causal_bias(attn_mask):
        # torch dispatches CausalBias masks (which hold no values) through __torch_function__ only when the
        # function called IS torch's own; patched, its handler would run them as plain tensors. Call the handler:
        # it raises with is_causal, turns upper-left (and square lower-right) into is_causal=True and
        # materialises lower-right, calling F.scaled_dot_product_attention (this function) again.
        from torch.nn.attention.bias import CausalBias
        return CausalBias._dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                    scale=scale, enable_gqa=enable_gqa)
    original = _torch_sdpa or F.scaled_dot_product_attention
    force, options = _config
    if not _installed or kwargs or not _servable(query, key, value) or not _wants_engine(query.device, force):
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa, **kwargs)
    from .sdpa import scaled_dot_product_attention
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        **options)


def _refresh() -> None:
    """Install or remove the patch and set the options in force from enable()'s and the open blocks' (lock held)."""
    global _torch_sdpa, _installed, _config
    if _blocks:
        _config = (_blocks[-1][1], _blocks[-1][2])
    elif _global is not None:
        _config = _global
    else:
        _config = (False, {})
    want = _global is not None or bool(_blocks)
    if want and not _installed:
        current = F.scaled_dot_product_attention
        if current is not _patched_sdpa:
            _torch_sdpa = current
            functools.update_wrapper(_patched_sdpa, current, updated=())
        F.scaled_dot_product_attention = _patched_sdpa
        _installed = True
    elif not want and _installed:
        if F.scaled_dot_product_attention is _patched_sdpa:  # never undo someone else's later wrapper
            F.scaled_dot_product_attention = _torch_sdpa
        _installed = False


def enable(force: bool = False, **options) -> None:
    """Patch torch's SDPA. force=True uses the engine on every device; options (tier, memory_budget, precision,
    ...) are passed to attention_core.scaled_dot_product_attention. Calling it again updates the options."""
    global _global
    with _lock:
        _global = (bool(force), dict(options))
        _refresh()


def disable() -> None:
    """Restore torch's own SDPA now (open patched() blocks are closed too; their exits then change nothing)."""
    global _global
    with _lock:
        _global = None
        _blocks.clear()
        _refresh()


@contextlib.contextmanager
def patched(force: bool = False, **options):
    """with patched(): ... - the patch for the block, then the previous state back. Safe to nest and to overlap
    across threads; a block inside enable() leaves the global patch on when it exits."""
    token = object()
    with _lock:
        _blocks.append((token, bool(force), dict(options)))
        _refresh()
    try:
        yield
    finally:
        with _lock:
            _blocks[:] = [b for b in _blocks if b[0] is not token]
            _refresh()
