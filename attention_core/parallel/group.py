"""What Ulysses and ring share around the process group: the agreement (one small all_gather before anything is
sent, so bad input raises the same error on every rank instead of hanging), the settling of an error after the
exchanges (every rank raises, the group stays usable), the input checks, the all-to-all, the refusal of torch.func
transforms across ranks, and running eagerly under torch.compile. The contract is attention_core.parallel's."""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from ..kernel.autocast import autocast_inputs
from ..kernel.ops import TILE_OPTIONS, check_options
from ..kernel.tangents import forward_mode_active
from .blocks import _acc_dtype

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
# all-to-all along dim 0 (the exchange Ulysses and the zigzag reorder build on)


def _a2a(send: torch.Tensor, group, recv_splits=None, send_splits=None) -> torch.Tensor:
    """all_to_all_single along dim 0 (bool travels as uint8)."""
    is_bool = send.dtype == torch.bool
    s = send.to(torch.uint8) if is_bool else send.contiguous()
    rows = sum(recv_splits) if recv_splits is not None else s.shape[0]
    recv = torch.empty((rows,) + tuple(s.shape[1:]), dtype=s.dtype, device=s.device)
    dist.all_to_all_single(recv, s, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return recv.bool() if is_bool else recv


def _no_heads(q, k, v, mask, return_lse):
    """torch's result for zero query heads: out [B, 0, N/P, Ev] (and lse [B, 0, N/P]), empty, differentiable with
    zero gradients for q, k, v and a floating mask (as torch's SDPA gives)."""
    B, _, n, _ = q.shape
    link = sum(t.sum() for t in (q, k, v, mask) if isinstance(t, torch.Tensor) and t.is_floating_point())
    out = q.new_zeros((B, 0, n, v.shape[-1])) + 0 * link
    if not return_lse:
        return out
    return out, torch.zeros((B, 0, n), dtype=_acc_dtype(q.dtype), device=q.device) + 0 * link


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
