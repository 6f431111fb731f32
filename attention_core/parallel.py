"""Sequence-parallel exact attention over torch.distributed: Ulysses (all-to-all) and ring (log-sum-exp merge).

Contract of both functions: P ranks of `group` each hold a contiguous slice of the sequence, q/k/v of shape
[B, H, N/P, D] in rank order along dim -2 (rank r holds tokens r*N/P .. (r+1)*N/P - 1), and each gets back its
slice of full attention over all N tokens, exactly (to fp32 rounding) what torch's SDPA gives on the gathered
tensors. attn_mask, when given, holds this rank's query rows and ALL N key columns (in global order):
broadcastable to [B, H, N/P, N] (a key-padding mask [B, 1, 1, N] costs nothing extra).

  Ulysses  all-to-all from sequence shards to head shards ([B, H/P, N, D]), the engine on full sequences, all-to-all
           back. Needs H (query heads) divisible by P. Moves 4 x B*H*N*D/P elements per rank per call (q, k, v, out;
           k, v less under GQA). Memory: the engine's O(N) on H/P heads.
  Ring     K/V blocks pass around the ring (rank r sends to r+1); each step's partial (out, lse) merges into the
           running result: lse = logaddexp(lse_a, lse_b), out = out_a e^(lse_a-lse) + out_b e^(lse_b-lse).
           Causal attention is load-balanced: internally the sequence is cut in 2P chunks and rank r works on
           chunks r and 2P-1-r ("zigzag"); the reorder is an all-to-all of q, k, v (and back of out) that the
           caller never sees. Backward passes K/V with their dK/dV accumulators around the ring the same way and
           one more hop home; each block's gradient comes from the recompute backward given the GLOBAL out and lse.
           Memory O(N/P) per rank. dropout_p > 0 raises NotImplementedError (use Ulysses).

Gradients: q, k, v, and a floating attn_mask with requires_grad (torch's dS, summed over the mask's broadcast
dims). A mask holds this rank's query rows, so its gradient is this rank's rows' part: for a mask without a row
dim (key padding [B, 1, 1, N]) shared by all ranks, the ranks' gradients sum to torch's gradient of that one mask
(all_reduce them, as for any replicated parameter). Ulysses gives such a mask its rows internally when it needs a
gradient ([B, H or 1, N/P, N] per rank for the duration of the call).
return_lse=True returns (out, lse) as the engine's scaled_dot_product_attention does: lse [B, H, N/P] this rank's
rows, the log-sum-exp of the scaled, masked scores over all N keys, float32 (float64 for float64), differentiable.

Every call first all-gathers a small description of each rank's inputs, so ranks that disagree (shapes, dtype,
flags) or a rank whose inputs or engine options (tier, memory_budget, an unknown keyword, ...) are malformed raise
a ValueError on every rank, with the same message (naming the rank(s) and the problem), before anything else is
sent. An error after that (out of
memory, no tile fitting memory_budget, on one rank or all, forward or backward) does not stop the communication
half way: the failing rank keeps passing its blocks until every posted send and receive has completed, then one
more small all_gather tells every rank; the failing rank re-raises its own exception, the others a RuntimeError
naming it. The process group stays usable for the next call. Every collective runs under the process group's
timeout (init_process_group(timeout=...)), so a rank that never calls makes the others raise instead of hanging.

Zero query heads give torch's empty result (out [B, 0, N/P, Ev], lse [B, 0, N/P], zero gradients) with no exchange
after the agreement. Across ranks (P > 1) torch.func transforms (grad, vmap, jvp, jacrev, hessian, ...) and
forward-mode AD dual tensors are refused in the agreement: a NotImplementedError on every rank, naming the function
and the transform (the exchanges have no batching or forward-mode rule; loss.backward() is exact); with P = 1 the
call is the engine's own and every transform works. torch.compile runs both functions eagerly, outside the graph
(torch.compiler.disable: a graph break; fullgraph=True raises, naming the function).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .kernel.autocast import autocast_inputs
from .kernel.ops import TILE_OPTIONS, attention_backward, attention_forward, backward_canonical, check_options
from .kernel.problem import normalize
from .sdpa import scaled_dot_product_attention
from .kernel.tangents import forward_mode_active

__all__ = ["ulysses_attention", "ring_attention", "zigzag_chunks", "flash_layout_attention"]


# ----------------------------------------------------------------------------------------------------------------
# the per-block (out, lse) primitive: the engine's raw ops


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


# ----------------------------------------------------------------------------------------------------------------
# agreement: one small all_gather before anything else, so bad input raises everywhere instead of hanging

_META = 40
_FLAGS = ("is_causal", "scale (-1: default)", "enable_gqa", "dropout_p", "attn_mask requires grad")
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.bool]


def _describe(t) -> List[float]:
    if t is None:
        return [-1] * 6
    if not isinstance(t, torch.Tensor):
        return [-2] * 6
    shape = list(t.shape)[-4:]
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 9
    return [t.dim()] + [0] * (4 - len(shape)) + shape + [code]


def _agree(fn: str, group, q, k, v, mask, flags: Sequence[float], local_error: Optional[str]):
    """All-gather each rank's input description; raise the same ValueError on every rank if any rank objected or
    the descriptions differ. Returns (rank, world size)."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    meta = [0.0 if local_error is None else 1.0] + _describe(q) + _describe(k) + _describe(v) + _describe(mask)
    meta += list(flags)
    meta += [0.0] * (_META - len(meta))
    device = q.device if isinstance(q, torch.Tensor) and dist.get_backend(group) != "gloo" else torch.device("cpu")
    try:
        with _plain_tensors():
            mine = torch.tensor(meta[:_META], dtype=torch.float64, device=device)
            table = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(table, mine, group=group)
    except RuntimeError as e:  # a rank that never calls: the process group's timeout ends the wait
        raise RuntimeError(f"{fn} (rank {rank} of {world}): not every rank of the process group joined the call "
                           f"within its timeout (each rank must call {fn} the same number of times, in the same "
                           f"order): {e}") from e
    rows = torch.stack(table).cpu()
    bad = [i for i in range(world) if rows[i, 0] != 0]
    if bad:  # every rank saw the same flags, so every rank takes part in this second, small exchange
        texts = _gather_texts(group, device, local_error)
        same = all(texts[i] == texts[bad[0]] for i in bad)
        detail = (f"rank {bad[0]}: {texts[bad[0]]}" if len(bad) == 1 else f"every one of them: {texts[bad[0]]}"
                  if same else "; ".join(f"rank {i}: {texts[i]}" for i in bad))
        kind = NotImplementedError if all(texts[i].startswith(f"{fn} {_UNSUPPORTED}") for i in bad) else ValueError
        raise kind(f"{fn} (rank {rank} of {world}): rank(s) {bad} rejected the call, so every rank stops here "
                   f"before anything is sent; {detail}")
    differ = [i for i in range(world) if not torch.equal(rows[i], rows[0])]
    if differ:
        def shapes(i):
            r = rows[i].tolist()
            return (f"q {_fmt(r[1:7])}, k {_fmt(r[7:13])}, v {_fmt(r[13:19])}, mask {_fmt(r[19:25])}, "
                    + ", ".join(f"{name} {round(x, 6)}" for name, x in zip(_FLAGS, r[25:25 + len(flags)])))
        raise ValueError(f"{fn} (rank {rank} of {world}): the ranks disagree on their inputs; every rank must pass "
                         f"the same shapes, dtype and flags (each holding N/P tokens). rank 0: {shapes(0)}; "
                         + "; ".join(f"rank {i}: {shapes(i)}" for i in differ))
    return rank, world


def _fmt(d):
    if d[0] == -1:
        return "None"
    if d[0] == -2:
        return "not a tensor"
    nd = int(d[0])
    shape = [int(x) for x in d[1:5]][4 - min(nd, 4):]
    dt = _DTYPES[int(d[5])] if int(d[5]) < len(_DTYPES) else "other"
    return f"{tuple(shape)} {str(dt).replace('torch.', '')}"


_MSG = 480  # bytes of an error message shared with the other ranks


def _comm_device(group, t):
    return t.device if dist.get_backend(group) != "gloo" else torch.device("cpu")


def _plain_tensors():
    """The agreement's small exchanges outside any torch.func transform: they carry no data of the call, and on
    torch 2.5 functorch's wrappers would reach the collective ("Cannot access data pointer of Tensor that doesn't
    have storage") before the refusal could be agreed."""
    return torch._C._DisableFuncTorch() if hasattr(torch._C, "_DisableFuncTorch") else contextlib.nullcontext()


def _gather_texts(group, device, text: Optional[str]) -> List[str]:
    """Every rank's text (empty for None), through one all_gather of _MSG bytes per rank."""
    with _plain_tensors():
        return _gather_texts_plain(group, device, text)


def _gather_texts_plain(group, device, text: Optional[str]) -> List[str]:
    world = dist.get_world_size(group)
    mine = torch.zeros(_MSG, dtype=torch.uint8)
    if text:
        raw = text.encode("utf-8", "replace")[:_MSG]
        mine[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    mine = mine.to(device)
    table = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(table, mine, group=group)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace") for t in table]


def _settle(fn, group, device, error: Optional[BaseException]):
    """After the communication of a call has completed on this rank: tell every rank whether this rank failed
    (one small all_gather), so that either every rank returns or every rank raises. The failing rank re-raises its
    own exception; the others raise a RuntimeError naming it and its message. The group stays usable."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    texts = _gather_texts(group, device, None if error is None else f"{type(error).__name__}: {error}")
    failed = [i for i in range(world) if texts[i]]
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{fn} (rank {rank} of {world}): rank(s) {failed} failed during the call, so every rank "
                           f"stops here (the process group stays usable). rank {failed[0]}: {texts[failed[0]]}")


def _engine_problems(engine_kwargs) -> Optional[str]:
    """What is wrong with the engine options (tier, block sizes, memory_budget, ...), checked before any transfer."""
    unknown = sorted(set(engine_kwargs) - set(TILE_OPTIONS))
    if unknown:
        return (f"unknown option(s) {unknown}; the engine options are {list(TILE_OPTIONS)} (plus return_lse); "
                f"torch's SDPA arguments are attn_mask, dropout_p, is_causal, scale, enable_gqa")
    try:
        check_options(**engine_kwargs)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _local_problems(q, k, v, attn_mask, is_causal, dropout_p) -> Optional[str]:
    """What is wrong with this rank's inputs on their own (None if nothing)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must be [B, H, N/P, D] (4-D), got shape {tuple(t.shape)}"
    if not q.is_floating_point() or q.dtype != k.dtype or q.dtype != v.dtype:
        return f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        return (f"shapes do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                f"(expected q [B, H, n, E], k [B, Hkv, n, E], v [B, Hkv, n, Ev])")
    if q.shape[2] != k.shape[2]:
        return (f"q holds {q.shape[2]} tokens but k/v hold {k.shape[2]}: sequence-parallel attention is "
                f"self-attention over one sharded sequence (call plain SDPA for cross-attention to unsharded keys)")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}"
        if is_causal:
            return "attn_mask and is_causal=True together are not allowed (as in torch's SDPA)"
        if attn_mask.dim() > 4 or attn_mask.dim() < 1:
            return f"attn_mask must have 1 to 4 dims, got shape {tuple(attn_mask.shape)}"
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"attn_mask must be bool or floating point (as in torch's SDPA), got {attn_mask.dtype}"
    if not (0.0 <= float(dropout_p) <= 1.0):
        return f"dropout_p must be in [0, 1], got {dropout_p}"
    return None


def _mask4(mask, B, H, n, N, fn):
    """attn_mask as [Bm, Hm, Rm, N] (each dim full or 1); rows are this rank's query rows."""
    if mask is None:
        return None
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    for dim, (size, full, what) in enumerate(zip(m.shape, (B, H, n, N), ("batch", "heads", "query rows (N/P)",
                                                                          "key columns (all N tokens)"))):
        if size not in (1, full):
            raise ValueError(f"{fn}: attn_mask of shape {tuple(mask.shape)} does not broadcast to [B, H, N/P, N] = "
                             f"[{B}, {H}, {n}, {N}] (its {what} dim is {size}); each rank passes its own query rows "
                             f"and every key column.")
    return m


# ----------------------------------------------------------------------------------------------------------------
# collectives with autograd


def _a2a(send: torch.Tensor, group, recv_splits=None, send_splits=None) -> torch.Tensor:
    """all_to_all_single along dim 0 (bool travels as uint8)."""
    is_bool = send.dtype == torch.bool
    s = send.to(torch.uint8) if is_bool else send.contiguous()
    rows = sum(recv_splits) if recv_splits is not None else s.shape[0]
    recv = torch.empty((rows,) + tuple(s.shape[1:]), dtype=s.dtype, device=s.device)
    dist.all_to_all_single(recv, s, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return recv.bool() if is_bool else recv


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


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, P):
        ctx.group, ctx.P = group, P
        return _seq_to_heads(x, group, P)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g, ctx.group, ctx.P), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, P):
        ctx.group, ctx.P = group, P
        return _heads_to_seq(y, group, P)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g, ctx.group, ctx.P), None, None


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


def _no_heads(q, k, v, mask, return_lse):
    """torch's result for zero query heads: out [B, 0, N/P, Ev] (and lse [B, 0, N/P]), empty, differentiable with
    zero gradients for q, k, v and a floating mask (as torch's SDPA gives)."""
    B, _, n, _ = q.shape
    link = sum(t.sum() for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.is_floating_point())
    out = q.new_zeros((B, 0, n, v.shape[-1])) + 0 * link
    if not return_lse:
        return out
    return out, torch.zeros((B, 0, n), dtype=_acc_dtype(q.dtype), device=q.device) + 0 * link


# ----------------------------------------------------------------------------------------------------------------
# Ulysses


def _agreed(fn, group, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, engine_kwargs, return_lse):
    """(rank, P, q, k, v, attn_mask) once every rank has agreed on the inputs and engine options. Under autocast
    q, k, v and a float mask are cast first, as torch's SDPA casts them before its own checks (fp32 q with bf16 k
    is fine under a bf16 autocast). Nothing is sent before this, so an error here leaves the group as it was."""
    err = _composition_problems(fn, group, (q, k, v, attn_mask))  # first: under vmap the shapes are per sample
    if err is None:
        q, k, v, attn_mask = autocast_inputs(q, k, v, attn_mask)
    err = err or _local_problems(q, k, v, attn_mask, is_causal, dropout_p) or _engine_problems(engine_kwargs)
    if err is None and not isinstance(return_lse, bool):
        err = f"return_lse must be True or False, got {return_lse!r}"
    mask_grad = isinstance(attn_mask, torch.Tensor) and attn_mask.requires_grad and torch.is_grad_enabled()
    flags = [float(bool(is_causal)), -1.0 if scale is None else float(scale), float(bool(enable_gqa)),
             float(dropout_p), float(mask_grad)]  # as _FLAGS names them; Ulysses moves a mask that needs a grad
    if err is None and q.shape[1] != k.shape[1]:
        if not enable_gqa:
            err = (f"q has {q.shape[1]} heads but k/v have {k.shape[1]}: pass enable_gqa=True for grouped-query "
                   f"attention (as torch's SDPA requires)")
        elif k.shape[1] == 0 or q.shape[1] % k.shape[1]:
            err = f"GQA needs q heads ({q.shape[1]}) divisible by k/v heads ({k.shape[1]})"
    return (*_agree(fn, group, q, k, v, attn_mask, flags, err), q, k, v, attn_mask)


_UNSUPPORTED = "does not support"  # "<fn> does not support ...": a refused composition (NotImplementedError)


def _composition_problems(fn, group, tensors) -> Optional[str]:
    """Why this rank cannot take part exactly in a call across ranks (P > 1): a torch.func transform around the
    call or forward-mode AD dual tensors among its inputs. The exchanges between ranks have neither batching nor
    forward-mode rules. None when it can (and always with one rank: that call is the engine's own)."""
    if dist.get_world_size(group) == 1:
        return None
    if torch._C._are_functorch_transforms_active():
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
        names = sorted({str(i.key()).rsplit(".", 1)[-1].lower() for i in retrieve_all_functorch_interpreters()})
        what = f"torch.func transforms (active here: {', '.join(names)})"
    elif forward_mode_active([t if isinstance(t, torch.Tensor) else None for t in tensors]):
        what = "forward-mode AD (torch.autograd.forward_ad dual tensors)"
    else:
        return None
    return (f"{fn} {_UNSUPPORTED} {what} across ranks: its exchanges between ranks have no batching or "
            f"forward-mode rule, so the result would not be exact. Take gradients with loss.backward() or "
            f"torch.autograd.grad (exact), or call attention_core.scaled_dot_product_attention on the whole sequence "
            f"inside the transform")


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
                                            enable_gqa=k.shape[1] != q.shape[1], return_lse=return_lse,
                                            **self.engine_kwargs)


def _not_traced(fn):
    """fn run eagerly under torch.compile, outside the graph: the exchanges between ranks (the agreement's
    all_gather, the all-to-alls and the ring's sends, each waited on in Python) cannot be traced. A graph break in
    torch.compile's default mode; under fullgraph=True torch.compile raises, naming fn and this reason."""
    reason = (f"attention_core.parallel.{fn.__name__} exchanges tensors between ranks (torch.distributed calls "
              f"waited on in Python), which torch.compile cannot trace: it runs eagerly, outside the graph; "
              f"use fullgraph=False")
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch < 2.7: no reason
        return torch.compiler.disable(fn)


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
    qh, kh, vh = (_SeqToHeads.apply(t, group, P) for t in (q, k, v))
    mh = None
    if mask is not None:
        grad = mask.requires_grad and torch.is_grad_enabled()
        if grad and mask.shape[2] == 1:  # its gradient is per query row of this rank: give it rows (see the doc)
            mask = mask.expand(mask.shape[0], mask.shape[1], n, mask.shape[3])
        if mask.shape[1] > 1 and (mask.shape[2] > 1 or grad):
            mh = _SeqToHeads.apply(mask, group, P)
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
    out = _HeadsToSeq.apply(oh, group, P)
    if not return_lse:
        return out
    return out, _HeadsToSeq.apply(lh.unsqueeze(-1), group, P).squeeze(-1)


# ----------------------------------------------------------------------------------------------------------------
# ring


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


# ----------------------------------------------------------------------------------------------------------------
# for frameworks that take a flash_attn_func-style callable (yunchang's UlyssesAttention, xDiT through yunchang)


def flash_layout_attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args,
                           **kwargs):
    """flash_attn_func's calling convention ([B, L, H, D] tensors, GQA by head count) on this engine; returns out
    [B, L, H, Dv]. Options the engine does not have (sliding window, softcap, ALiBi, attention probabilities)
    raise NotImplementedError rather than being ignored."""
    if tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError(
            f"flash_layout_attention: window_size={window_size}, softcap={softcap}, alibi_slopes="
            f"{'set' if alibi_slopes is not None else None}, return_attn_probs={return_attn_probs} are not "
            f"supported by the tiled engine; only dropout_p, softmax_scale and causal are")
    out = scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, dropout_p,
                                       causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
