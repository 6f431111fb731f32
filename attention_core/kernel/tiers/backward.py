"""The recompute backward of one tiling (FlashAttention-2 backward), given O and the log-sum-exp L.

Per tile, with D = rowsum(dO * O) - dL (dL: the gradient of L itself, zero unless the caller uses L):
    P  = exp(S - L)           dV += P^T dO          dP = dO V^T
    dS = P * (dP - D)         dQ  = scale * dS K    dK += scale * dS^T Q
(dropout multiplies P and dP by the same keep bits / (1 - p); GQA sums dK, dV over each head group because the
group's query heads are stacked on the rows of one GEMM; a float mask's gradient is dS summed to its shape.)
O and L may come from a larger attention (ring attention's global O and L): the result is then exactly this
block's contribution to the gradients. L = -inf (a row with no visible key) gives P = 0 on that row.
When the GEMMs run in the statistics dtype (fp32 / fp64 compute), S and dP live in reused scratch buffers and dQ,
dK, dV accumulate in place (baddbmm): no tile-sized temporaries, which on the CPU cost page faults per tile. There
dK and dV accumulate transposed, dK^T += Q^T dS and dV^T += dO^T P, so the score-sized operand of those GEMMs is
read in its own row-major layout: a transposed tile as the GEMM's first operand ran at 75-80 % of the rate on the
CPU (148 vs 188 GFLOP/s at 8 heads x 128 rows x 2048 keys x 64 dims).
"""
from __future__ import annotations

import torch

from ..gemm import matmul
from ..numerics import FP16_SAFE, FTZ_THRESHOLD, row_norm_max
from ..tiles import TileSource


def backward_dtype(src: TileSource, dout: torch.Tensor, block_q: int, block_kv: int):
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


def backward(src: TileSource, out, lse, rowmax, dout, dlse, block_q, block_kv, need_dmask):
    """(dq5, dk4, dv4, dmask5 or None) for the problem of `src`; rowmax (or None: no flush) as in the forward."""
    p, num = src.p, src.num
    st = num.stats
    cd = backward_dtype(src, dout, block_q, block_kv)
    B, H, G, Ev, E = p.B, p.Hkv, p.G, p.Ev, p.E
    delta = (dout.to(st) * out.to(st)).sum(-1)  # D = rowsum(dO * O), (B, H, G, Lq)
    if dlse is not None:  # dS += P * dL
        delta = delta - dlse.to(st)
    # L = -inf (no visible key): +inf makes exp(S - L) = 0 for every S there, -inf scores included
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse.to(st))
    do_c = dout.to(cd)
    dq = torch.empty(p.q5.shape, dtype=p.q5.dtype, device=p.device)
    fused = cd == st  # accumulate in place (baddbmm) into the fp32/fp64 sums, tiles in reused scratch buffers
    if fused:  # dK^T, dV^T: (B * H, E / Ev, Lk)
        dkt = torch.zeros(B * H, E, p.Lk, dtype=st, device=p.device)
        dvt = torch.zeros(B * H, Ev, p.Lk, dtype=st, device=p.device)
    else:
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
            s = src.scores(qt, i0, i1, j0, j1, slot=0 if qt.dtype == st else None).to(st)
            flushed = (s - m) < FTZ_THRESHOLD if num.ftz and m is not None else None
            prob = s.sub_(L).exp_()  # exp(-inf) = 0 for masked keys and for rows with L = +inf
            if flushed is not None:
                prob.masked_fill_(flushed, 0.0)
                del flushed
            keep = src.keep(i0, i1, j0, j1) if drop else None
            pd = prob.masked_fill(~keep, 0.0).mul_(inv_keep) if drop else prob
            vt = src.value(j0, j1, cd, raw=True)
            if fused:
                dvt[:, :, j0:j1].baddbmm_(dot.reshape(B * H, rows, Ev).transpose(-1, -2), pd.view(B * H, rows, bk))
                dp = matmul(dot, vt.transpose(-1, -2), out=src.scratch(1, (B, H, rows, bk), cd))
                dp = dp.view(B, H, G, bq, bk)
            else:
                dv[:, :, j0:j1] += matmul(pd.view(B, H, rows, bk).transpose(-1, -2).to(cd), dot).to(st)
                dp = matmul(dot, vt.transpose(-1, -2)).view(B, H, G, bq, bk).to(st)
            del pd
            if drop:
                dp.masked_fill_(~keep, 0.0).mul_(inv_keep)
            ds = prob.mul_(dp.sub_(D))  # dS = P * (dP - D), in the weights' storage
            del dp
            if dmask is not None:
                _accumulate_mask_grad(dmask, ds, i0, i1, j0, j1)
            if fused:
                ds3 = ds.view(B * H, rows, bk)
                dq_t.view(B * H, rows, E).baddbmm_(ds3, k[:, :, j0:j1].reshape(B * H, bk, E))
                dkt[:, :, j0:j1].baddbmm_(qt.reshape(B * H, rows, E).transpose(-1, -2), ds3)
                del ds3
            else:
                ds_c = ds.view(B, H, rows, bk).to(cd)
                dq_t += matmul(ds_c, k[:, :, j0:j1]).to(st)
                dk[:, :, j0:j1] += matmul(ds_c.transpose(-1, -2), qt).to(st)
                del ds_c
            del ds
        dq[:, :, :, i0:i1] = (dq_t * p.scale).view(B, H, G, bq, E)
    if fused:  # back to (B, H, Lk, E / Ev), once the tile buffers are gone (they are the peak, not these copies)
        s = prob = None
        src.release_scratch()
        dk = dkt.view(B, H, E, p.Lk).transpose(-1, -2).contiguous()
        del dkt
        dv = dvt.view(B, H, Ev, p.Lk).transpose(-1, -2).contiguous()
        del dvt
    return dq, dk.to(p.k4.dtype), dv.to(p.v4.dtype), (dmask.to(p.mask5.dtype) if dmask is not None else None)


def _accumulate_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, i0, i1, j0, j1):
    """dMask = dS summed over the dims the mask broadcasts along."""
    dims = tuple(d for d in range(5) if dmask.shape[d] == 1 and ds.shape[d] != 1)
    g = ds.sum(dim=dims, keepdim=True) if dims else ds
    rows = slice(i0, i1) if dmask.shape[3] != 1 else slice(None)
    cols = slice(j0, j1) if dmask.shape[4] != 1 else slice(None)
    dmask[:, :, :, rows, cols] += g
