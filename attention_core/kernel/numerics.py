"""Half-precision safety: which dtype the tiles compute in, flush-to-zero, overflow guards, dropout bits.

- Softmax statistics (m, l, L = m + log l) and the online accumulator are always fp32 (or fp64 for fp64).
- Flush-to-zero (as llama.cpp): a weight whose score is more than FTZ_THRESHOLD below its row max is exactly 0,
  not e^-20, so tens of thousands of negligible or masked keys add nothing. On in half precision, off otherwise
  (in fp32/fp64 the engine is exact to torch). Weights stored in fp16 need no extra pass: they are
  exp(s - m) / l <= e^-20 < 2.1e-9 there, below half of fp16's smallest subnormal (6e-8), so they round to 0.
- Overflow guard: a score tile whose bound max|q_i| * scale * max|k_j| could pass fp16's 65504 is computed in fp32.
- bf16 -> fp16 only where the device has no bf16 hardware and every value fits fp16's range; else fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FTZ_THRESHOLD = -20.0
FP16_MAX = 65504.0
# keep headroom: a product bound at 1/2 of fp16 max leaves room for the mask add and rounding
FP16_SAFE = FP16_MAX / 2

HALF = (torch.float16, torch.bfloat16)
PRECISIONS = ("auto", "input", "fp16", "fp32")
DEPRECATED_PRECISIONS = {"keep": "input"}  # old engine name; the node's half_precision="keep" means "auto"


@dataclass(frozen=True)
class Numerics:
    """How one call computes: matmul dtype, statistics dtype, flush-to-zero."""
    compute: torch.dtype  # dtype of q/k/v tiles and score GEMMs
    stats: torch.dtype  # dtype of m, l, L and the online accumulator
    ftz: bool


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def choose_numerics(dtype: torch.dtype, device: torch.device, precision: str = "auto",
                    tensors=(), flush_to_zero: Optional[bool] = None) -> Numerics:
    """Pick the compute dtype for inputs of `dtype` on `device`.

    precision: "auto"  - half inputs stay half on accelerators; bf16 becomes fp16 where the device lacks bf16
                         hardware (values permitting); on the CPU half inputs compute in fp32 (faster there).
               "input" - compute in the input dtype as it is (also on the CPU). "keep" is a deprecated alias.
               "fp16"  - bf16 -> fp16 when every value fits fp16's range, else fp32.
               "fp32"  - compute half inputs in fp32.
    """
    precision = DEPRECATED_PRECISIONS.get(precision, precision)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    compute = dtype
    if dtype in HALF:
        if precision == "fp32":
            compute = torch.float32
        elif precision == "fp16" and dtype == torch.bfloat16:
            compute = torch.float16 if fits_fp16(tensors) else torch.float32
        elif precision == "auto":
            if device.type == "cpu":
                compute = torch.float32
            elif dtype == torch.bfloat16 and not _bf16_hardware(device):
                compute = torch.float16 if fits_fp16(tensors) else torch.float32
    ftz = compute in HALF if flush_to_zero is None else bool(flush_to_zero)
    return Numerics(compute=compute, stats=stats_dtype(compute), ftz=ftz)


def _bf16_hardware(device: torch.device) -> bool:
    from ..device.detection import bf16_hardware  # local: detect imports torch backends lazily
    return bf16_hardware(device)


def fits_fp16(tensors) -> bool:
    """True when every finite value of every tensor is within fp16's range (one reduction, one sync)."""
    worst = 0.0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        a = t.detach().abs()
        a = torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device))
        worst = max(worst, float(a.max()))
    return worst < FP16_MAX


def row_norm_max(t: torch.Tensor) -> float:
    """max over rows of the L2 norm along the last dim, in fp32 (bounds any dot product with that row)."""
    if t.numel() == 0:
        return 0.0
    return float(torch.linalg.vector_norm(t.detach().float(), dim=-1).max())


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """Row max with -inf (fully masked rows) replaced by 0, so s - m never makes inf - inf."""
    return torch.where(torch.isneginf(m), torch.zeros((), dtype=m.dtype, device=m.device), m)


def flush_to_zero_(shifted_scores: torch.Tensor) -> torch.Tensor:
    """In place: scores already shifted by the row max; those below FTZ_THRESHOLD become -inf (weight exactly 0)."""
    return torch.nn.functional.threshold_(shifted_scores, FTZ_THRESHOLD, float("-inf"))


_M1 = 0x5851F42D4C957F2D  # odd 64-bit multipliers (PCG, splitmix64), as signed int64
_M2 = -0x40A7B892E31B1A47  # == 0xBF58476D1CE4E5B9 as signed int64
_MASK53 = (1 << 53) - 1


def dropout_keep(seed: int, p: float, head_index: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 Lq: int, Lk: int) -> torch.Tensor:
    """Counter-based dropout: keep[b,h,i,j] is a hash of (seed, b*h, i, j), so the same element gets the same bit
    whatever the tiling (forward tiers and the recompute backward agree). P(keep) = 1 - p."""
    x = (head_index * Lq + rows) * Lk + cols  # int64, broadcasts to the tile
    x = x ^ seed
    x = (x ^ (x >> 31)) * _M1
    x = (x ^ (x >> 29)) * _M2
    x = x ^ (x >> 32)
    threshold = int(p * (1 << 53))
    return (x & _MASK53) >= threshold
