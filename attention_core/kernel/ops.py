"""Raw attention ops: forward -> (O, L) and the recompute backward given (O, L). Not differentiable themselves.

Two levels, as in FlashAttention's flash_attn_interface (raw ops, then autograd, then public API):
  forward_canonical / backward_canonical   the canonical layout of problem.py (q5, k4, v4, mask5); the custom
                                           op in autograd.py calls these
  attention_forward / attention_backward   torch's layout ([B, H, L, D], any broadcastable leading dims); the
                                           per-block calls of ring attention (parallel/) use these

L is the log-sum-exp of the scaled, masked scores, in natural log: L_i = log sum_j exp(s_ij) = m_i + log l_i
(FlashAttention's L), float32 (float64 for float64 inputs), shape [B, H, Lq]. A row whose every key is masked
has L = -inf and O = 0 here; torch's math SDPA also gives O = 0 for such rows (torch >= 2.5; older torch and some
fused backends give NaN), and `scaled_dot_product_attention` matches torch.
Dropout: L is of the scores before dropout; the keep bits are a hash of (dropout_seed, head, row, column), so a
backward with the same seed reproduces them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .autocast import autocast_inputs, no_autocast
from .driver import CallConfig, run_backward, run_forward
from .memory import tile_budget
from .numerics import choose_numerics, stats_dtype
from .problem import AttentionProblem, normalize
from .tangents import forward_mode_active

TILE_OPTIONS = ("tier", "block_q", "block_kv", "memory_budget", "precision", "flush_to_zero")


def check_options(tier="auto", block_q=None, block_kv=None, memory_budget=None, precision="auto",
                  flush_to_zero=None):
    """Validate the engine's own options with errors that name them; returns memory_budget as int or None."""
    from .tiers import TIER_CHOICES
    from .numerics import DEPRECATED_PRECISIONS, PRECISIONS
    if tier not in TIER_CHOICES:
        raise ValueError(f"tier must be one of {TIER_CHOICES}, got {tier!r}")
    if precision not in PRECISIONS and precision not in DEPRECATED_PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    if flush_to_zero is not None and not isinstance(flush_to_zero, bool):
        raise ValueError(f"flush_to_zero must be None, True or False, got {flush_to_zero!r}")
    return None if memory_budget is None else tile_budget(torch.device("cpu"), memory_budget)


def _problem(q5, k4, v4, mask5, seed: int, causal: bool, causal_offset: int, scale: float,
             dropout_p: float) -> AttentionProblem:
    return AttentionProblem(q5=q5, k4=k4, v4=v4, mask5=mask5, causal=bool(causal),
                            causal_offset=int(causal_offset), scale=float(scale),
                            dropout_p=float(dropout_p), dropout_seed=int(seed), out_shape=(), squeeze_2d=False)


def forward_canonical(q5, k4, v4, mask5, seed: int, causal: bool, causal_offset: int, scale: float,
                      dropout_p: float, tier="auto", block_q=None, block_kv=None, memory_budget=None, precision="auto",
                      flush_to_zero=None, need_stats: bool = True):
    """(O5 (B, Hkv, G, Lq, Ev) in the input dtype, L and the row max (B, Hkv, G, Lq) in the statistics dtype);
    need_stats=False skips L and the row max (both returned empty, shape (0,))."""
    p = _problem(q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p)
    st = stats_dtype(p.dtype)
    shape = (p.B, p.Hkv, p.G, p.Lq)
    with torch.no_grad(), no_autocast(p.device.type):
        if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:
            out = torch.zeros(*shape, p.Ev, dtype=p.dtype, device=p.device)
            lse = torch.full(shape if need_stats else (0,), float("-inf"), dtype=st, device=p.device)
            return out, lse, lse.clone()
        num = choose_numerics(p.dtype, p.device, precision, (q5, k4, v4), flush_to_zero)
        cfg = CallConfig(tier, block_q, block_kv, memory_budget)
        if p.dropout_p >= 1.0:  # everything dropped: O = 0; L is of the scores, as without dropout
            res = run_forward(replace(p, dropout_p=0.0), num, cfg, need_stats=need_stats)
            res.out.zero_()
        else:
            res = run_forward(p, num, cfg, need_stats=need_stats)
        if not need_stats:
            return res.out, p.q5.new_empty((0,), dtype=st), p.q5.new_empty((0,), dtype=st)
        return res.out, res.lse, res.rowmax


def backward_canonical(dout5, dlse, q5, k4, v4, mask5, out5, lse, rowmax, seed: int, causal: bool,
                       causal_offset: int, scale: float, dropout_p: float, need_dmask: bool = False, tier="auto",
                       block_q=None, block_kv=None, memory_budget=None, precision="auto", flush_to_zero=None):
    """(dq5, dk4, dv4, dmask5 or None) given the forward's O and L (and row max, or None: no flush-to-zero).
    dlse (or None) is the gradient of L: it adds P * dL to dS."""
    p = _problem(q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p)
    with torch.no_grad(), no_autocast(p.device.type):
        if p.Lq == 0 or p.B == 0 or p.Hkv == 0 or p.G == 0 or p.Lk == 0:
            zeros = [torch.zeros_like(t) for t in (q5, k4, v4)]
            return (*zeros, torch.zeros_like(mask5) if need_dmask else None)
        num = choose_numerics(p.dtype, p.device, precision, (q5, k4, v4), flush_to_zero)
        cfg = CallConfig(tier, block_q, block_kv, memory_budget)
        if p.dropout_p >= 1.0:  # O does not depend on q, k, v; only L does
            p, dout5 = replace(p, dropout_p=0.0), torch.zeros_like(dout5)
        return run_backward(p, num, cfg, out5, lse, rowmax, dout5, dlse, need_dmask)


def _seed(dropout_p: float, dropout_seed: Optional[int]) -> int:
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("attention_forward/backward with dropout_p > 0 need dropout_seed (an int), so that the "
                         "backward can recompute the same keep bits")
    return int(dropout_seed or 0)


def attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *, dropout_p=0.0,
                      dropout_seed=None, **engine_kwargs):
    """(out, lse): out as torch's SDPA ([B, H, Lq, Ev], the input dtype); lse [B, H, Lq] (see the module doc).

    engine_kwargs: tier, block_q, block_kv, memory_budget, precision, flush_to_zero (see
    scaled_dot_product_attention). Under torch.autocast the inputs are cast as torch's SDPA casts them (so out is in
    the autocast dtype). Runs without autograd; pair it with attention_backward. Forward-mode AD
    (dual tensors, torch.func.jvp) raises: it would get no tangent here."""
    if forward_mode_active((q, k, v, attn_mask if isinstance(attn_mask, torch.Tensor) else None)):
        raise RuntimeError("attention_core.kernel.ops.attention_forward runs without autograd, so forward-mode AD "
                           "(torch.func.jvp / jacfwd, torch.autograd.forward_ad dual tensors) would get no tangent "
                           "from it: call attention_core.scaled_dot_product_attention(..., return_lse=True) instead, "
                           "which has the forward-mode rule")
    memory_budget = check_options(**engine_kwargs)
    engine_kwargs["memory_budget"] = memory_budget
    q, k, v, attn_mask = autocast_inputs(q, k, v, attn_mask)  # as torch's SDPA under torch.autocast
    with torch.no_grad():
        p = normalize(q, k, v, attn_mask, 0.0, is_causal, scale, enable_gqa)
        out5, lse, _ = forward_canonical(p.q5, p.k4, p.v4, p.mask5, _seed(dropout_p, dropout_seed), p.causal,
                                         p.causal_offset, p.scale, dropout_p, **engine_kwargs)
    out = out5.reshape(p.out_shape)
    lse = lse.reshape(p.out_shape[:-1])
    if p.squeeze_2d:
        return out.squeeze(0), lse.squeeze(0)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, attn_mask=None, is_causal=False, scale=None, enable_gqa=False, *,
                       dropout_p=0.0, dropout_seed=None, dlse=None, **engine_kwargs):
    """(dq, dk, dv) of the attention whose output is `out` and log-sum-exp `lse`, given dL/dout (and dL/dlse).

    With this block's own out and lse these are the full gradients. With the GLOBAL out and lse of a larger
    attention of which (k, v) is one block of keys (ring attention), they are exactly this block's contribution:
    dS = P * (dP - rowsum(dO * O)) with P = exp(S - L) only needs the global O and L, so summing dq over the
    blocks and taking dk, dv per block gives the gradients of the whole attention. Flush-to-zero is not applied.
    Under torch.autocast q, k, v (and a float mask) are cast as attention_forward casts them, and dq, dk, dv come
    back in the dtypes q, k, v were given in (as autograd returns them through torch's own autocast casts)."""
    memory_budget = check_options(**engine_kwargs)
    engine_kwargs["memory_budget"] = memory_budget
    leaves = [t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) else t for t in (q, k, v)]
    with torch.enable_grad():  # autocast's casts and the views from the caller's layout to q5/k4/v4, so autograd
        *cast, attn_mask = autocast_inputs(*leaves, attn_mask)  # sums broadcast dims and returns each gradient
        p = normalize(*cast, attn_mask, 0.0, is_causal, scale, enable_gqa)  # in its input's own dtype
    B, Hkv, G, Lq, Ev = p.B, p.Hkv, p.G, p.Lq, p.Ev
    dq5, dk4, dv4, _ = backward_canonical(
        dout.reshape(B, Hkv, G, Lq, Ev), None if dlse is None else dlse.reshape(B, Hkv, G, Lq),
        p.q5.detach(), p.k4.detach(), p.v4.detach(), p.mask5, out.reshape(B, Hkv, G, Lq, Ev),
        lse.reshape(B, Hkv, G, Lq), None, _seed(dropout_p, dropout_seed), p.causal, p.causal_offset, p.scale,
        dropout_p, False, **engine_kwargs)
    return torch.autograd.grad((p.q5, p.k4, p.v4), leaves, (dq5, dk4, dv4), allow_unused=True)
