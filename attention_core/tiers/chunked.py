"""Chunked tier: for each query tile, P = softmax(S) over the full key row (one fused torch kernel), O = P V.

S and P live in two scratch buffers reused by every tile (TileSource.scratch).

The row statistics for the backward come for free: m = max S, and max P = e^0 / l, so L = m - log(max P).
"""
from __future__ import annotations

import torch

from ..numerics import flush_to_zero_, safe_max
from ..tiles import TileOutputs, TileSource, query_tiles


def forward(src: TileSource, block_q: int, block_kv: int, need_stats: bool) -> TileOutputs:
    p, num = src.p, src.num
    res = TileOutputs(p, num, need_stats)
    for i0, i1, kend, qt in query_tiles(src, block_q):
        s = src.scores(qt, i0, i1, 0, kend, slot=0)
        ftz = num.ftz and s.dtype != torch.float16  # fp16 weights flush by themselves (see numerics)
        may_be_empty = p.mask5 is not None or (p.causal and p.causal_offset < 0)  # rows with no visible key
        m = s.amax(-1, keepdim=True) if (need_stats or ftz or may_be_empty) else None
        if ftz:
            s.sub_(safe_max(m))
            flush_to_zero_(s)
        probs = torch.ops.aten._softmax.out(s, -1, False, out=src.scratch(1, s.shape, s.dtype))
        del s
        if may_be_empty:
            empty = torch.isneginf(m)
            if bool(empty.any()):  # torch gives 0 for rows with every key masked
                probs.masked_fill_(empty, 0.0)
        log_l = None
        if need_stats:
            log_l = -torch.log(probs.amax(-1, keepdim=True).to(num.stats))
        if p.dropout_p > 0:
            probs.masked_fill_(~src.keep(i0, i1, 0, kend), 0.0).mul_(1.0 / (1.0 - p.dropout_p))
        v = src.value(0, kend, num.compute)
        o = torch.matmul(probs.view(p.B, p.Hkv, p.G * (i1 - i0), kend).to(v.dtype), v)
        del probs
        res.store(i0, i1, src.unscale(o), m, log_l)
    return res
