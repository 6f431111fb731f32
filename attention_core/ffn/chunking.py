"""How many chunks, the pieces, and the chunked computation of FFN chunking.

chunks=0 (auto) sizes one chunk's hidden activation (pre- and post-activation, `hidden` wide: the widest Linear,
else 4 x the input width) to AUTO_SHARE of the device's free memory (4 GiB where the device reports none).
"""
import math

import torch

from ..kernel.memory import free_memory

# share of free memory one chunk's hidden activation may take when chunks=0 (auto)
AUTO_SHARE = 0.25


def hidden_features(module: torch.nn.Module) -> int:
    """Width of the widest Linear inside the module (the hidden size of an MLP); 0 if none."""
    widths = [m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear)]
    widths += [m.out_features for m in module.modules()
               if not isinstance(m, torch.nn.Linear) and isinstance(getattr(m, "out_features", None), int)]
    return max(widths or [0])


def chunk_count(x: torch.Tensor, dim: int, chunks: int, hidden: int) -> int:
    """`chunks` (at most one per token), or for 0 the count whose chunk activation fits AUTO_SHARE of free memory."""
    n = x.shape[dim]
    if chunks > 0:
        return min(chunks, n)
    hidden = hidden or x.shape[-1] * 4
    tokens_elsewhere = x.numel() // max(1, n * x.shape[-1])
    act_bytes = 2 * n * tokens_elsewhere * hidden * x.element_size()  # pre- and post-activation
    free = free_memory(x.device) or (4 << 30)
    return max(1, min(n, math.ceil(act_bytes / max(1, free * AUTO_SHARE))))


def piece_sizes(n: int, chunks: int) -> list:
    """Token counts of torch.chunk(n tokens, chunks)."""
    size = -(-n // chunks)
    return [min(size, n - a) for a in range(0, n, size)]


def run_pieces(forward, x, sizes, dim, args, kwargs):
    """Concatenated outputs of `forward` on pieces of `sizes` tokens; None when an output is not one tensor with
    one row per input token (then chunking cannot represent the module)."""
    out, pos, first_shape = None, 0, None
    for size in sizes:
        y = forward(x.narrow(dim, pos, size), *args, **kwargs)
        if not isinstance(y, torch.Tensor) or y.dim() != x.dim() or y.shape[dim] != size:
            return None
        rest = y.shape[:dim] + y.shape[dim + 1:]
        if first_shape is None:
            first_shape = rest
            shape = list(y.shape)
            shape[dim] = x.shape[dim]
            out = y.new_empty(shape) if len(sizes) > 1 else y
        elif rest != first_shape or y.dtype != out.dtype or y.device != out.device:
            return None
        if len(sizes) > 1:
            out.narrow(dim, pos, size).copy_(y)
        pos += size
        del y
    return out
