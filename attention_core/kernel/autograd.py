"""The differentiable boundary: the engine as torch custom ops, tied together by one autograd.Function.

    tiled_attention::fwd (q5, k4, v4, mask5, seed, config..., need_stats, count_as="") -> (O5, L, row max)
    tiled_attention::bwd (dO5, dL, q5, k4, v4, mask5, O5, L, row max, seed, config...) -> (dq5, dk4, dv4, dmask5)

(the namespace is "tiled_attention" for the first copy of the engine in a process, see _namespace). fwd's
implementation counts the call under `count_as` (counts.py), so callers' counts hold inside compiled graphs too.
Tensors are in problem.py's canonical layout; everything else is a schema type (bool, int, float, str, None), so
torch.compile(fullgraph=True) traces through the call and tile planning (free memory, data-dependent bounds)
happens inside the op (fake rules give the shapes). Both ops have vmap rules (the vmapped dim folded into the
batch dim). TiledAttention (setup_context, generate_vmap_rule) saves q, k, v, the mask, O and the fp32 L and
row max only: O(N) memory; it works under torch.func (grad, vmap, jacrev) and forward-mode AD (jvp, jacfwd,
hessian, torch.autograd.forward_ad: a tiled rule given O and L, tangents.py).
A backward run with grad mode on (create_graph=True, torch.func.grad) takes a differentiable recompute instead
(plain torch ops; it keeps the full score matrix for the graph, O(Lq * Lk) memory); first-order backward never
does. Dynamo cannot trace a Function that defines jvp, so a call that torch.compile traces under forward-mode AD
(tangents.forward_mode_possible) is plain_attention, the same plain torch ops (O(Lq * Lk) memory); calls it does
not trace (other backends inside torch.func, dual tensors as inputs) run eagerly with the tiled rule.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import counts
from .gemm import matmul
from .numerics import dropout_keep, stats_dtype
from .ops import backward_canonical, forward_canonical
from .problem import AttentionProblem
from .tangents import attention_jvp, compiled_transform_needs_plain_ops, forward_mode_active, forward_mode_possible



def _namespace() -> str:
    """Op namespace: "tiled_attention" for the first copy of the engine in the process, whatever its package is
    named (the pip package `attention_core`, or the ComfyUI pack's copy, which ComfyUI imports under a name made
    from its install path); a second copy (both imported in one process) gets "tiled_attention_2", a third
    "tiled_attention_3", ..., so two copies never collide and no name carries a path."""
    n = 1
    while True:
        ns = "tiled_attention" if n == 1 else f"tiled_attention_{n}"
        if not _op_exists(ns):
            return ns
        n += 1


def _op_exists(ns: str) -> bool:
    """Whether an operator `ns`::fwd is registered in this process (by another copy of the engine)."""
    try:
        getattr(getattr(torch.ops, ns), "fwd")
    except (AttributeError, RuntimeError):
        return False
    return True


NS = _namespace()


@torch.library.custom_op(f"{NS}::fwd", mutates_args=())
def attention_fwd(q5: Tensor, k4: Tensor, v4: Tensor, mask5: Optional[Tensor], seed: Optional[Tensor],
                  causal: bool, causal_offset: int, scale: float, dropout_p: float, tier: str,
                  block_q: Optional[int], block_kv: Optional[int], memory_budget: Optional[int], precision: str,
                  flush_to_zero: Optional[bool], need_stats: bool,
                  count_as: str = "") -> Tuple[Tensor, Tensor, Tensor]:
    counts.add(count_as)  # here, not in the caller: this runs in eager calls and in every run of a compiled graph
    s = int(seed.item()) if seed is not None else 0
    return forward_canonical(q5, k4, v4, mask5, s, causal, causal_offset, scale, dropout_p, tier, block_q,
                             block_kv, memory_budget, precision, flush_to_zero, need_stats)


@attention_fwd.register_fake
def _attention_fwd_fake(q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p, tier, block_q, block_kv,
                        memory_budget, precision, flush_to_zero, need_stats, count_as=""):
    B, H, G, Lq, _ = q5.shape
    st = stats_dtype(q5.dtype)
    stats = (B, H, G, Lq) if need_stats else (0,)
    return (q5.new_empty((B, H, G, Lq, v4.shape[-1])), q5.new_empty(stats, dtype=st), q5.new_empty(stats, dtype=st))


@torch.library.custom_op(f"{NS}::bwd", mutates_args=())
def attention_bwd(dout5: Tensor, dlse: Optional[Tensor], q5: Tensor, k4: Tensor, v4: Tensor, mask5: Optional[Tensor],
                  out5: Tensor, lse: Tensor, rowmax: Optional[Tensor], seed: Optional[Tensor], causal: bool,
                  causal_offset: int, scale: float, dropout_p: float, need_dmask: bool, tier: str,
                  block_q: Optional[int], block_kv: Optional[int], memory_budget: Optional[int], precision: str,
                  flush_to_zero: Optional[bool]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    s = int(seed.item()) if seed is not None else 0
    dq, dk, dv, dm = backward_canonical(dout5, dlse, q5, k4, v4, mask5, out5, lse, rowmax, s, causal, causal_offset,
                                        scale, dropout_p, need_dmask, tier, block_q, block_kv, memory_budget,
                                        precision, flush_to_zero)
    return dq, dk, dv, (dm if dm is not None else q5.new_empty((0,)))


@attention_bwd.register_fake
def _attention_bwd_fake(dout5, dlse, q5, k4, v4, mask5, out5, lse, rowmax, seed, causal, causal_offset, scale,
                        dropout_p, need_dmask, *opts):
    dm = torch.empty_like(mask5) if need_dmask and mask5 is not None else q5.new_empty((0,))
    return torch.empty_like(q5), torch.empty_like(k4), torch.empty_like(v4), dm


# ---- autograd ---------------------------------------------------------------------------------------------------

class TiledAttention(torch.autograd.Function):
    """(O5, L) of tiled_attention::fwd with the recompute backward. setup_context + generate_vmap_rule make it
    work under torch.func (grad, vmap, jacrev, hessian); torch.compile traces it (the ops inside are opaque)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(q5, k4, v4, mask5, seed, count_as, *config):
        out5, lse, rowmax = attention_fwd(q5, k4, v4, mask5, seed, *config, True, count_as)
        return out5, lse, rowmax

    @staticmethod
    def setup_context(ctx, inputs, output):
        q5, k4, v4, mask5, seed, _count_as, *config = inputs
        out5, lse, rowmax = output
        ctx.save_for_backward(q5, k4, v4, mask5, seed, out5, lse, rowmax)
        ctx.config = tuple(config)  # causal, causal_offset, scale, dropout_p, then the engine options

    @staticmethod
    def backward(ctx, dout5, dlse, _drowmax):
        q5, k4, v4, mask5, seed, out5, lse, rowmax = ctx.saved_tensors
        causal, causal_offset, scale, dropout_p, *opts = ctx.config
        need_dmask = mask5 is not None and bool(ctx.needs_input_grad[3])
        if (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (dout5, dlse, q5, k4, v4, mask5))) \
                or forward_mode_active((dout5, dlse, q5, k4, v4, mask5)):  # forward over reverse
            dq, dk, dv, dm = differentiable_backward(dout5, dlse, q5, k4, v4, mask5, seed, causal, causal_offset,
                                                     scale, dropout_p, need_dmask)
        else:
            dq, dk, dv, dm = attention_bwd(dout5, dlse, q5, k4, v4, mask5, out5, lse, rowmax, seed,
                                                           causal, causal_offset, scale, dropout_p, need_dmask, *opts)
        return (dq, dk, dv, dm if need_dmask else None) + (None,) * (2 + len(ctx.config))  # seed, count_as, config


class TiledAttentionForwardAD(TiledAttention):
    """TiledAttention plus the forward-mode rule, used only when forward mode sees the call (torch.compile's
    Dynamo cannot trace a Function that defines jvp, so the compiled path keeps TiledAttention)."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        TiledAttention.setup_context(ctx, inputs, output)
        q5, k4, v4, mask5, seed, *_ = inputs
        out5, lse, rowmax = output
        # the same tensors as save_for_backward, in the same order: under vmap (jacfwd, jacrev(jacfwd)) torch.func
        # records ONE list of batch dims for the saved tensors, that of the last save_for_* call, and applies it to
        # both lists; a shorter forward list made the backward of jacrev(jacfwd(f)) crash ("flat_bdims")
        ctx.save_for_forward(q5, k4, v4, mask5, seed, out5, lse, rowmax)

    @staticmethod
    def jvp(ctx, dq5, dk4, dv4, dmask5, _dseed, _dcount_as, *_dconfig):
        """Forward mode (torch.autograd.forward_ad, torch.func.jvp / jacfwd): tangents of (O5, L), tiled
        (tangents.py); the row max gets a zero tangent (it only steers flush-to-zero)."""
        q5, k4, v4, mask5, seed, out5, lse, _rowmax = ctx.saved_tensors
        causal, causal_offset, scale, dropout_p, _tier, block_q, block_kv, *_ = ctx.config
        if mask5 is None or mask5.dtype == torch.bool:
            dmask5 = None
        d_out, d_lse = attention_jvp(q5, k4, v4, mask5, seed, out5, lse, dq5, dk4, dv4, dmask5, causal,
                                     causal_offset, scale, dropout_p, block_q, block_kv)
        return d_out, d_lse, torch.zeros_like(lse)


def tiled_attention(q5, k4, v4, mask5, seed, *config, need_lse: bool = True, count_as: str = ""):
    """(O5, L): the differentiable engine call in the canonical layout (config as tiled_attention::fwd, less
    need_stats and count_as). Without grads and need_lse=False, L is not computed (an empty tensor). The op counts
    the call under count_as (counts.py; the plain-ops path below runs no op and counts nothing). While dynamo traces
    under forward-mode AD (a torch.func jvp transform around the compiled code, or an open forward_ad dual level)
    the call is traced as plain_attention: dynamo cannot trace the autograd.Function's forward-mode rule, and the
    custom op alone would carry no tangent."""
    # the question is whether dynamo traces this call on this thread: torch.compiler.is_compiling() answers True on
    # every thread of torch 2.14 while any thread compiles (and during torch.export), which sent eager calls under
    # forward-mode AD to the O(Lq * Lk) plain ops; make_fx / AOT tracing runs this Python eagerly, where the
    # Function's forward-mode rule works
    if torch.compiler.is_dynamo_compiling() and (forward_mode_possible() or compiled_transform_needs_plain_ops()):
        causal, causal_offset, scale, dropout_p = config[:4]
        return plain_attention(q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p)
    if forward_mode_active((q5, k4, v4, mask5)):
        out5, lse, _ = TiledAttentionForwardAD.apply(q5, k4, v4, mask5, seed, count_as, *config)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q5, k4, v4, mask5)):
        out5, lse, _ = TiledAttention.apply(q5, k4, v4, mask5, seed, count_as, *config)
    else:  # nothing to differentiate: the op alone (torch.compile cannot trace a Function without grads)
        out5, lse, _ = attention_fwd(q5, k4, v4, mask5, seed, *config, need_lse, count_as)
    return out5, lse


def differentiable_backward(dout5, dlse, q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p,
                            need_dmask):
    """The same gradients written in plain differentiable torch ops (no autograd.grad, no in-place), so they can
    be differentiated again (gradient penalties) and run under torch.func. Keeps O(Lq * Lk) for the graph.
    dS = P * (dP - rowsum(dO * O) + dL), dQ = scale dS K, dK = scale dS^T Q, dV = P_drop^T dO, dMask = dS."""
    st = stats_dtype(q5.dtype)
    q, k, v = q5.to(st), k4.to(st).unsqueeze(2), v4.to(st).unsqueeze(2)  # k, v broadcast over the G heads
    prob = _probabilities(q, k, mask5, causal, causal_offset, scale)
    keep = _keep_scale(q5, k4, seed, dropout_p)
    pd = prob if keep is None else prob * keep
    do = dout5.to(st)
    out = matmul(pd, v)
    dv = matmul(pd.transpose(-1, -2), do).sum(2)
    dp = matmul(do, v.transpose(-1, -2))
    if keep is not None:
        dp = dp * keep
    delta = (do * out).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(st).unsqueeze(-1)
    ds = prob * (dp - delta)
    dq = matmul(ds, k) * scale
    dk = matmul(ds.transpose(-1, -2), q).sum(2) * scale
    dm = None
    if need_dmask:
        dims = tuple(d for d in range(5) if mask5.shape[d] == 1 and ds.shape[d] != 1)
        dm = (ds.sum(dim=dims, keepdim=True) if dims else ds).to(mask5.dtype)
    return dq.to(q5.dtype), dk.to(k4.dtype), dv.to(v4.dtype), dm


def plain_attention(q5, k4, v4, mask5, seed, causal, causal_offset, scale, dropout_p):
    """(O5, L) of the whole problem in plain differentiable torch ops, out of place: forward-mode AD, reverse mode
    and torch.compile all see through it. It holds the full score matrix (O(Lq * Lk) memory). The same results
    as tiled_attention (dropout bits included; no flush-to-zero), computed in the statistics dtype."""
    st = stats_dtype(q5.dtype)
    q, k, v = q5.to(st), k4.to(st).unsqueeze(2), v4.to(st).unsqueeze(2)  # k, v broadcast over the G heads
    prob, m, l = _softmax_parts(q, k, mask5, causal, causal_offset, scale)
    keep = _keep_scale(q5, k4, seed, dropout_p)
    out = matmul(prob if keep is None else prob * keep, v)
    empty = l == 0  # rows with no visible key: L = -inf (and O = 0, from P = 0)
    lse = m + torch.log(torch.where(empty, torch.ones_like(l), l))
    lse = torch.where(empty, torch.full_like(l, float("-inf")), lse)
    return out.to(q5.dtype), lse.squeeze(-1)


def _probabilities(q, k, mask5, causal, causal_offset, scale):
    """P (B, H, G, Lq, Lk) in differentiable ops; rows with no visible key: P = 0."""
    return _softmax_parts(q, k, mask5, causal, causal_offset, scale)[0]


def _softmax_parts(q, k, mask5, causal, causal_offset, scale):
    """(P, row max m (0 on rows with no visible key, not differentiated), row sum l of exp(s - m)), keepdim."""
    s = matmul(q * scale, k.transpose(-1, -2))
    Lq, Lk = s.shape[-2], s.shape[-1]
    if mask5 is not None:
        s = s.masked_fill(~mask5, float("-inf")) if mask5.dtype == torch.bool else s + mask5.to(s.dtype)
    if causal:
        rows = torch.arange(Lq, device=s.device).view(-1, 1) + causal_offset
        s = s.masked_fill(torch.arange(Lk, device=s.device).view(1, -1) > rows, float("-inf"))
    m = s.detach().amax(-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    l = e.sum(-1, keepdim=True)
    return e / torch.where(l == 0, torch.ones_like(l), l), m, l


def _keep_scale(q5, k4, seed, dropout_p):
    """keep bits / (1 - p) of the whole problem (as the tiles draw them), or None without dropout. The seed stays
    a tensor (no .item()), so torch.compile traces this without a graph break."""
    if dropout_p <= 0:
        return None
    if dropout_p >= 1:
        return torch.zeros((), dtype=stats_dtype(q5.dtype), device=q5.device)
    p = AttentionProblem(q5=q5, k4=k4, v4=k4, mask5=None, causal=False, scale=1.0, dropout_p=dropout_p,
                         dropout_seed=0, out_shape=(), squeeze_2d=False)
    Lq, Lk = q5.shape[3], k4.shape[2]
    rows = torch.arange(Lq, device=q5.device, dtype=torch.int64).view(-1, 1)
    cols = torch.arange(Lk, device=q5.device, dtype=torch.int64).view(1, -1)
    keep = dropout_keep(seed if seed is not None else 0, dropout_p, p.head_index(), rows, cols, Lq, Lk)
    return keep.to(stats_dtype(q5.dtype)) / (1.0 - dropout_p)


# ---- vmap: fold the vmapped dim into the batch dim --------------------------------------------------------------

def _batched(x, d, n):
    """x with the vmapped dim first (expanded when x is not vmapped), or None."""
    if x is None:
        return None
    return x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(n, *x.shape)


def _fold(x):
    return None if x is None else x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _fold_mask(mask5, d, n, B, per_sample: bool):
    """The mask for the folded batch: unchanged when not vmapped (it broadcasts), else (n*B, ...)."""
    if mask5 is None or (d is None and not per_sample):
        return mask5
    m = _batched(mask5, d, n)
    return _fold(m.expand(n, B, *m.shape[2:]) if m.shape[1] != B else m)


# where need_stats is in the arguments after the seed (causal ... flush_to_zero, need_stats[, count_as]: torch leaves a
# trailing argument equal to its default out of what a kernel receives, so count_as "" may be missing)
_NEED_STATS = 10


def _fwd_vmap(info, in_dims, q5, k4, v4, mask5, seed, *config):
    n = info.batch_size
    if in_dims[4] is not None:
        raise RuntimeError("tiled attention under vmap: the dropout seed cannot be vmapped")
    B = _batched(q5, in_dims[0], n).shape[1]
    q, k, v = (_fold(_batched(t, d, n)) for t, d in zip((q5, k4, v4), in_dims[:3]))
    m = _fold_mask(mask5, in_dims[3], n, B, False)
    out, lse, rowmax = attention_fwd(q, k, v, m, seed, *config)
    if not config[_NEED_STATS]:  # need_stats=False: L and the row max are empty
        return (out.view(n, B, *out.shape[1:]), lse, rowmax), (0, None, None)
    return tuple(t.view(n, B, *t.shape[1:]) for t in (out, lse, rowmax)), (0, 0, 0)


def _bwd_vmap(info, in_dims, dout5, dlse, q5, k4, v4, mask5, out5, lse, rowmax, seed, causal, causal_offset, scale,
              dropout_p, need_dmask, *opts):
    n = info.batch_size
    if in_dims[9] is not None:
        raise RuntimeError("tiled attention under vmap: the dropout seed cannot be vmapped")
    B = _batched(q5, in_dims[2], n).shape[1]
    args = [_fold(_batched(t, d, n)) for t, d in zip((dout5, dlse, q5, k4, v4), in_dims[:5])]
    m = _fold_mask(mask5, in_dims[5], n, B, need_dmask)
    rest = [_fold(_batched(t, d, n)) for t, d in zip((out5, lse, rowmax), in_dims[6:9])]
    dq, dk, dv, dm = attention_bwd(*args, m, *rest, seed, causal, causal_offset, scale, dropout_p,
                                                   need_dmask, *opts)
    res = [t.view(n, B, *t.shape[1:]) for t in (dq, dk, dv)]
    if need_dmask:
        dm = dm.view(n, B, *dm.shape[1:])
        if _batched(mask5, in_dims[5], n).shape[1] == 1 and B != 1:  # the mask broadcast over the batch
            dm = dm.sum(1, keepdim=True)
        return (*res, dm), (0, 0, 0, 0)
    return (*res, dm), (0, 0, 0, None)


attention_fwd.register_vmap(_fwd_vmap)
attention_bwd.register_vmap(_bwd_vmap)
