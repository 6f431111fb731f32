"""Online tier: the FlashAttention-2 recurrence over key tiles, in plain matmuls.

For each query tile, over key tiles j (fp32 statistics):
    m_j = max(m_{j-1}, rowmax S_j)      P_j = exp(S_j - m_j)       a = exp(m_{j-1} - m_j)
    l_j = a l_{j-1} + rowsum P_j        O_j = a O_{j-1} + P_j V_j
then O = O_last / l_last and L = m + log l. Memory beyond inputs and output: O(block_q * block_kv), one key tile's
scores or weights at a time (device.tile_bytes).
Flush-to-zero here is relative to the running max (as in llama.cpp's kernels).
"""
from __future__ import annotations

import torch

from ..gemm import matmul
from ..numerics import flush_to_zero_, safe_max
from ..tiles import TileOutputs, TileSource, query_tiles


def forward(src: TileSource, block_q: int, block_kv: int, need_stats: bool) -> TileOutputs:
    p, num = src.p, src.num
    res = src.outputs(need_stats)
    st = num.stats
    pv_dtype = torch.float32 if src.pv_needs_fp32(block_kv) else num.compute
    for i0, i1, kend, qt in query_tiles(src, block_q):
        bq, rows = i1 - i0, p.G * (i1 - i0)
        m = torch.full((p.B, p.Hkv, p.G, bq, 1), float("-inf"), dtype=st, device=p.device)
        l = torch.zeros_like(m)
        acc = torch.zeros(p.B, p.Hkv, p.G, bq, p.Ev, dtype=st, device=p.device)
        for j0 in range(0, kend, block_kv):
            j1 = min(kend, j0 + block_kv)
            # fp32 / fp64 tiles: one score buffer reused by every tile (TileSource.scratch: no fresh pages per tile
            # on the CPU), the weights written over it; half tiles: fresh tensors, each let go before the next
            # (scores, then their fp32 weights, then the cast for P V: device.tile_bytes)
            s = src.scores(qt, i0, i1, j0, j1, slot=0 if qt.dtype == st else None)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True).to(st))
            ms = safe_max(m_new)
            w = (s.to(st) if s.dtype != st else s).sub_(ms)  # weights overwrite the score tile where dtypes agree
            del s
            if num.ftz:
                flush_to_zero_(w)
            w.exp_()
            alpha = torch.exp(m - ms)
            l.mul_(alpha).add_(w.sum(-1, keepdim=True))
            if p.dropout_p > 0:
                w.masked_fill_(~src.keep(i0, i1, j0, j1), 0.0)
            pv = matmul(w.view(p.B, p.Hkv, rows, j1 - j0).to(pv_dtype), src.value(j0, j1, pv_dtype),
                        out=src.scratch(2, (p.B, p.Hkv, rows, p.Ev), pv_dtype))
            acc.mul_(alpha).add_(pv.view(p.B, p.Hkv, p.G, bq, p.Ev))
            m = m_new
            del w, pv  # let this key tile's weights go before the next tile's scores are computed
        l_safe = torch.where(l == 0, torch.ones_like(l), l)
        o = acc.div_(l_safe)
        if p.dropout_p > 0:
            o.mul_(1.0 / (1.0 - p.dropout_p))
        res.store(i0, i1, src.unscale(o), m, torch.log(l) if need_stats else None)
    return res
