"""The per-block primitive of sequence-parallel attention: (out, lse) of the queries against one K/V block, its
exact backward given the GLOBAL out and lse, and the log-sum-exp merge of two partial results. Built on the engine's
raw ops (attention_core.kernel.ops); no communication."""
from __future__ import annotations

import torch

from ..kernel.ops import attention_backward, attention_forward, backward_canonical, check_options
from ..kernel.problem import normalize


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _repeat_kv(t, groups):
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def block_forward(q, k, v, mask, causal, scale, engine_kwargs):
    """(out, lse) of q against one K/V block (GQA when k has fewer heads); lse fp32 (fp64 for fp64 inputs)."""
    return attention_forward(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                             enable_gqa=q.shape[1] != k.shape[1], **engine_kwargs)


def block_backward(dout, q, k, v, out, lse, mask, causal, scale, engine_kwargs, dlse=None, need_dmask=False):
    """(dq, dk, dv, dmask or None) in the accumulation dtype (dmask: the mask's own shape and dtype): this block's
    exact contribution given the global out and lse (and dlse, the gradient of the global lse, or None)."""
    acc = _acc_dtype(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if not need_dmask:
        dq, dk, dv = attention_backward(dout, q, k, v, out, lse, attn_mask=mask, is_causal=causal, scale=scale,
                                        enable_gqa=gqa, dlse=dlse, **engine_kwargs)
        return dq.to(acc), dk.to(acc), dv.to(acc), None
    # as ops.attention_backward, plus the mask's gradient dS (summed over the mask's broadcast dims)
    kw = dict(engine_kwargs, memory_budget=check_options(**engine_kwargs))
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v, mask)]
    with torch.enable_grad():  # the views to the canonical layout, so autograd sums what was broadcast
        p = normalize(*leaves[:3], leaves[3], 0.0, causal, scale, gqa)
    B, Hkv, G, Lq, Ev = p.B, p.Hkv, p.G, p.Lq, p.Ev
    dq5, dk4, dv4, dm5 = backward_canonical(
        dout.reshape(B, Hkv, G, Lq, Ev), None if dlse is None else dlse.reshape(B, Hkv, G, Lq),
        p.q5.detach(), p.k4.detach(), p.v4.detach(), p.mask5.detach(), out.reshape(B, Hkv, G, Lq, Ev),
        lse.reshape(B, Hkv, G, Lq), None, 0, p.causal, p.causal_offset, p.scale, 0.0, True, **kw)
    dq, dk, dv, dm = torch.autograd.grad((p.q5, p.k4, p.v4, p.mask5), leaves, (dq5, dk4, dv4, dm5),
                                         allow_unused=True)
    return dq.to(acc), dk.to(acc), dv.to(acc), dm


def merge_partial(out_a, lse_a, out_b, lse_b):
    """Merge two partial attentions over disjoint key sets: lse = logaddexp, out weighted by e^(lse_x - lse).

    out_a is the running result in the accumulation dtype (updated in place); rows with no key yet have lse -inf and
    out 0, and stay so until a block brings keys."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    s = wa + wb
    lse_a.copy_(m + torch.log(s))
    s = torch.where(s > 0, s, torch.ones_like(s))
    out_a.mul_((wa / s)[..., None]).add_(out_b.to(out_a.dtype) * (wb / s)[..., None])
