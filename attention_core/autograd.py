"""Autograd with O(N) memory: save q, k, v, O and the fp32 log-sum-exp L only; recompute scores in backward.

Per tile (FlashAttention-2 backward), with D = rowsum(dO * O):
    P  = exp(S - L)           dV += P^T dO          dP = dO V^T
    dS = P * (dP - D)         dQ  = scale * dS K    dK += scale * dS^T Q
(dropout multiplies P and dP by the same keep bits / (1 - p); GQA sums dK, dV over each head group because the
group's query heads are stacked on the rows of one GEMM; a float mask's gradient is dS summed to its shape.)
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch.autograd.function import once_differentiable

from .memory import AttentionMemoryError, plan_backward, tile_budget
from .numerics import FP16_SAFE, FTZ_THRESHOLD, row_norm_max
from .oom import is_oom, release_cached
from .tiles import TileSource, lazy_source

log = logging.getLogger(__name__)


class TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q5, k4, v4, mask5, problem, num, cfg):
        from .sdpa import run_forward  # sdpa imports this module
        p = dataclasses.replace(problem, q5=q5, k4=k4, v4=v4, mask5=mask5)
        res = run_forward(p, num, cfg, need_stats=True)
        ctx.save_for_backward(q5, k4, v4, mask5, res.out, res.lse, res.rowmax)
        ctx.problem = dataclasses.replace(problem, q5=None, k4=None, v4=None, mask5=None)
        ctx.num, ctx.cfg = num, cfg
        return res.out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q5, k4, v4, mask5, out, lse, rowmax = ctx.saved_tensors
        p = dataclasses.replace(ctx.problem, q5=q5, k4=k4, v4=v4, mask5=mask5)
        need_dmask = bool(ctx.needs_input_grad[3])
        from .sdpa import no_autocast
        with no_autocast(dout.device.type):
            dq, dk, dv, dm = run_backward(p, ctx.num, ctx.cfg, out, lse, rowmax, dout, need_dmask)
        return dq, dk, dv, dm, None, None, None


def run_backward(p, num, cfg, out, lse, rowmax, dout, need_dmask):
    """Gradients for q5, k4, v4 (and mask5), retrying with smaller tiles on out-of-memory."""
    whole = lazy_source(p, num)  # not built when the plan splits heads
    budget = tile_budget(p.device, cfg.memory_budget)
    plan = plan_backward(p, num, budget, cfg.block_q, cfg.block_kv)
    while plan is not None:
        try:
            if plan.block_h >= p.Hkv:
                return _backward(whole(), out, lse, rowmax, dout, plan.block_q, plan.block_kv, need_dmask)
            return _backward_by_heads(p, num, out, lse, rowmax, dout, plan, need_dmask)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
            if not is_oom(e):
                raise
            release_cached(p.device)
            log.info("attention backward out of memory at tiles %dx%d; retrying smaller", plan.block_q,
                     plan.block_kv)
            plan = plan.smaller()
    raise AttentionMemoryError(
        f"Tiled attention backward: even {16}x{16} tiles do not fit for {p.describe()} within a budget of "
        f"{budget / 2**20:.0f} MB. Free memory (smaller batch, fewer frames or a lower resolution) or raise "
        f"memory_budget.")


def _backward_by_heads(p, num, out, lse, rowmax, dout, plan, need_dmask):
    """The backward head group by head group; a mask without heads collects its gradient over all groups."""
    dq = torch.empty(p.q5.shape, dtype=p.q5.dtype, device=p.device)
    dk = torch.empty(p.k4.shape, dtype=p.k4.dtype, device=p.device)
    dv = torch.empty(p.v4.shape, dtype=p.v4.dtype, device=p.device)
    dmask = torch.zeros(p.mask5.shape, dtype=p.mask5.dtype, device=p.device) if need_dmask else None
    for h0 in range(0, p.Hkv, plan.block_h):
        h1 = min(p.Hkv, h0 + plan.block_h)
        sub = p.head_group(h0, h1)
        rm = rowmax[:, h0:h1] if rowmax is not None else None
        gq, gk, gv, gm = _backward(TileSource(sub, num), out[:, h0:h1], lse[:, h0:h1], rm, dout[:, h0:h1],
                                   plan.block_q, plan.block_kv, need_dmask)
        dq[:, h0:h1], dk[:, h0:h1], dv[:, h0:h1] = gq, gk, gv
        if dmask is not None:
            if dmask.shape[1] != 1:
                dmask[:, h0:h1] = gm
            else:
                dmask += gm
    return dq, dk, dv, dmask


def _backward_dtype(src: TileSource, dout: torch.Tensor, block_q: int, block_kv: int):
    """Matmul dtype of the backward: the compute dtype unless fp16 partial sums could overflow."""
    num, p = src.num, src.p
    if num.compute != torch.float16:
        return num.compute
    rows = p.G * block_q
    dpmax = row_norm_max(dout) * row_norm_max(p.v4) / max(1e-6, 1.0 - p.dropout_p)
    qmax = row_norm_max(p.q5) * abs(p.scale)
    bounds = (rows * float(dout.detach().abs().max()) / max(1e-6, 1.0 - p.dropout_p),  # dV partial sums
              dpmax,  # dP
              2 * dpmax * block_kv * src.kmax * abs(p.scale),  # dQ partial sums
              2 * dpmax * rows * qmax)  # dK partial sums
    return torch.float16 if max(bounds) < FP16_SAFE and src._global_ok else torch.float32


def _backward(src: TileSource, out, lse, rowmax, dout, block_q, block_kv, need_dmask):
    p, num = src.p, src.num
    st = num.stats
    cd = _backward_dtype(src, dout, block_q, block_kv)
    B, H, G, Ev, E = p.B, p.Hkv, p.G, p.Ev, p.E
    delta = (dout.to(st) * out.to(st)).sum(-1)  # D = rowsum(dO * O), (B, H, G, Lq)
    do_c = dout.to(cd)
    dq = torch.empty(p.q5.shape, dtype=p.q5.dtype, device=p.device)
    dk = torch.zeros(B, H, p.Lk, E, dtype=st, device=p.device)
    dv = torch.zeros(B, H, p.Lk, Ev, dtype=st, device=p.device)
    dmask = torch.zeros(p.mask5.shape, dtype=st, device=p.device) if need_dmask else None
    k = src.k if src.k.dtype == cd else src.k32
    drop = p.dropout_p > 0
    inv_keep = 1.0 / (1.0 - p.dropout_p) if drop else 1.0
    for i0 in range(0, p.Lq, block_q):
        i1 = min(p.Lq, i0 + block_q)
        bq, rows = i1 - i0, G * (i1 - i0)
        kend = p.key_end(i1)
        qt = src.query_tile(i0, i1, cd)
        dot = do_c[:, :, :, i0:i1].reshape(B, H, rows, Ev)
        L = lse[:, :, :, i0:i1].unsqueeze(-1)
        D = delta[:, :, :, i0:i1].unsqueeze(-1)
        m = rowmax[:, :, :, i0:i1].unsqueeze(-1) if rowmax is not None else None
        dq_t = torch.zeros(B, H, rows, E, dtype=st, device=p.device)
        for j0 in range(0, kend, block_kv):
            j1 = min(kend, j0 + block_kv)
            bk = j1 - j0
            s = src.scores(qt, i0, i1, j0, j1).to(st)
            flushed = (s - m) < FTZ_THRESHOLD if num.ftz and m is not None else None
            prob = s.sub_(L).exp_()  # exp(-inf) = 0 for masked keys and for rows with L = +inf
            if flushed is not None:
                prob.masked_fill_(flushed, 0.0)
                del flushed
            keep = src.keep(i0, i1, j0, j1) if drop else None
            pd = prob.masked_fill(~keep, 0.0).mul_(inv_keep) if drop else prob
            dv[:, :, j0:j1] += torch.matmul(pd.view(B, H, rows, bk).transpose(-1, -2).to(cd), dot).to(st)
            del pd
            vt = src.value(j0, j1, cd)
            dp = torch.matmul(dot, vt.transpose(-1, -2)).view(B, H, G, bq, bk).to(st)
            if drop:
                dp.masked_fill_(~keep, 0.0).mul_(inv_keep)
            ds = prob.mul_(dp.sub_(D))  # dS = P * (dP - D), in the weights' storage
            del dp
            if dmask is not None:
                _accumulate_mask_grad(dmask, ds, i0, i1, j0, j1)
            ds_c = ds.view(B, H, rows, bk).to(cd)
            dq_t += torch.matmul(ds_c, k[:, :, j0:j1]).to(st)
            dk[:, :, j0:j1] += torch.matmul(ds_c.transpose(-1, -2), qt).to(st)
            del ds, ds_c
        dq[:, :, :, i0:i1] = (dq_t * p.scale).view(B, H, G, bq, E)
    return dq, dk.to(p.k4.dtype), dv.to(p.v4.dtype), (dmask.to(p.mask5.dtype) if dmask is not None else None)


def _accumulate_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, i0, i1, j0, j1):
    """dMask = dS summed over the dims the mask broadcasts along."""
    dims = tuple(d for d in range(5) if dmask.shape[d] == 1 and ds.shape[d] != 1)
    g = ds.sum(dim=dims, keepdim=True) if dims else ds
    rows = slice(i0, i1) if dmask.shape[3] != 1 else slice(None)
    cols = slice(j0, j1) if dmask.shape[4] != 1 else slice(None)
    dmask[:, :, :, rows, cols] += g
