"""The engine's GEMMs: torch.matmul, except where the shared dimension is 1 (an outer product), which is computed as
the broadcast product instead.

Why: torch's native op overrides (torch._native, in the torch versions that ship it: 2.14.1 here) send aten::bmm of
an outer product, (B, M, 1) x (B, 1, N), on the GPU (the CUDA dispatch key, which ROCm's HIP builds share) to a
Triton kernel. Triton cannot target gfx906 (MI50 / MI60 / Radeon VII), so there such a call fails unless the
overrides are deregistered (the public gfx906 images do that at start-up). torch.matmul of [..., M, 1] and
[..., 1, N] folds its batch dims into exactly such a bmm, and the engine's tiles make one whenever a key tile is one
key wide (a key count one more than a multiple of the tile width: e.g. 4,097 keys in tiles of 64), a backward query
tile is one row high, or the head dim is 1. a * b broadcasts to the same [..., M, N] with the same value in every
element (one product, rounded once to the dtype, as the GEMM rounds its one-term sum) and never reaches bmm. No
other override of this torch covers an op the engine calls on such a GPU (tests/engine/test_native_overrides.py).
"""
from __future__ import annotations

import torch


def matmul(a: torch.Tensor, b: torch.Tensor, out=None) -> torch.Tensor:
    """torch.matmul(a, b[, out=out]) for a, b of at least 2 dims; an outer product (a's last dim 1) as a * b."""
    if a.shape[-1] == 1 and a.dim() >= 2 and b.dim() >= 2:
        return a * b if out is None else torch.mul(a, b, out=out)
    return torch.matmul(a, b) if out is None else torch.matmul(a, b, out=out)
