"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards ([B, H/P, N, D]), the engine on
whole sequences, all-to-all back (the contract: attention_core.parallel's docstring)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..sdpa import scaled_dot_product_attention
from .blocks import _repeat_kv
from .group import _a2a, _agreed, _comm_device, _mask4, _no_heads, _not_traced, _settle


def _seq_to_heads(x, group, P):
    """[B, H, n, D] sequence shard -> [B, H/P, P*n, D] head shard (rank j gets head group j)."""
    B, H, n, D = x.shape
    send = x.reshape(B, P, H // P, n, D).transpose(0, 1)
    recv = _a2a(send, group)  # recv[i]: rank i's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, H // P, P * n, D)


def _heads_to_seq(y, group, P):
    """[B, h, P*n, D] head shard -> [B, P*h, n, D] sequence shard (the inverse of _seq_to_heads)."""
    B, h, N, D = y.shape
    send = y.reshape(B, h, P, N // P, D).permute(2, 0, 1, 3, 4)
    recv = _a2a(send, group)  # recv[i]: my tokens of rank i's heads
    return recv.transpose(0, 1).reshape(B, P * h, N // P, D)


class _Reshard(torch.autograd.Function):
    """_seq_to_heads (to_heads=True) or _heads_to_seq, differentiable: the gradient takes the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group, P, to_heads: bool):
        ctx.group, ctx.P, ctx.to_heads = group, P, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, P)

    @staticmethod
    def backward(ctx, g):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(g, ctx.group, ctx.P), None, None, None


class _GatherRows(torch.autograd.Function):
    """[Bm, 1, n, N] rows of each rank -> [Bm, 1, P*n, N] every rank's rows (all_gather); backward: each rank gets
    the sum over ranks of the gradient of its own rows (an all-to-all, then a sum)."""

    @staticmethod
    def forward(ctx, m, group, P):
        ctx.group, ctx.P = group, P
        store = torch.uint8 if m.dtype == torch.bool else m.dtype
        parts = [torch.empty(m.shape, dtype=store, device=m.device) for _ in range(P)]
        dist.all_gather(parts, m.to(store).contiguous(), group=group)
        return torch.cat(parts, dim=2).to(m.dtype)

    @staticmethod
    def backward(ctx, g):
        P = ctx.P
        Bm, Hm, R, N = g.shape
        send = g.reshape(Bm, Hm, P, R // P, N).permute(2, 0, 1, 3, 4)  # [P, Bm, Hm, n, N]: rank j's rows to j
        return _a2a(send, ctx.group).sum(0), None, None


class _LocalAttention(torch.autograd.Function):
    """The engine on this rank's head shard, with gradients, such that an error in its backward on one rank
    reaches every rank (through _settle) before the all-to-all of the gradients, instead of leaving them waiting.
    Returns (out, lse); the engine's graph is built inside forward and differentiated in backward."""

    @staticmethod
    def forward(ctx, qh, kh, vh, mh, call):
        ctx.set_materialize_grads(False)
        ctx.call = call
        inputs = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (qh, kh, vh, mh)]
        with torch.enable_grad():
            out, lse = call.engine(*inputs, return_lse=True)
        ctx.inner = (inputs, out, lse)
        return out.detach(), lse.detach()

    @staticmethod
    def backward(ctx, dout, dlse):
        inputs, out, lse = ctx.inner
        call = ctx.call
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        outs = [(o, g) for o, g in ((out, dout), (lse, dlse)) if g is not None]
        grads, error = [None] * len(wanted), None
        try:
            if outs and wanted:
                grads = list(torch.autograd.grad([o for o, _ in outs], wanted, [g for _, g in outs],
                                                 allow_unused=True))
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, then it is re-raised here
            error = e
        _settle(call.fn, call.group, call.device, error)
        it = iter(grads)
        return tuple(next(it) if t is not None and t.requires_grad else None for t in inputs) + (None,)


@dataclass
class _UlyssesCall:
    fn: str
    group: object
    device: torch.device
    args: tuple  # dropout_p, is_causal, scale
    engine_kwargs: dict

    def engine(self, q, k, v, mask, return_lse):
        dropout_p, is_causal, scale = self.args
        return scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                            enable_gqa=k.shape[1] != q.shape[1], return_lse=return_lse, **self.engine_kwargs)


@_not_traced
def ulysses_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                      group=None, return_lse=False, **engine_kwargs):
    """This rank's slice of full attention over a sequence sharded across `group` (see the module docstring):
    all-to-all to head shards, the engine's scaled_dot_product_attention on full sequences, all-to-all back.
    return_lse=True: (out, lse), lse [B, H, N/P] this rank's rows (as the engine's return_lse)."""
    fn = "ulysses_attention"
    rank, P, q, k, v, attn_mask = _agreed(fn, group, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          engine_kwargs, return_lse)
    B, H, n, _ = q.shape
    Hkv = k.shape[1]
    if H == 0:  # every rank agreed on no heads: torch's empty result, nothing to exchange
        return _no_heads(q, k, v, attn_mask, return_lse)
    if H % P:
        raise ValueError(f"{fn}: {H} query heads do not split over {P} ranks; Ulysses needs the head count "
                         f"divisible by the number of ranks (use ring_attention, or a group of a size dividing {H})")
    mask = _mask4(attn_mask, B, H, n, n * P, fn)
    if P == 1:
        return scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                                            return_lse=return_lse, **engine_kwargs)
    g = H // Hkv
    if Hkv % P:  # fewest kv-head copies so that kv heads split with their query heads
        rep = P // math.gcd(Hkv, P)
        rep = rep if g % rep == 0 else g
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
    qh, kh, vh = (_Reshard.apply(t, group, P, True) for t in (q, k, v))
    mh = None
    if mask is not None:
        grad = mask.requires_grad and torch.is_grad_enabled()
        if grad and mask.shape[2] == 1:  # its gradient is per query row of this rank: give it rows (see the doc)
            mask = mask.expand(mask.shape[0], mask.shape[1], n, mask.shape[3])
        if mask.shape[1] > 1 and (mask.shape[2] > 1 or grad):
            mh = _Reshard.apply(mask, group, P, True)
        else:
            if mask.shape[2] > 1 or grad:  # rows without heads: every rank needs all rows
                mask = _GatherRows.apply(mask, group, P)
            mh = mask[:, rank * H // P:(rank + 1) * H // P] if mask.shape[1] > 1 else mask
    call = _UlyssesCall(fn, group, _comm_device(group, q), (dropout_p, is_causal, scale), engine_kwargs)
    oh = lh = error = None
    try:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qh, kh, vh, mh)):
            oh, lh = _LocalAttention.apply(qh, kh, vh, mh, call)
        elif return_lse:
            oh, lh = call.engine(qh, kh, vh, mh, return_lse=True)
        else:
            oh = call.engine(qh, kh, vh, mh, return_lse=False)
    except Exception as e:  # noqa: BLE001 - every rank learns of it, so none waits in the all-to-all below
        error = e
    _settle(fn, group, call.device, error)
    out = _Reshard.apply(oh, group, P, False)
    if not return_lse:
        return out
    return out, _Reshard.apply(lh.unsqueeze(-1), group, P, False).squeeze(-1)
