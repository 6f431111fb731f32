"""Recognising out-of-memory errors across backends, and giving cached memory back before a retry."""
from __future__ import annotations

import torch

from .memory import AttentionMemoryError

# lower case; ROCm reports "HIP out of memory" (caught by the first) or only the enum name hipErrorOutOfMemory
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate",
             "hiperroroutofmemory", "hip_error_out_of_memory", "cudaerrormemoryallocation")


def is_oom(e: BaseException) -> bool:
    """torch.OutOfMemoryError, a host MemoryError, or an accelerator error (CUDA or ROCm/HIP) whose message says
    out of memory."""
    if isinstance(e, AttentionMemoryError):
        return False
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    if isinstance(e, (oom_type, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(t in str(e).lower() for t in _OOM_TEXT)


def release_cached(device: torch.device) -> None:
    """Return the allocator's cached blocks so the retry sees them as free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif device.type == "mps" and hasattr(torch, "mps"):
        torch.mps.empty_cache()
    elif device.type == "xpu" and hasattr(torch, "xpu"):
        torch.xpu.empty_cache()
