"""Autocast policy of the engine: cast inputs as torch's SDPA would, then compute with autocast off.

Under autocast torch's SDPA runs in the autocast dtype (fp32 inputs are cast down); the engine does the same at
its entry, then switches autocast off so the dtypes it picks itself (fp32 tiles of the overflow guard) stay.
"""
from __future__ import annotations

import contextlib

import torch


def autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # older torch / a device type without autocast
        return device_type == "cuda" and torch.is_autocast_enabled()


def autocast_inputs(*tensors):
    """fp32 tensors cast to the autocast dtype when autocast is on for their device; others unchanged."""
    device_type = tensors[0].device.type
    if not autocast_on(device_type):
        return tensors
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


def no_autocast(device_type: str):
    """A context with autocast off for `device_type` (a no-op context when it is off already)."""
    if not autocast_on(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
