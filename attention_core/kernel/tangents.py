"""Forward-mode AD of attention: the tangents of (O, L) given the primal O and L, tiled over key blocks.

With S = scale * Q K^T (+ float mask; bool / causal masks set -inf), P = exp(S - L), O = P_drop V, where P_drop =
P * keep / (1 - p) with dropout and P without:
    dS  = scale * (dQ K^T + Q dK^T) (+ dMask)
    r_i = sum_j P_ij dS_ij                                  = dL_i
    dO  = sum_j P_drop_ij (dS_ij - r_i) V_j + P_drop dV     = A - r * O + P_drop dV,  A = (P_drop * dS) V
Each tile (block_q rows x block_kv keys) is recomputed from Q, K and L, so memory is O(block_q * block_kv) on top
of the O(N) tangents, never the full score matrix. Plain torch ops, out of place: the rule runs under
torch.autograd.forward_ad, torch.func.jvp and jacfwd (vmap over it). The flush-to-zero of half precision is not
applied: these are the tangents of exact softmax attention. Also `forward_mode_active`: whether a call may be
seen by forward-mode AD (so autograd.py routes it through the autograd.Function that carries this rule).
"""
from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD

from .gemm import matmul
from .numerics import dropout_keep, stats_dtype
from .problem import AttentionProblem

DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_KV = 512


_OLD_COMPILE = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


def forward_mode_active(tensors) -> bool:
    """True when forward-mode AD sees these tensors: a torch.func.jvp / jacfwd / hessian transform is active, or
    one of them is a dual tensor of torch.autograd.forward_ad. While torch.compile traces (this function may be
    traced as a frame of its own, called from code that runs eagerly inside a compiled region) the answer is
    forward_mode_possible(): the traced tensors cannot tell whether they carry a tangent. (Dynamo's trace on this
    thread, not torch.compiler.is_compiling(), which on torch 2.14 answers True on every thread while any compiles.)"""
    if torch.compiler.is_dynamo_compiling():
        return forward_mode_possible()
    if _jvp_transform_active():
        return True
    if fwAD._current_level < 0:
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def forward_mode_possible() -> bool:
    """For code that torch.compile traces: True when forward-mode AD may see the call, i.e. a torch.func jvp /
    jacfwd / hessian transform is active or a torch.autograd.forward_ad dual level is open. The traced graph cannot
    carry a tangent (dynamo drops it, or breaks the graph after the branch is taken), so such a call must run
    eagerly. Answered once per trace: dynamo guards the functorch transform stack and the module global
    forward_ad._current_level read here, so a change of either retraces."""
    return fwAD._current_level >= 0 or _jvp_transform_active()


def _transform_active() -> bool:
    """Whether any torch.func transform (grad, vmap, jvp, ...) is on functorch's stack."""
    return bool(torch._C._are_functorch_transforms_active())


_transform_active = torch.compiler.assume_constant_result(_transform_active)


def compiled_transform_needs_plain_ops() -> bool:
    """For code that torch.compile traces: True on a torch older than 2.14 when a torch.func transform is active.
    There dynamo fails inside torch on the engine's autograd.Function and custom ops under grad / vmap (torch 2.5.1:
    "must override the setup_context staticmethod", an internal assert under vmap), so such calls are traced as
    plain torch ops. Newer torch traces the Function itself (tests/engine/test_composition_matrix.py on both)."""
    return _OLD_COMPILE and _transform_active()


def _jvp_transform_active() -> bool:
    """Whether a torch.func forward-mode (Jvp) transform is on functorch's stack (jvp, jacfwd, hessian)."""
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return any(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())


# dynamo evaluates it while tracing, as a constant (it reads functorch's C++ interpreter stack, which dynamo cannot
# trace); the FUNCTORCH_STACK_MATCH guard dynamo installs whenever a transform is active makes a new stack retrace
_jvp_transform_active = torch.compiler.assume_constant_result(_jvp_transform_active)


def attention_jvp(q5, k4, v4, mask5, seed: Optional[torch.Tensor], out5, lse, dq5, dk4, dv4, dmask5, causal: bool,
                  causal_offset: int, scale: float, dropout_p: float, block_q: Optional[int] = None,
                  block_kv: Optional[int] = None):
    """(dO5, dL) in the canonical layout (problem.py: q5 (B, Hkv, G, Lq, D), k4 / v4 (B, Hkv, Lk, D / Ev), mask5
    broadcastable to (B, Hkv, G, Lq, Lk)), given the forward's O5 and L. A tangent of None is zero; dmask5 (same
    shape as a float mask5) is the mask's tangent. dO5 in O's dtype, dL in L's dtype."""
    st = stats_dtype(q5.dtype)
    B, H, G, Lq, _ = q5.shape
    Lk, Ev = k4.shape[2], v4.shape[-1]
    out = out5.to(st)
    L = lse.to(st).unsqueeze(-1)
    L = torch.where(torch.isneginf(L), torch.zeros_like(L), L)  # rows with no visible key: every S is -inf, P = 0
    bq, bk = block_q or DEFAULT_BLOCK_Q, block_kv or DEFAULT_BLOCK_KV
    has_ds = dq5 is not None or dk4 is not None or dmask5 is not None
    keep_scale = head = None
    if dropout_p > 0:
        keep_scale = 0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)
        head = AttentionProblem(q5=q5, k4=k4, v4=k4, mask5=None, causal=False, scale=1.0, dropout_p=dropout_p,
                                dropout_seed=0, out_shape=(), squeeze_2d=False).head_index()
        seed_int = int(seed.item()) if seed is not None else 0
    d_out, d_lse = [], []
    for i0 in range(0, Lq, bq):
        i1 = min(Lq, i0 + bq)
        q = q5[:, :, :, i0:i1].to(st)
        dq = None if dq5 is None else dq5[:, :, :, i0:i1].to(st)
        r = q.new_zeros((B, H, G, i1 - i0, 1))
        acc = q.new_zeros((B, H, G, i1 - i0, Ev))  # A - ... + P_drop dV, accumulated over key blocks
        rows = torch.arange(i0, i1, device=q5.device).view(-1, 1)
        for j0 in range(0, Lk, bk):
            j1 = min(Lk, j0 + bk)
            k = k4[:, :, None, j0:j1].to(st)  # (B, H, 1, bk, D): broadcast over the G query heads
            v = v4[:, :, None, j0:j1].to(st)
            s = matmul(q * scale, k.transpose(-1, -2))
            cols = torch.arange(j0, j1, device=q5.device).view(1, -1)
            if mask5 is not None:
                m = _tile(mask5, i0, i1, j0, j1)
                s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.to(st)
            if causal:
                s = s.masked_fill(cols > rows + causal_offset, float("-inf"))
            p = torch.exp(s - L[:, :, :, i0:i1])
            pd = p
            if keep_scale is not None:
                keep = dropout_keep(seed_int, dropout_p, head, rows, cols, Lq, Lk)
                pd = p * (keep.to(st) * keep_scale)
            if has_ds:
                ds = torch.zeros((), dtype=st, device=q5.device)
                if dq is not None:
                    ds = ds + matmul(dq * scale, k.transpose(-1, -2))
                if dk4 is not None:
                    dk = dk4[:, :, None, j0:j1].to(st)
                    ds = ds + matmul(q * scale, dk.transpose(-1, -2))
                if dmask5 is not None:
                    ds = ds + _tile(dmask5, i0, i1, j0, j1).to(st)
                # masked scores have P = 0; where() keeps an infinite mask tangent there from making 0 * inf = nan
                pds = torch.where(p > 0, p * ds, torch.zeros_like(p))
                r = r + pds.sum(-1, keepdim=True)
                acc = acc + matmul(pds if pd is p else torch.where(p > 0, pd * ds, torch.zeros_like(p)), v)
            if dv4 is not None:
                acc = acc + matmul(pd, dv4[:, :, None, j0:j1].to(st))
        d_out.append(acc - r * out[:, :, :, i0:i1])
        d_lse.append(r.squeeze(-1))
    if not d_out:  # an empty problem
        return torch.zeros_like(out5), torch.zeros_like(lse)
    return torch.cat(d_out, 3).to(out5.dtype), torch.cat(d_lse, 3).to(lse.dtype)


def _tile(mask5, i0, i1, j0, j1):
    """Rows [i0, i1) and keys [j0, j1) of a mask that may broadcast (size 1) in either."""
    m = mask5 if mask5.shape[3] == 1 else mask5[:, :, :, i0:i1]
    return m if m.shape[4] == 1 else m[..., j0:j1]
