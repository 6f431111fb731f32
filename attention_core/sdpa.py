"""The public entry point: torch's SDPA arguments and semantics in, the engine's custom op called, torch's layout out.

Validates the engine's options, applies torch's autocast rule (kernel/autocast.py: q, k, v and a float mask cast to
the autocast dtype), checks torch's arguments as torch does (problem.py), normalises the call to the canonical layout
(problem.py; CausalBias masks included) and calls tiled_attention::fwd (autograd.py), which plans tiles inside.
"""
from __future__ import annotations

import torch

from .kernel.autocast import autocast_inputs
from .kernel.autograd import tiled_attention
from .kernel.ops import check_options
from .kernel.problem import empty_result, normalize
from .kernel.tiers import TIER_CHOICES

__all__ = ["scaled_dot_product_attention", "TIER_CHOICES"]


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False, tier="auto", block_q=None, block_kv=None, memory_budget=None,
                                 precision="auto", flush_to_zero=None, return_lse=False, count_as=""):
    """torch.nn.functional.scaled_dot_product_attention, computed in tiles with O(N) memory.

    Same arguments and result as torch's (math backend; attn_mask may be a tensor or a CausalBias; scale and
    enable_gqa keyword-only, as torch's), the same refusals (exception types of torch's: TypeError for a non-bool
    is_causal, a scale given as a fractions.Fraction or as a 7th positional argument, RuntimeError for a float64
    mask with a float32 query, ...), torch's zeros where value holds no elements, and, under torch.autocast, the same casts (dtype in, dtype out); plus:
      tier           "auto" (largest tier that fits free memory), "chunked", "inplace" or "online" (TIER_CHOICES)
      block_q/_kv    force tile sizes (tests; "auto" sizes them from memory)
      memory_budget  bytes the tiles may use (default: a share of the device's free memory)
      precision      compute dtype for half inputs: "auto" (half on accelerators, fp32 on the CPU, bf16 -> fp16
                     without bf16 hardware), "input" (the input dtype as it is), "fp16" (bf16 -> fp16 when the
                     values fit), "fp32". "keep" is a deprecated alias of "input".
      flush_to_zero  weights more than e^-20 below the row max become exactly 0 (default: on in half precision)
      return_lse     also return L = log sum_j exp(s_ij) of the scaled, masked scores, [..., H, Lq], float32
                     (float64 for float64 inputs), -inf on rows with no visible key; differentiable: (out, lse)
      count_as       a key under which the engine counts this call where it runs (attention_core.kernel.counts;
                     inside torch.compile graphs too): for routers that report their calls; "" counts nothing
    Works under torch.compile(fullgraph=True), torch.func transforms and double backward (see autograd.py).
    """
    memory_budget = check_options(tier, block_q, block_kv, memory_budget, precision, flush_to_zero)
    if not isinstance(count_as, str):
        raise TypeError(f"scaled_dot_product_attention: count_as must be a str (a count key, '' for none), got "
                        f"{type(count_as).__name__}")
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"scaled_dot_product_attention: query must be a tensor, got {type(query).__name__}")
    query, key, value, attn_mask = autocast_inputs(query, key, value, attn_mask)  # as torch's SDPA, before its checks
    empty = empty_result(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if empty is not None:  # torch's zeros (no engine call: nothing to count)
        if not return_lse:
            return empty
        return empty, torch.full(empty.shape[:-1], float("-inf"), dtype=_lse_dtype(empty.dtype), device=empty.device)
    p = normalize(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, draw_seed=False)
    seed = torch.randint(0, 2 ** 62, (), dtype=torch.int64) if p.dropout_p > 0 else None
    out5, lse = tiled_attention(p.q5, p.k4, p.v4, p.mask5, seed, p.causal, p.causal_offset, p.scale, p.dropout_p,
                                tier, block_q, block_kv, memory_budget, precision, flush_to_zero, need_lse=return_lse,
                                count_as=count_as)
    out = out5.reshape(p.out_shape)
    if not return_lse:
        return out.squeeze(0) if p.squeeze_2d else out
    lse = lse.reshape(p.out_shape[:-1])
    return (out.squeeze(0), lse.squeeze(0)) if p.squeeze_2d else (out, lse)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32
