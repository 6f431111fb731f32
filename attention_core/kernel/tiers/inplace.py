"""In-place tier: for each query tile the score tile itself becomes the weights, S <- exp(S - m), then O = S V / l.

One score tile alive instead of chunked's two, so query tiles can be twice as tall for the same memory.
"""
from __future__ import annotations

import torch

from ..gemm import matmul
from ..numerics import flush_to_zero_, safe_max
from ..tiles import TileOutputs, TileSource, query_tiles


def forward(src: TileSource, block_q: int, block_kv: int, need_stats: bool) -> TileOutputs:
    p, num = src.p, src.num
    res = src.outputs(need_stats)
    for i0, i1, kend, qt in query_tiles(src, block_q):
        s = src.scores(qt, i0, i1, 0, kend, slot=0)  # one buffer reused by every tile (TileSource.scratch)
        m = s.amax(-1, keepdim=True)
        s.sub_(safe_max(m))
        if num.ftz and s.dtype != torch.float16:  # fp16 weights flush by themselves (see numerics)
            flush_to_zero_(s)
        s.exp_()
        l = s.sum(-1, keepdim=True, dtype=num.stats)
        l_safe = torch.where(l == 0, torch.ones_like(l), l)  # rows with every key masked: weights are all 0
        if p.dropout_p > 0:
            s.masked_fill_(~src.keep(i0, i1, 0, kend), 0.0)
        rows = p.G * (i1 - i0)
        if src.pv_needs_fp32(kend):  # unnormalised weights summed over kend keys could overflow fp16: normalise first
            s.div_(l_safe)  # by the fp32 sum: l itself can pass fp16's range (70000 keys of weight 1)
            o = matmul(s.view(p.B, p.Hkv, rows, kend).to(num.compute), src.value(0, kend, num.compute))
        else:
            v = src.value(0, kend, num.compute)
            o = matmul(s.view(p.B, p.Hkv, rows, kend).to(v.dtype), v)
            o = (o.view(p.B, p.Hkv, p.G, i1 - i0, p.Ev).to(num.stats) / l_safe)
        del s
        if p.dropout_p > 0:
            o = o * (1.0 / (1.0 - p.dropout_p))
        res.store(i0, i1, src.unscale(o), m, torch.log(l) if need_stats else None)
        del o  # the next tile's P V product must not find this one still alive
    return res
