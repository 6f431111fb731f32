"""Chunked tier: for each query tile, P = softmax(S) over the full key row (one fused torch kernel), O = P V.

S and P live in scratch buffers reused by every tile (TileSource.scratch); on the CPU P overwrites S (one buffer).

The row statistics for the backward come for free: m = max S, and max P = e^0 / l, so L = m - log(max P).

Score layout (`layout`, chosen per device: profiles.score_layout): "queries" computes S = (scale Q) K^T, softmax
over the last dim, O = P V. "keys" computes the same scores keys-major, S^T = K (scale Q)^T, softmax over dim -2,
O = (P^T)^T V with P^T passed as a transposed view: the same products summed in another memory order, which some
BLAS run faster (issue 18.4). Keys-major applies to calls without mask, causal or dropout (`keys_major_applies`);
other calls run queries-major whatever the layout. Both are exact to rounding; the backward is queries-major.
"""
from __future__ import annotations

import torch

from ..gemm import matmul
from ..numerics import flush_to_zero_, safe_max
from ..tiles import TileOutputs, TileSource, query_tiles


LAYOUTS = ("queries", "keys")


def keys_major_applies(p) -> bool:
    """True when the keys-major layout computes this call: no mask, no causal, no dropout."""
    return p.mask5 is None and not p.causal and p.dropout_p == 0


def forward(src: TileSource, block_q: int, block_kv: int, need_stats: bool, layout: str = "queries") -> TileOutputs:
    p, num = src.p, src.num
    if layout == "keys" and keys_major_applies(p):
        return _forward_keys_major(src, block_q, need_stats)
    res = src.outputs(need_stats)
    for i0, i1, kend, qt in query_tiles(src, block_q):
        s = src.scores(qt, i0, i1, 0, kend, slot=0)
        ftz = num.ftz and s.dtype != torch.float16  # fp16 weights flush by themselves (see numerics)
        may_be_empty = p.mask5 is not None or (p.causal and p.causal_offset < 0)  # rows with no visible key
        m = s.amax(-1, keepdim=True) if (need_stats or ftz or may_be_empty) else None
        if ftz:
            s.sub_(safe_max(m))
            flush_to_zero_(s)
        probs = torch.ops.aten._softmax.out(s, -1, False, out=_softmax_out(src, s))
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
        o = matmul(probs.view(p.B, p.Hkv, p.G * (i1 - i0), kend).to(v.dtype), v)
        del probs
        res.store(i0, i1, src.unscale(o), m, log_l)
    return res


def _forward_keys_major(src: TileSource, block_q: int, need_stats: bool) -> TileOutputs:
    """The chunked loop with keys-major scores S^T (B, Hkv, Lk, G*bq); only for keys_major_applies calls."""
    p, num = src.p, src.num
    res = src.outputs(need_stats)
    for i0, i1, kend, qt in query_tiles(src, block_q):
        k = (src.k if qt.dtype == src.k.dtype else src.k32)[:, :, :kend]
        rows = qt.shape[-2]  # G * (i1 - i0)
        st = matmul(k, qt.transpose(-1, -2), out=src.scratch(0, (p.B, p.Hkv, kend, rows), qt.dtype))
        ftz = num.ftz and st.dtype != torch.float16
        m = st.amax(-2, keepdim=True) if (need_stats or ftz) else None
        if ftz:
            st.sub_(safe_max(m))
            flush_to_zero_(st)
        probs = torch.ops.aten._softmax.out(st, -2, False, out=_softmax_out(src, st))
        del st
        log_l = -torch.log(probs.amax(-2, keepdim=True).to(num.stats)) if need_stats else None
        v = src.value(0, kend, num.compute)
        o = matmul(probs.transpose(-1, -2).to(v.dtype), v)
        del probs
        stats = (lambda t: None if t is None else t.reshape(p.B, p.Hkv, p.G, i1 - i0, 1))
        res.store(i0, i1, src.unscale(o), stats(m), stats(log_l))
    return res


def _softmax_out(src: TileSource, s: torch.Tensor) -> torch.Tensor:
    """Where the tile's softmax goes: over the scores themselves on the CPU, whose softmax kernels write each
    element after its last read of it (bitwise the same result; one score buffer instead of two: half the tile
    memory and traffic), else the second scratch buffer."""
    return s if s.device.type == "cpu" else src.scratch(1, s.shape, s.dtype)
