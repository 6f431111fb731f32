"""Score tiles shared by every tier and by the backward: S = (scale*q_i) k_j^T + mask, causal, dropout bits.

A tile covers query rows [i0, i1) of every (batch, head) and keys [j0, j1). Shapes:
    query tile  (B, Hkv, G*bq, E)   scaled by `scale`, in the compute dtype (GQA heads stacked on rows)
    score tile  (B, Hkv, G, bq, bk)
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from .gemm import matmul
from .numerics import FP16_SAFE, Numerics, dropout_keep, row_norm_max
from .problem import AttentionProblem

NEG_INF = float("-inf")


class TileSource:
    """The per-call inputs of the tiles: q/k/v in the compute dtype and the overflow bounds."""

    def __init__(self, p: AttentionProblem, num: Numerics, into: Optional["TileOutputs"] = None):
        self.p = p
        self.num = num
        self._into = into  # the whole problem's outputs when p is one head group of it (outputs())
        cd = num.compute
        # contiguous once: ComfyUI hands heads as a transposed view of [B, N, H*D], and a batched matmul on such
        # a view (or on a head group of it) would copy K or V again for every tile
        self.k = p.k4.to(cd).contiguous()
        self.v = p.v4.to(cd).contiguous()
        self._k32 = None
        self._v32 = None
        # Unnormalised weights (each <= 1) times V summed over a row of Lk keys reach Lk * max|v|: past the range
        # of an fp32 / fp64 accumulator for |v| near its max, where torch's normalised P @ V stays finite. Then V
        # is scaled by an exact power of two v_scale and `unscale` undoes it on the normalised output.
        self.v_scale = 1.0
        self._v_raw = self.v
        if cd in (torch.float32, torch.float64) and p.v4.numel():
            vmax = float(_finite_abs_max(p.v4))
            limit = torch.finfo(cd).max / 4
            if vmax * p.Lk >= limit:
                self.v_scale = 2.0 ** -math.ceil(math.log2(vmax) + math.log2(p.Lk) - math.log2(limit))
                self.v = self.v * self.v_scale
        # fp16 can overflow in the score GEMM (|q.k| * scale > 65504) and in P @ V over many keys.
        self.guard = cd == torch.float16
        self._qbound = None
        if self.guard:
            self.kmax = row_norm_max(p.k4)
            self.vmax = float(p.v4.detach().abs().max()) if p.v4.numel() else 0.0
            self._global_ok = row_norm_max(p.q5) * abs(p.scale) * self.kmax < FP16_SAFE
        if p.dropout_p > 0:
            self.head_index = p.head_index()  # for the counter-based dropout hash
        self._scratch = {}


    def outputs(self, need_stats: bool) -> "TileOutputs":
        """Where a tier writes its results: new tensors, or this head group's heads of the whole problem's."""
        return TileOutputs(self.p, self.num, need_stats, into=self._into)

    def scratch(self, slot: int, shape, dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` backed by buffer `slot`, reused from tile to tile (grown when a
        tile needs more). A tier may hold one result per slot at a time. Why: on the CPU a tile of several MB freed
        and allocated again is handed back to the OS and mapped fresh each time, and the page faults cost as much
        as the softmax itself."""
        n = math.prod(shape)
        buf = self._scratch.get(slot)
        if buf is None or buf.dtype != dtype or buf.numel() < n:
            self._scratch[slot] = None  # let the old buffer go before the larger one is allocated
            buf = self._scratch[slot] = torch.empty(n, dtype=dtype, device=self.p.device)
        return buf[:n].view(shape)

    def release_scratch(self) -> None:
        """Let every scratch buffer go (the caller holds no view of them any more)."""
        self._scratch.clear()

    @property
    def k32(self):
        if self._k32 is None:
            self._k32 = self.p.k4.float()
        return self._k32

    @property
    def v32(self):
        if self._v32 is None:
            self._v32 = self.p.v4.float()
        return self._v32

    def query_tile(self, i0: int, i1: int, dtype=None) -> torch.Tensor:
        """scale * q[rows i0:i1] as (B, Hkv, G*bq, E) in `dtype` (default: the compute dtype)."""
        p = self.p
        q = p.q5[:, :, :, i0:i1]
        dtype = dtype or self.num.compute
        q = q.to(dtype) * p.scale if q.dtype != dtype else q * p.scale
        return q.reshape(p.B, p.Hkv, p.G * (i1 - i0), p.E)

    def tile_needs_fp32(self, i0: int, i1: int) -> bool:
        """True when this query tile's fp16 scores could overflow (bound: |q_i|*scale*max|k|)."""
        if not self.guard or self._global_ok:
            return False
        qn = row_norm_max(self.p.q5[:, :, :, i0:i1])
        return qn * abs(self.p.scale) * self.kmax >= FP16_SAFE

    def pv_needs_fp32(self, keys: int) -> bool:
        """True when an unnormalised weights-times-V product over `keys` keys could pass fp16's range."""
        return self.guard and keys * self.vmax >= FP16_SAFE

    def scores(self, qt: torch.Tensor, i0: int, i1: int, j0: int, j1: int, slot=None) -> torch.Tensor:
        """Masked score tile (B, Hkv, G, bq, bk) in qt's dtype; masked entries are -inf. With `slot`, written
        into that scratch buffer (the previous tile's scores there are overwritten)."""
        p = self.p
        k = self.k if qt.dtype == self.k.dtype else self.k32
        kt = k[:, :, j0:j1].transpose(-1, -2)
        if slot is None:
            s = matmul(qt, kt)
        else:
            s = matmul(qt, kt, out=self.scratch(slot, (p.B, p.Hkv, qt.shape[-2], j1 - j0), qt.dtype))
        s = s.view(p.B, p.Hkv, p.G, i1 - i0, j1 - j0)
        mt = p.mask_tile(i0, i1, j0, j1)
        if mt is not None:
            if mt.dtype == torch.bool:
                s.masked_fill_(~mt, NEG_INF)
            else:
                s.add_(mt)
        if p.causal and j1 - 1 > i0 + p.causal_offset:  # some key in the tile is right of some row's diagonal
            rows = torch.arange(i0 + p.causal_offset, i1 + p.causal_offset, device=s.device).view(-1, 1)
            cols = torch.arange(j0, j1, device=s.device).view(1, -1)
            s.masked_fill_(cols > rows, NEG_INF)
        return s

    def keep(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Dropout keep bits (B, Hkv, G, bq, bk) for this tile, independent of how the call is tiled."""
        p = self.p
        rows = torch.arange(i0, i1, device=p.device, dtype=torch.int64).view(-1, 1)
        cols = torch.arange(j0, j1, device=p.device, dtype=torch.int64).view(1, -1)
        return dropout_keep(p.dropout_seed, p.dropout_p, self.head_index, rows, cols, p.Lq, p.Lk)

    def unscale(self, o: torch.Tensor) -> torch.Tensor:
        """A normalised output computed from `value` tiles, back to V's scale."""
        return o if self.v_scale == 1.0 else o / self.v_scale

    def value(self, j0: int, j1: int, dtype, raw: bool = False) -> torch.Tensor:
        """V tile of keys [j0, j1) in `dtype`, times v_scale unless raw (see __init__)."""
        if raw and self.v_scale != 1.0:
            return self._v_raw[:, :, j0:j1]
        v = self.v if dtype == self.v.dtype else (self.v32 if dtype == torch.float32 else self.v.to(dtype))
        return v[:, :, j0:j1]


def _finite_abs_max(t: torch.Tensor) -> float:
    """max |t| over its finite elements (0 if none). One min/max pass without temporaries in the common case
    that both are finite; a tensor holding inf or nan takes the slower masked pass."""
    lo, hi = torch.aminmax(t.detach())
    lo, hi = float(lo), float(hi)
    if math.isfinite(lo) and math.isfinite(hi):
        return max(-lo, hi)
    a = t.detach().abs()
    return float(torch.where(torch.isfinite(a), a, torch.zeros((), dtype=a.dtype, device=a.device)).max())


def lazy_source(p: AttentionProblem, num: Numerics):
    """A function giving the problem's TileSource, built on first use and kept (it copies K and V)."""
    built = []

    def source() -> "TileSource":
        if not built:
            built.append(TileSource(p, num))
        return built[0]
    return source


def query_tiles(src: "TileSource", block_q: int):
    """(i0, i1, key_end, scaled query tile) for each query tile; a tile the overflow guard flags is fp32."""
    p = src.p
    for i0 in range(0, p.Lq, block_q):
        i1 = min(p.Lq, i0 + block_q)
        yield i0, i1, p.key_end(i1), src.query_tile(i0, i1, torch.float32 if src.tile_needs_fp32(i0, i1) else None)


class TileOutputs:
    """The result of a forward: O (B, Hkv, G, Lq, Ev) in the input dtype and, for the backward, the fp32 row
    statistics L = m + log l (the log-sum-exp of the row's scaled, masked scores; -inf for a row with no visible
    key) and the row max m (flush-to-zero in the backward is relative to it)."""

    def __init__(self, p: AttentionProblem, num: Numerics, need_stats: bool, into: Optional["TileOutputs"] = None):
        """into: the whole problem's outputs when p is one head group of it (problem.head_group): this group's
        results are written straight into their heads there (views), not assembled in a copy first."""
        self.p = p
        if into is not None:
            heads = slice(p.head_offset - into.p.head_offset, p.head_offset - into.p.head_offset + p.Hkv)
            self.out = into.out[:, heads]
            self.lse = into.lse[:, heads] if into.lse is not None else None
            self.rowmax = into.rowmax[:, heads] if into.rowmax is not None else None
            return
        shape = (p.B, p.Hkv, p.G, p.Lq)
        self.out = torch.empty(*shape, p.Ev, dtype=p.dtype, device=p.device)
        self.lse = torch.empty(shape, dtype=num.stats, device=p.device) if need_stats else None
        self.rowmax = torch.empty(shape, dtype=num.stats, device=p.device) if need_stats else None

    def store(self, i0: int, i1: int, o: torch.Tensor, m=None, log_l=None):
        """o: (B, Hkv, G*bq, Ev) or (B, Hkv, G, bq, Ev); m, log_l: (B, Hkv, G, bq, 1) or None."""
        p = self.p
        self.out[:, :, :, i0:i1] = o.view(p.B, p.Hkv, p.G, i1 - i0, p.Ev)
        if self.lse is not None:
            m = m.to(self.lse.dtype)
            lse = torch.where(torch.isneginf(m), m, m + log_l.to(self.lse.dtype))
            self.lse[:, :, :, i0:i1] = lse.squeeze(-1)
            if self.rowmax is not None:
                self.rowmax[:, :, :, i0:i1] = m.squeeze(-1)
