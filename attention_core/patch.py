"""Optional global patch of torch.nn.functional.scaled_dot_product_attention, for code outside ComfyUI.

enable() routes SDPA calls on devices that need tiled attention (or every device with force=True) through the
engine; calls it cannot serve (nested tensors, non-float inputs) and devices with fused attention go to the
original. disable() restores the original. Nothing happens at import.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
import torch.nn.functional as F

_lock = threading.Lock()
_original = None
_options: dict = {}
_force = False


def is_enabled() -> bool:
    return _original is not None


def _servable(q, k, v) -> bool:
    return all(isinstance(t, torch.Tensor) and not t.is_nested and t.is_floating_point() and t.dim() >= 2
               for t in (q, k, v))


def _wants_engine(device: torch.device) -> bool:
    if _force:
        return True
    from .detection import needs_tiled
    return needs_tiled(device)


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  **kwargs):
    original = _original
    if original is None or kwargs or not _servable(query, key, value) or not _wants_engine(query.device):
        fn = original or torch.nn.functional.scaled_dot_product_attention
        return fn(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                  enable_gqa=enable_gqa, **kwargs)
    from .sdpa import scaled_dot_product_attention
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        **_options)


def enable(force: bool = False, **options) -> None:
    """Patch torch's SDPA. force=True uses the engine on every device; options (tier, memory_budget, precision,
    ...) are passed to attention_core.scaled_dot_product_attention. Calling it again updates the options."""
    global _original, _options, _force
    with _lock:
        _options = dict(options)
        _force = bool(force)
        if _original is None:
            _original = F.scaled_dot_product_attention
            functools.update_wrapper(_patched_sdpa, _original, updated=())
            F.scaled_dot_product_attention = _patched_sdpa


def disable() -> None:
    """Restore torch's own SDPA."""
    global _original, _options, _force
    with _lock:
        if _original is not None:
            F.scaled_dot_product_attention = _original
        _original, _options, _force = None, {}, False


@contextlib.contextmanager
def patched(force: bool = False, **options):
    """with patched(): ... - the patch for the block, then the previous state back."""
    was = (_original is not None, _force, dict(_options))
    enable(force=force, **options)
    try:
        yield
    finally:
        if was[0]:
            enable(force=was[1], **was[2])
        else:
            disable()
