"""Autocast policy of the engine: cast the inputs exactly as torch's SDPA is cast under torch.autocast, then compute
with autocast off.

torch registers scaled_dot_product_attention under autocast's `lower_precision_fp` policy on every device type it
has an autocast list for (aten/src/ATen/autocast_mode.cpp: CUDA and XPU through AT_FORALL_LOWER_PRECISION_FP, CPU
and MPS by name; out-of-tree PrivateUse1 backends register their own lists, and the engine applies the same rule
there). Its wrapper (autocast_mode.h: WrapFunction_<lower_precision_fp>, cached_cast, is_eligible) casts EVERY
tensor argument - query, key, value and the optional attn_mask - that is

    defined, floating point (fp16, bf16, fp32, fp8, ...; not float64), and on the autocast's device type
    (CUDA also takes XLA tensors)

to torch.get_autocast_dtype(device type), whatever its dtype was (fp16 under a bf16 autocast becomes bf16; under a
float32 autocast, which CUDA accepts, bf16 and fp16 become fp32). float64 tensors, bool masks and tensors on other
device types are left alone; the op then runs with autocast off for every device type. Which autocast applies is
the dispatcher's: the highest backend among the tensor arguments (CUDA over CPU). Whether it is on, and its dtype,
are what torch.is_autocast_enabled(device_type) / torch.get_autocast_dtype(device_type) say: torch.autocast itself
refuses some dtypes (the CPU, XPU, MPS... take bf16 and fp16 only: another dtype warns and leaves autocast off),
and the engine reads the state it left. Checked against torch on torch 2.5.1 and 2.14.1
(tests/engine/test_autocast.py).

Under torch.func.vmap (the innermost transform) torch casts nothing (functorch runs a vmap level below autocast):
neither does the engine (under_vmap()).

The casts are ordinary differentiable .to() calls made before the engine's op, so gradients flow back to each
input in its own dtype, as through torch's casts. Worker threads do not inherit autocast (it is thread-local):
callers that hand work to threads (multidevice.py) apply the rule in the calling thread.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

# device types by the dispatcher's backend priority, lowest first (c10 BackendComponent order): with tensors on
# several device types the autocast of the last one listed here applies
_BACKEND_ORDER = ("cpu", "cuda", "hip", "xla", "mps", "ipu", "xpu", "hpu", "ve", "lazy", "mtia", "maia",
                  "privateuseone")


def autocast_on(device_type: str) -> bool:
    """Whether torch's autocast is enabled for `device_type` on this thread (False for device types autocast does
    not know, such as "meta")."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except (TypeError, RuntimeError):
        return False


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype torch's SDPA would be cast to on `device_type` now, or None when autocast is off there."""
    if not autocast_on(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def dispatch_device_type(tensors) -> Optional[str]:
    """The device type whose autocast torch's dispatcher applies to a call with these arguments (None: no tensor)."""
    best, rank = None, -2
    for t in tensors:  # a plain loop: torch 2.5's dynamo traces no max(key=...)
        if isinstance(t, torch.Tensor):
            d = t.device.type
            r = _BACKEND_ORDER.index(d) if d in _BACKEND_ORDER else -1
            if r > rank:
                best, rank = d, r
    return best


def eligible(t, device_type: str) -> bool:
    """autocast_mode.h's is_eligible: a floating tensor, not float64, on `device_type` (CUDA: or XLA)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == torch.float64:
        return False
    return t.device.type == device_type or (device_type == "cuda" and t.device.type == "xla")


def _is_causal_bias(t) -> bool:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch: no CausalBias
        return False
    return isinstance(t, CausalBias)


def under_vmap() -> bool:
    """Whether torch.func.vmap is the innermost functorch transform now. There torch's SDPA is not cast: functorch
    excludes the autocast dispatch keys while it runs a vmap level (its batching rule, and what that calls, run
    below autocast), so under a bf16 autocast vmap of torch's SDPA returns float32 for float32 inputs, whether or
    not the SDPA's own inputs are batched; grad / jvp as the innermost transform keep autocast (vmap(grad(f)) is
    cast, grad(vmap(f)) is not). Read from functorch's interpreter stack in eager code; inside a torch.compile
    trace it is not read (False: the rule in force when the trace began)."""
    if torch.compiler.is_dynamo_compiling():
        return False
    try:
        from torch._C._functorch import TransformType, peek_interpreter_stack
    except ImportError:  # a torch without functorch
        return False
    top = peek_interpreter_stack()
    return top is not None and top.key() == TransformType.Vmap


def autocast_inputs(query, key, value, attn_mask=None):
    """(query, key, value, attn_mask) as torch's SDPA receives them under the autocast in force on this thread:
    every eligible tensor cast to the autocast dtype, the rest unchanged (a CausalBias mask holds no values:
    torch turns it into is_causal or a bool mask before autocast sees it)."""
    if under_vmap():
        return query, key, value, attn_mask
    mask = None if _is_causal_bias(attn_mask) else attn_mask
    device_type = dispatch_device_type((query, key, value, mask))
    dt = autocast_dtype(device_type) if device_type is not None else None
    if dt is None:
        return query, key, value, attn_mask
    query, key, value = (t.to(dt) if eligible(t, device_type) else t for t in (query, key, value))
    if mask is not None and eligible(mask, device_type):
        attn_mask = mask.to(dt)
    return query, key, value, attn_mask


def no_autocast(device_type: str):
    """A context with autocast off for `device_type` (a no-op context when it is off already)."""
    if not autocast_on(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
