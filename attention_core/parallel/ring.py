"""Ring sequence parallelism: K/V blocks pass around the ring, each step's partial (out, lse) merged with the
log-sum-exp; causal attention load-balanced by the zigzag chunk order (the contract: attention_core.parallel's
docstring)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..sdpa import scaled_dot_product_attention
from .blocks import _acc_dtype, block_backward, block_forward, merge_partial
from .group import _a2a, _agreed, _comm_device, _mask4, _no_heads, _not_traced, _settle


def zigzag_chunks(rank: int, world: int) -> List[int]:
    """The two of 2P equal chunks of the sequence that `rank` works on in the load-balanced causal ring."""
    return [rank, 2 * world - 1 - rank]


def _move_chunks(x, before: List[List[int]], after: List[List[int]], rank: int, group):
    """Redistribute equal chunks along dim -2: rank i holds chunks before[i] (in that order), afterwards after[i]."""
    owner_after = {c: i for i, cs in enumerate(after) for c in cs}
    owner_before = {c: i for i, cs in enumerate(before) for c in cs}
    mine = before[rank]
    B, H, n, D = x.shape
    c = n // len(mine)
    pieces = x.reshape(B, H, len(mine), c, D).permute(2, 0, 1, 3, 4)  # [chunks, B, H, c, D]
    order = sorted(range(len(mine)), key=lambda j: (owner_after[mine[j]], mine[j]))
    send_splits = [sum(1 for j in order if owner_after[mine[j]] == d) for d in range(len(after))]
    arriving = sorted(after[rank], key=lambda ch: (owner_before[ch], ch))
    recv_splits = [sum(1 for ch in arriving if owner_before[ch] == s) for s in range(len(before))]
    recv = _a2a(pieces[order], group, recv_splits, send_splits)
    pos = {ch: i for i, ch in enumerate(arriving)}
    recv = recv[[pos[ch] for ch in after[rank]]]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H, n, D)


class _MoveChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, before, after, rank, group):
        ctx.args = (before, after, rank, group)
        return _move_chunks(x, before, after, rank, group)

    @staticmethod
    def backward(ctx, g):
        before, after, rank, group = ctx.args
        return _move_chunks(g.contiguous(), after, before, rank, group), None, None, None, None


@dataclass
class _Ring:
    group: object
    rank: int
    world: int
    seg: List[int]  # global chunk ids this rank holds, in local order (1 chunk: contiguous, 2: zigzag)
    chunk: int  # tokens per chunk
    causal: bool
    scale: float
    mask: Optional[torch.Tensor]  # [Bm, Hm, Rm, N] rows local, columns global
    engine_kwargs: dict
    fn: str = "ring_attention"
    device: torch.device = torch.device("cpu")  # where the agreement's small tensors live (CPU for gloo)

    def peer(self, r):
        r %= self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def chunks_of(self, r):
        return [r] if len(self.seg) == 1 else zigzag_chunks(r % self.world, self.world)

    def mask_block(self, m, rows: slice, kc: int):
        """The part of a mask-shaped tensor m for query rows `rows` (local) and key chunk kc (a view)."""
        c = self.chunk
        if m.shape[2] > 1:
            m = m[:, :, rows]
        if m.shape[3] > 1:
            m = m[..., kc * c:(kc + 1) * c]
        return m

    def pairs(self, owner):
        """(q slice, k slice, causal diagonal?, mask) for each chunk pair of my queries x owner's keys that is
        not entirely above the diagonal."""
        c = self.chunk
        for i, qc in enumerate(self.seg):
            for j, kc in enumerate(self.chunks_of(owner)):
                if self.causal and kc > qc:
                    continue
                m = None if self.mask is None else self.mask_block(self.mask, slice(i * c, (i + 1) * c), kc)
                yield slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), self.causal and kc == qc, m


def _exchange(ring: _Ring, tensors):
    """Start sending `tensors` to rank+1 and receiving the same shapes from rank-1; returns (recv, works)."""
    recv = [torch.empty_like(t) for t in tensors]
    works = []
    for t, r in zip(tensors, recv):
        works.append(dist.isend(t.contiguous(), ring.peer(ring.rank + 1), group=ring.group))
        works.append(dist.irecv(r, ring.peer(ring.rank - 1), group=ring.group))
    return recv, works


def _wait(works):
    for w in works:
        w.wait()


class _RingAttention(torch.autograd.Function):
    """(out, lse) of the ring; inputs q, k, v and the 4-D mask (for its gradient; the ring reads ring.mask).

    Communication never stops half way: if this rank's compute fails (out of memory, no tile fitting the budget),
    it keeps passing K/V (and in backward the dK/dV accumulators) round the ring until every posted send and
    receive has completed, then _settle makes every rank raise. So an error leaves the group usable."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ring: _Ring):
        ctx.set_materialize_grads(False)
        acc = _acc_dtype(q.dtype)
        B, H, n, _ = q.shape
        out = torch.zeros(B, H, n, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((B, H, n), float("-inf"), dtype=acc, device=q.device)
        kv = [k.contiguous(), v.contiguous()]
        error = None
        for step in range(ring.world):
            owner = (ring.rank - step) % ring.world
            nxt, works = _exchange(ring, kv) if step + 1 < ring.world else (None, [])
            if error is None:
                try:
                    for qs, ks, diag, m in ring.pairs(owner):
                        o_b, l_b = block_forward(q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], m, diag, ring.scale,
                                                 ring.engine_kwargs)
                        merge_partial(out[:, :, qs], lse[:, :, qs], o_b, l_b)
                except Exception as e:  # noqa: BLE001 - drained and settled below
                    error = e
            _wait(works)
            kv = nxt
        _settle(ring.fn, ring.group, ring.device, error)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        acc = _acc_dtype(q.dtype)
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        need_dmask = ring.mask is not None and ctx.needs_input_grad[3]
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dmask = torch.zeros(ring.mask.shape, dtype=acc, device=q.device) if need_dmask else None
        kv = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros(k.shape, dtype=acc, device=q.device), torch.zeros(v.shape, dtype=acc, device=q.device)]
        error = None
        for step in range(ring.world):
            owner = (ring.rank - step) % ring.world
            nxt, works = _exchange(ring, kv) if step + 1 < ring.world else (None, [])
            if error is None:
                try:
                    for qs, ks, diag, m in ring.pairs(owner):
                        gq, gk, gv, gm = block_backward(
                            dout[:, :, qs], q[:, :, qs], kv[0][:, :, ks], kv[1][:, :, ks], out[:, :, qs],
                            lse[:, :, qs], m, diag, ring.scale, ring.engine_kwargs,
                            None if dlse is None else dlse[:, :, qs], need_dmask)
                        dq[:, :, qs] += gq
                        dkv[0][:, :, ks] += gk
                        dkv[1][:, :, ks] += gv
                        if need_dmask:  # a mask comes only without zigzag: one chunk a rank, its key chunk = owner
                            ring.mask_block(dmask, qs, owner)[...] += gm
                except Exception as e:  # noqa: BLE001 - drained and settled below
                    error = e
            # the accumulators follow their block: after the last step one more hop brings them home
            dkv, dworks = _exchange(ring, dkv)
            _wait(works + dworks)
            kv = nxt
        _settle(ring.fn, ring.group, ring.device, error)
        dm = dmask.to(ring.mask.dtype) if need_dmask else None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dm, None


@_not_traced
def ring_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                   group=None, return_lse=False, **engine_kwargs):
    """This rank's slice of full attention over a sequence sharded across `group` (see the module docstring):
    K/V blocks around the ring, partial results merged with their log-sum-exp; causal runs load-balanced.
    return_lse=True: (out, lse), lse [B, H, N/P] this rank's rows (as the engine's return_lse)."""
    fn = "ring_attention"
    rank, P, q, k, v, attn_mask = _agreed(fn, group, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          engine_kwargs, return_lse)
    if dropout_p > 0:
        raise NotImplementedError(f"{fn}: dropout_p={dropout_p} is not supported by the ring (its blocks would "
                                  f"need one dropout pattern across ranks); use ulysses_attention for dropout.")
    B, H, n, E = q.shape
    mask = _mask4(attn_mask, B, H, n, n * P, fn)
    if H == 0:  # every rank agreed on no heads: torch's empty result, nothing to exchange
        return _no_heads(q, k, v, mask, return_lse)
    scale = 1.0 / math.sqrt(E) if scale is None else float(scale)
    if P == 1:
        return scaled_dot_product_attention(q, k, v, mask, 0.0, is_causal, scale=scale, enable_gqa=enable_gqa,
                                            return_lse=return_lse, **engine_kwargs)
    device = _comm_device(group, q)
    zigzag = is_causal and n % 2 == 0
    if zigzag:
        before = [[2 * r, 2 * r + 1] for r in range(P)]
        after = [zigzag_chunks(r, P) for r in range(P)]
        q, k, v = (_MoveChunks.apply(t, before, after, rank, group) for t in (q, k, v))
        ring = _Ring(group, rank, P, after[rank], n // 2, True, scale, None, engine_kwargs, fn, device)
    else:
        ring = _Ring(group, rank, P, [rank], n, bool(is_causal), scale, None if mask is None else mask.detach(),
                     engine_kwargs, fn, device)
    out, lse = _RingAttention.apply(q, k, v, mask, ring)
    if zigzag:
        out = _MoveChunks.apply(out, after, before, rank, group)
        if return_lse:
            lse = _MoveChunks.apply(lse.unsqueeze(-1), after, before, rank, group).squeeze(-1)
    return (out, lse) if return_lse else out
