"""Sequence-parallel attention (Ulysses and ring) over real torch.distributed (gloo, CPU), 2 and 4 processes.

One process group per world size per test session: this file re-runs itself as `--worker` in P subprocesses, each
runs every case of CASES and writes its findings; the tests read them. Every case builds the full float64 problem
from its seed on every rank, hands each rank its slice, and compares that rank's output and gradients with torch's
math SDPA on the full tensors (float64; the fp32 case against torch's own fp32 error).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import pickle
import re
import subprocess
import sys
import time
import traceback
import zlib

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLDS = (2, 4)
GROUP_TIMEOUT_S = 60
ABSENT_TIMEOUT_S = 4
RECOVER_TIMEOUT_S = 8  # the process group of each error-recovery case: a broken group shows as this timeout
ALGOS = ("ulysses", "ring")

# name -> spec. n: tokens per rank; H/Hkv heads; mask: kind; expect: "ok" or the exception every rank must raise
CASES = {
    "plain": dict(B=2, H=4, Hkv=4, n=6, D=8),
    "causal": dict(B=1, H=4, Hkv=4, n=6, D=8, causal=True),
    "causal_odd": dict(B=1, H=4, Hkv=4, n=5, D=8, causal=True),  # ring: no zigzag split possible
    "key_padding": dict(B=2, H=4, Hkv=4, n=6, D=8, mask="key_padding"),
    "float_mask_rows_heads": dict(B=2, H=4, Hkv=4, n=6, D=8, mask="float_full"),
    "bool_mask_rows": dict(B=1, H=4, Hkv=4, n=6, D=8, mask="bool_rows"),
    "gqa_causal": dict(B=1, H=8, Hkv=2, n=6, D=8, causal=True, gqa=True),
    "mqa": dict(B=1, H=4, Hkv=1, n=6, D=8, gqa=True),
    "scale_dv": dict(B=1, H=4, Hkv=4, n=6, D=8, Dv=5, scale=0.3),
    "fp32": dict(B=1, H=4, Hkv=4, n=16, D=16, causal=True, dtype="float32"),
    "fp16": dict(B=2, H=4, Hkv=2, n=16, D=16, gqa=True, mask="key_padding", dtype="float16"),
    "autocast": dict(B=1, H=4, Hkv=4, n=6, D=8, causal=True, dtype="float32", autocast=True),
    "heads_not_divisible": dict(B=1, H=3, Hkv=3, n=6, D=8, expect={"ulysses": "ValueError"}),
    "ranks_disagree": dict(B=1, H=4, Hkv=4, n=6, D=8, bad="rank1_longer", expect="ValueError"),
    "rank0_malformed": dict(B=1, H=4, Hkv=4, n=6, D=8, bad="rank0_3d", expect="ValueError"),
    "ranks_reject_differently": dict(B=1, H=4, Hkv=4, n=6, D=8, bad="rank0_3d_rank1_v_fp32", expect="ValueError"),
    "mask_grad_disagree": dict(B=1, H=4, Hkv=4, n=4, D=8, mask="float_key_padding", bad="rank1_mask_grad",
                               expect="ValueError"),  # Ulysses would move the mask on one rank only: a hang
    "dropout": dict(B=1, H=4, Hkv=4, n=6, D=8, dropout=0.3, expect={"ring": "NotImplementedError"}),
    # issue 17.4: a float mask that requires grad gets torch's gradient (this rank's rows; see mask_leaves)
    "mask_grad_full": dict(B=2, H=4, Hkv=4, n=4, D=8, mask="float_full", mask_grad=True),
    "mask_grad_key_padding": dict(B=2, H=4, Hkv=2, n=4, D=8, gqa=True, mask="float_key_padding", mask_grad=True),
    "mask_grad_rows": dict(B=1, H=4, Hkv=4, n=4, D=8, mask="float_rows", mask_grad=True),
    "mask_grad_heads": dict(B=1, H=4, Hkv=4, n=4, D=8, mask="float_heads", mask_grad=True, lse=True),
    # issue 17.6: return_lse=True, lse exact and differentiable
    "lse_causal": dict(B=1, H=4, Hkv=2, n=6, D=8, causal=True, gqa=True, lse=True),
    "lse_causal_odd": dict(B=1, H=4, Hkv=4, n=5, D=8, causal=True, lse=True),
    "lse_bool_mask": dict(B=2, H=4, Hkv=4, n=4, D=8, mask="key_padding", scale=0.4, lse=True),
    "lse_no_grad": dict(B=1, H=4, Hkv=4, n=6, D=8, causal=True, lse=True, no_grad=True),  # out and lse only
    "mask_heads": dict(B=2, H=4, Hkv=2, n=4, D=8, gqa=True, mask="float_heads"),  # [1, H, 1, N], no grad
}


# issue 17.7: (algo, kind) -> what every rank raises; after it, a valid call on the same group must be right
RECOVERY = {
    ("ring", "unknown_tier"): "ValueError",  # checked before anything is sent
    ("ring", "unknown_option"): "ValueError",
    ("ring", "rank1_unknown_tier"): "ValueError",  # one rank's option: every rank raises its message
    ("ring", "budget_too_small"): "AttentionMemoryError",  # every rank fails in its first block, mid-ring
    ("ring", "rank1_oom_forward"): {1: "OutOfMemoryError", "others": "RuntimeError"},  # one rank, mid-ring
    ("ring", "rank1_oom_backward"): {1: "OutOfMemoryError", "others": "RuntimeError"},
    ("ring", "causal_rank1_oom_forward"): {1: "OutOfMemoryError", "others": "RuntimeError"},  # zigzag
    ("ulysses", "unknown_tier"): "ValueError",
    ("ulysses", "rank1_oom_forward"): {1: "OutOfMemoryError", "others": "RuntimeError"},
    ("ulysses", "rank1_oom_backward"): {1: "OutOfMemoryError", "others": "RuntimeError"},
}


def expected(spec, algo):
    e = spec.get("expect", "ok")
    return e.get(algo, "ok") if isinstance(e, dict) else e


# ---------------------------------------------------------------------------------------------------------------
# worker side


def build(spec, P, seed):
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, n, D = spec["B"], spec["H"], spec["Hkv"], spec["n"], spec["D"]
    N, Dv = n * P, spec.get("Dv", D)
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, N, Dv, generator=g, dtype=torch.float64)
    dout = torch.randn(B, H, N, Dv, generator=g, dtype=torch.float64)
    kind, mask = spec.get("mask"), None
    if kind == "key_padding":
        mask = torch.ones(B, 1, 1, N, dtype=torch.bool)
        mask[0, ..., N - n - 2:] = False  # more than a whole block: rows with lse = -inf in some blocks
        mask[1, ..., : 3] = False
    elif kind == "float_full":
        mask = torch.randn(B, H, N, N, generator=g, dtype=torch.float64)
    elif kind == "float_key_padding":
        mask = torch.randn(B, 1, 1, N, generator=g, dtype=torch.float64)
    elif kind == "float_rows":
        mask = torch.randn(N, N, generator=g, dtype=torch.float64)
    elif kind == "float_heads":
        mask = torch.randn(1, H, 1, N, generator=g, dtype=torch.float64)
    elif kind == "bool_rows":
        mask = torch.rand(N, N, generator=g) > 0.4
        mask[:, 0] = True  # no fully masked row
    return q, k, v, dout, mask


def slice_rows(t, r, n):
    return t[..., r * n:(r + 1) * n, :]


def local_mask(mask, r, n):
    """Rank r's mask: its query rows, or the whole mask when it has no row dim."""
    return None if mask is None else (mask if mask.shape[-2] == 1 else mask[..., r * n:(r + 1) * n, :])


def mask_leaves(mask, P, n):
    """One leaf per rank (its local mask) and the full mask made of them: rank r's copy applies to rank r's query
    rows, so torch's gradient of leaf r is what rank r must get (the ranks' gradients of a shared key-padding mask
    sum to torch's gradient of that one mask)."""
    leaves = [local_mask(mask, r, n).clone().requires_grad_(True) for r in range(P)]
    four = [m.reshape((1,) * (4 - m.dim()) + tuple(m.shape)) for m in leaves]
    return leaves, torch.cat([m.expand(*m.shape[:2], n, m.shape[3]) for m in four], dim=-2)


def reference_lse(q, k, mask, causal, scale):
    """torch.logsumexp of the float64 scores, scaled and masked (differentiable)."""
    H, Hkv = q.shape[1], k.shape[1]
    s = q @ k.repeat_interleave(H // Hkv, dim=1).transpose(-1, -2) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.logsumexp(s, dim=-1)


def run_case(name, spec, algo, rank, P):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from attention_core import parallel

    fn = getattr(parallel, f"{algo}_attention")
    q, k, v, dout, mask = build(spec, P, seed=zlib.crc32(name.encode()))
    dtype = getattr(torch, spec.get("dtype", "float64"))
    n = spec["n"]
    kw = dict(is_causal=spec.get("causal", False), scale=spec.get("scale"), enable_gqa=spec.get("gqa", False),
              dropout_p=spec.get("dropout", 0.0))
    mask_grad, want_lse = spec.get("mask_grad", False), spec.get("lse", False)
    dlse = torch.randn(q.shape[:3], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    with sdpa_kernel([SDPBackend.MATH]):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_mask = mask
        if mask_grad:
            m_leaves, ref_mask = mask_leaves(mask, P, n)
        ref = F.scaled_dot_product_attention(*leaves, attn_mask=ref_mask, **{**kw, "dropout_p": 0.0})
        outs, grads = [ref], [dout]
        if want_lse:
            ref_lse = reference_lse(*leaves[:2], ref_mask, kw["is_causal"], kw["scale"])
            outs.append(ref_lse)
            grads.append(dlse)
        torch.autograd.backward(outs, grads)
        ref_grads = [t.grad for t in leaves]
        if mask_grad:
            ref_grads.append(m_leaves[rank].grad)
        torch_err = None
        if dtype != torch.float64:  # torch's own error at this dtype is the yardstick
            lo = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*lo, attn_mask=mask, **{**kw, "dropout_p": 0.0})
            o.backward(dout.to(dtype))
            torch_err = [(o.double() - ref).abs().max().item()] + [
                (t.grad.double() - r).abs().max().item() for t, r in zip(lo, ref_grads)]
    mine = [slice_rows(t, rank, n).to(dtype).detach().clone().requires_grad_(True) for t in (q, k, v)]
    my_mask = local_mask(mask, rank, n)
    if mask_grad:
        my_mask = my_mask.clone().requires_grad_(True)
    args = list(mine)
    if spec.get("bad") == "rank1_longer" and rank == 1:
        args = [torch.cat([t, t[..., :1, :]], dim=-2) for t in mine]
    if spec.get("bad", "").startswith("rank0_3d") and rank == 0:
        args[0] = mine[0][0]
    if spec.get("bad") == "rank0_3d_rank1_v_fp32" and rank == 1:
        args[2] = mine[2].float()
    if spec.get("bad") == "rank1_mask_grad" and rank == 1:
        my_mask = my_mask.clone().requires_grad_(True)
    if want_lse:
        kw["return_lse"] = True
    t0 = time.perf_counter()
    if spec.get("autocast"):  # fp32 inputs computed in bf16, as torch's SDPA does under autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(*args, attn_mask=my_mask, **kw)
        return {"seconds": time.perf_counter() - t0, "dtype": str(out.dtype), "finite": True}
    if spec.get("no_grad"):
        with torch.no_grad():
            out = fn(*args, attn_mask=my_mask, **kw)
    else:
        out = fn(*args, attn_mask=my_mask, **kw)
    lse = None
    if spec.get("no_grad"):
        out, lse = out
        return {"seconds": time.perf_counter() - t0, "shape": tuple(out.shape), "finite": True,
                "what": ["out", "lse"], "scale": [1.0, 1.0], "torch_err": None, "no_grad": not out.requires_grad,
                "err": [(out - slice_rows(ref, rank, n)).abs().max().item(),
                        (lse - ref_lse.detach()[..., rank * n:(rank + 1) * n]).abs().max().item()]}
    if want_lse:
        out, lse = out
        torch.autograd.backward([out, lse], [slice_rows(dout, rank, n).to(dtype), dlse[..., rank * n:(rank + 1) * n]])
    else:
        out.backward(slice_rows(dout, rank, n).to(dtype))
    res = {"seconds": time.perf_counter() - t0, "shape": tuple(out.shape), "finite": bool(torch.isfinite(out).all())}
    if kw["dropout_p"] == 0.0:
        got = [out] + [t.grad for t in mine] + ([my_mask.grad] if mask_grad else [])
        want = [slice_rows(ref, rank, n)] + [slice_rows(r, rank, n) for r in ref_grads[:3]] + ref_grads[3:]
        res["what"] = ["out", "dq", "dk", "dv"] + (["dmask"] if mask_grad else [])
        if want_lse:
            got.append(lse)
            want.append(ref_lse.detach()[..., rank * n:(rank + 1) * n])
            res["what"].append("lse")
        res["err"] = [float("inf") if a is None else (a.double() - b).abs().max().item() for a, b in zip(got, want)]
        res["scale"] = [b.abs().max().item() for b in want]
        res["torch_err"] = torch_err
    return res


def yunchang_case(rank, world):
    """The documented recipe: yunchang's UlyssesAttention with this engine as its local attention."""
    try:
        from yunchang import UlyssesAttention
        from yunchang.kernels import AttnType
    except ImportError as e:
        return {"outcome": "missing", "message": str(e)}
    import torch.nn.functional as F
    from attention_core.parallel import flash_layout_attention
    try:
        q, k, v, dout, _ = build(dict(B=1, H=4, Hkv=4, n=6, D=8), world, seed=11)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n = q.shape[2] // world
        mine = [slice_rows(t, rank, n).transpose(1, 2).contiguous() for t in (q, k, v)]  # [B, N/P, H, D]
        attn = UlyssesAttention(None, attn_type=AttnType.TORCH_MATH)
        attn.attn_fn = flash_layout_attention
        out = attn(*mine, causal=True).transpose(1, 2)
        return {"outcome": "ok", "err": (out - slice_rows(ref, rank, n)).abs().max().item()}
    except Exception as e:  # noqa: BLE001
        return {"outcome": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}


def traffic_case(rank, world):
    """Bytes this rank hands to torch.distributed.isend in ring_attention's forward and backward (GQA, float64),
    without and with causal (zigzag), and the (query, key) pairs of the blocks its forward computes."""
    import torch.distributed as dist
    from attention_core import parallel
    from attention_core.parallel import ring as ring_module  # where ring_attention looks block_forward up
    sent, real, pairs, real_block = [], dist.isend, [], ring_module.block_forward

    def counting(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, *args, **kwargs)

    def block(q, k, *args, **kwargs):
        pairs.append(q.shape[2] * k.shape[2])
        return real_block(q, k, *args, **kwargs)

    spec = dict(B=1, H=4, Hkv=2, n=4, D=8, Dv=4)  # n = 4: even, so the causal ring goes zigzag
    q, k, v, dout, _ = build(spec, world, seed=13)
    n, res = spec["n"], {}
    dist.isend, ring_module.block_forward = counting, block
    try:
        for causal in (False, True):
            mine = [slice_rows(t, rank, n).clone().requires_grad_(True) for t in (q, k, v)]
            sent.clear()
            pairs.clear()
            out = parallel.ring_attention(*mine, is_causal=causal, enable_gqa=True)
            forward = sum(sent)
            sent.clear()
            out.backward(slice_rows(dout, rank, n))
            res[causal] = (forward, sum(sent))
            res["work", causal] = sum(pairs)
    finally:
        dist.isend, ring_module.block_forward = real, real_block
    return res


def zero_heads_case(rank, world):
    """Issue 22.8: zero query heads (and kv heads) give torch's empty result, with and without lse and gradients
    (Ulysses raised ZeroDivisionError); q heads over zero kv heads is a ValueError on every rank. After them a valid
    call on the same group is exact."""
    import torch.nn.functional as F
    from attention_core import parallel
    res = {}
    for algo in ALGOS:
        fn = getattr(parallel, f"{algo}_attention")
        for name, (H, Hkv) in {"no_heads": (0, 0), "no_q_heads_gqa": (0, 2), "no_kv_heads_gqa": (4, 0)}.items():
            q = torch.randn(1, H, 3, 8, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(1, Hkv, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
            t0 = time.perf_counter()
            try:
                out, lse = fn(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
                grads = torch.autograd.grad(out.sum() + lse.sum(), (q, k, v))
                want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                res[(algo, name)] = {"outcome": "ok", "out": (tuple(out.shape), str(out.dtype)),
                                     "want": (tuple(want.shape), str(want.dtype)), "lse": tuple(lse.shape),
                                     "grads": [(tuple(g.shape), bool((g == 0).all())) for g in grads],
                                     "plain": tuple(fn(q, k, v, enable_gqa=True).shape)}
            except Exception as e:  # noqa: BLE001
                res[(algo, name)] = {"outcome": type(e).__name__, "message": str(e)}
            res[(algo, name)]["seconds"] = time.perf_counter() - t0
        q = rank_slice(rank)
        res[(algo, "after")] = (fn(q, q, q) - self_attention_rows(world, rank)).abs().max().item()
    return res


def rank_slice(rank):
    """Rank `rank`'s slice [1, 4, 3, 8] of a sequence whose every rank draws the same seeded tensor plus its rank."""
    return torch.randn(1, 4, 3, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + rank


def self_attention_rows(world, rank):
    """torch's SDPA of the whole sequence of rank_slice()s (q = k = v), rank `rank`'s rows."""
    import torch.nn.functional as F
    full = torch.cat([rank_slice(r) for r in range(world)], dim=2)
    return F.scaled_dot_product_attention(full, full, full)[:, :, rank * 3:(rank + 1) * 3]


def transform_on_one_rank_case(rank, world):
    """Rank 1 alone calls inside torch.func.grad (the others plainly): every rank raises the same
    NotImplementedError before anything is sent, naming the function and the transform, and the group works
    after it. Then every rank under torch.func.jvp: the same, and forward_ad dual tensors on rank 0 alone."""
    from attention_core import parallel
    res = {}
    q = rank_slice(rank)
    for algo in ALGOS:
        fn = getattr(parallel, f"{algo}_attention")
        calls = {
            "grad_on_rank1": lambda: (torch.func.grad(lambda x: fn(x, q, q).sum())(q) if rank == 1 else fn(q, q, q)),
            "jvp_everywhere": lambda: torch.func.jvp(lambda x: fn(x, q, q), (q,), (q,)),
            "dual_on_rank0": lambda: _dual_call(fn, q) if rank == 0 else fn(q, q, q),
        }
        for name, call in calls.items():
            t0 = time.perf_counter()
            try:
                call()
                res[(algo, name)] = {"outcome": "returned"}
            except Exception as e:  # noqa: BLE001
                res[(algo, name)] = {"outcome": type(e).__name__, "message": str(e)}
            res[(algo, name)]["seconds"] = time.perf_counter() - t0
        res[(algo, "after")] = (fn(q, q, q) - self_attention_rows(world, rank)).abs().max().item()
    return res


def _dual_call(fn, q):
    import torch.autograd.forward_ad as fwAD
    with fwAD.dual_level():
        return fn(fwAD.make_dual(q, torch.ones_like(q)), q, q)


def subgroup_case(rank, world):
    """Two sequence-parallel groups side by side in the world, {0, 2} and {1, 3} (as xDiT's sp groups within a
    larger world): each runs its own problem; the ring addresses its neighbours by their global ranks."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from attention_core import parallel
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, r = groups[rank % 2], rank // 2
    spec = dict(B=1, H=4, Hkv=4, n=4, D=8)
    q, k, v, dout, _ = build(spec, 2, seed=20 + rank % 2)
    n, res = spec["n"], {}
    for algo in ALGOS:
        for causal in (False, True):
            try:
                mine = [slice_rows(t, r, n).clone().requires_grad_(True) for t in (q, k, v)]
                out = getattr(parallel, f"{algo}_attention")(*mine, is_causal=causal, group=group)
                out.backward(slice_rows(dout, r, n))
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                ref.backward(dout)
                res[algo, causal] = max([(out - slice_rows(ref, r, n)).abs().max().item()] + [
                    (t.grad - slice_rows(l.grad, r, n)).abs().max().item() for t, l in zip(mine, leaves)])
            except Exception as e:  # noqa: BLE001
                res[algo, causal] = f"{type(e).__name__}: {e}"
    return res


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise torch.OutOfMemoryError("injected: out of memory on rank 1 in the backward")


def _inject(module, algo, kind, rank):
    """Make rank 1 run out of memory where `kind` says (a real exception raised inside the call, the others
    unaware), by replacing a function in `module` (attention_core.parallel.ulysses or .ring, where the call looks
    it up); returns the function that undoes it."""
    if rank != 1 or "rank1_oom" not in kind:
        return lambda: None
    backward = kind.endswith("backward")
    name = "scaled_dot_product_attention" if algo == "ulysses" else "block_backward" if backward else "block_forward"
    real, calls = getattr(module, name), [0]

    def failing(*a, **kw):
        calls[0] += 1
        where = "in the backward" if backward else "in the forward"
        if algo == "ring" and calls[0] >= 2:  # the second block: K/V of the first step are already in flight
            raise torch.OutOfMemoryError(f"injected: out of memory on rank 1 {where}")
        if algo == "ulysses" and not backward:  # the engine on this rank's head shard
            raise torch.OutOfMemoryError(f"injected: out of memory on rank 1 {where}")
        res = real(*a, **kw)
        if algo == "ulysses":  # the engine's gradient fails
            return (_FailInBackward.apply(res[0]), res[1]) if isinstance(res, tuple) else _FailInBackward.apply(res)
        return res

    setattr(module, name, failing)
    return lambda: setattr(module, name, real)


def recovery_case(algo, kind, rank, world):
    """On a fresh group: the failing call (with backward), then a valid call with backward, checked in float64."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from attention_core import parallel
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=RECOVER_TIMEOUT_S))
    fn = getattr(parallel, f"{algo}_attention")
    causal = kind.startswith("causal")
    spec = dict(B=1, H=4, Hkv=4, n=4, D=8)
    q, k, v, dout, _ = build(spec, world, seed=5)
    n = spec["n"]
    engine = {"unknown_tier": {"tier": "fastest"}, "unknown_option": {"block_size": 16},
              "budget_too_small": {"memory_budget": 1}}.get(kind.replace("rank1_", ""), {})
    if kind.startswith("rank1_") and rank != 1:
        engine = {}
    res = {}
    undo = _inject(importlib.import_module(f"attention_core.parallel.{algo}"), algo, kind, rank)
    t0 = time.perf_counter()
    try:
        mine = [slice_rows(t, rank, n).clone().requires_grad_(True) for t in (q, k, v)]
        fn(*mine, is_causal=causal, group=group, **engine).backward(slice_rows(dout, rank, n))
        res["error"] = {"outcome": "returned"}
    except Exception as e:  # noqa: BLE001
        res["error"] = {"outcome": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0}
    finally:
        undo()
    t0 = time.perf_counter()
    try:
        mine = [slice_rows(t, rank, n).clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*mine, is_causal=causal, group=group)
        out.backward(slice_rows(dout, rank, n))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        ref.backward(dout)
        err = max([(out - slice_rows(ref, rank, n)).abs().max().item()] + [
            (t.grad - slice_rows(r.grad, rank, n)).abs().max().item() for t, r in zip(mine, leaves)])
        res["after"] = {"outcome": "ok", "err": err, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001
        res["after"] = {"outcome": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - t0}
    return res


def worker(rank, world, init, out_dir):
    sys.path.insert(0, ROOT)
    import torch.distributed as dist
    from attention_core import parallel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    results = {}
    only = os.environ.get("PARALLEL_TEST_ONLY")  # debugging: a comma-separated subset of CASES
    for name, spec in CASES.items():
        if only and name not in only.split(","):
            continue
        for algo in ALGOS:
            t0 = time.perf_counter()
            try:
                results[(name, algo)] = {"outcome": "ok", **run_case(name, spec, algo, rank, world)}
            except Exception as e:  # noqa: BLE001 - recorded for the test to judge
                results[(name, algo)] = {"outcome": type(e).__name__, "message": str(e),
                                         "trace": traceback.format_exc(), "seconds": time.perf_counter() - t0}
    results[("yunchang", "ulysses")] = yunchang_case(rank, world)
    if not only:
        results[("traffic", "ring")] = traffic_case(rank, world)
        results[("zero_heads", "both")] = zero_heads_case(rank, world)
        results[("transform_on_one_rank", "both")] = transform_on_one_rank_case(rank, world)
        if world == 4:
            results[("subgroups", "both")] = subgroup_case(rank, world)
    if not only or "recover" in only:
        for algo, kind in RECOVERY:
            results[("recover", algo, kind)] = recovery_case(algo, kind, rank, world)
    if not only:  # last, as it leaves its group broken: rank 1 never calls, the others must not hang
        absent = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=ABSENT_TIMEOUT_S))
        q = torch.randn(1, 4, 6, 8)
        for algo in ALGOS:
            t0 = time.perf_counter()
            if rank == 1:
                results[("absent_rank", algo)] = {"outcome": "did not call"}
                continue
            try:
                getattr(parallel, f"{algo}_attention")(q, q, q, group=absent)
                results[("absent_rank", algo)] = {"outcome": "returned"}
            except Exception as e:  # noqa: BLE001
                results[("absent_rank", algo)] = {"outcome": type(e).__name__, "message": str(e),
                                                  "seconds": time.perf_counter() - t0}
            break  # the group is broken now
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)
    if only:
        dist.destroy_process_group()
    # else the absent-rank group is broken (its ranks timed out, one never joined): tearing gloo down then races
    # the other ranks' teardown and can abort the process after its results are written. Exit without it.
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------------------------------------------------
# test side

_RUNS = {}


def start_group(world, tmp_root):
    out_dir = os.path.join(tmp_root, f"world{world}")
    os.makedirs(out_dir, exist_ok=True)
    init = "file://" + os.path.join(out_dir, "rendezvous")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return out_dir, [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world),
                                       init, out_dir], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                     for r in range(world)]


def collect_group(world, out_dir, procs, deadline):
    """{rank: {(case, algo): result}} once every worker has exited (a hang past the deadline fails the test)."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"the {world}-process group did not finish in time (a hang)")
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{logs[r][-4000:]}"
    runs = {}
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
            runs[r] = pickle.load(f)
    return runs


def run_group(world, tmp_root):
    """Start every world size's workers at once (they share the CPUs); return the results for `world`."""
    if not _RUNS:
        started = {w: start_group(w, tmp_root) for w in WORLDS}
        deadline = time.monotonic() + 600
        for w, (out_dir, procs) in started.items():
            _RUNS[w] = collect_group(w, out_dir, procs, deadline)
    return _RUNS[world]


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("parallel"))
    return lambda world: run_group(world, root)


# ---------------------------------------------------------------------------------------------------------------
# in this process, before the process groups start: the pieces the ranks are made of, and one rank alone (a gloo
# group of size 1: the agreement, its messages and the P = 1 path run here in milliseconds)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of this process alone (world size 1), torn down after the module's in-process tests."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    init = "file://" + str(tmp_path_factory.mktemp("one_rank") / "rendezvous")
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sdpa_and_lse(q, k, v, mask=None, causal=False, scale=None):
    """torch's math SDPA and the logsumexp of its scaled, masked scores (float64, GQA by head count)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    return out, reference_lse(q, k, mask, causal, scale)


def test_zigzag_chunks_pair_each_chunk_with_its_mirror():
    """docs/multi-gpu.md: rank r of P works on chunks r and 2P-1-r of 2P; every chunk has exactly one rank."""
    from attention_core.parallel import zigzag_chunks
    assert [zigzag_chunks(r, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [zigzag_chunks(r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for P in (1, 3, 5):
        assert sorted(c for r in range(P) for c in zigzag_chunks(r, P)) == list(range(2 * P))


def test_merge_partial_of_key_blocks_is_attention_over_all_keys():
    """The ring's merge: partial (out, lse) over disjoint key blocks, merged in either order, give attention and
    lse over all the keys; rows that no block has given a key keep out 0 and lse -inf (no NaN), and a block
    where a row has no key leaves that row as it was."""
    from attention_core.parallel.blocks import block_forward, merge_partial
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 12, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 3, 12, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 12, dtype=torch.bool)
    mask[1, 4:] = False  # row 1: keys only in the first block
    mask[2, :4] = False  # row 2: keys only in the second block
    mask[3] = False  # row 3: no key at all
    ref, ref_lse = _sdpa_and_lse(q, k, v, mask[None, None], scale=0.3)
    blocks = [block_forward(q, k[:, :, s], v[:, :, s], mask[:, s], False, 0.3, {})
              for s in (slice(0, 4), slice(4, 12))]
    for order in ((0, 1), (1, 0)):
        out = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
        lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
        for i in order:
            merge_partial(out, lse, *blocks[i])
        assert torch.isfinite(out).all()
        assert torch.equal(out[:, :, 3], torch.zeros(2, 3, 6)) and (lse[:, :, 3] == float("-inf")).all()
        rows = [0, 1, 2, 4]
        assert (out[:, :, rows] - ref[:, :, rows]).abs().max() < 1e-12, order
        assert (lse[:, :, rows] - ref_lse[:, :, rows]).abs().max() < 1e-12, order
    # float32 blocks merge into a float64 accumulator in place (the ring's running result)
    out = torch.zeros(2, 3, 5, 6, dtype=torch.float64)
    lse = torch.full((2, 3, 5), float("-inf"), dtype=torch.float64)
    merge_partial(out, lse, blocks[0][0].float(), blocks[0][1])
    assert out.dtype == torch.float64 and (out[:, :, 0] - blocks[0][0][:, :, 0]).abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_block_forward_is_attention_with_lse_in_the_accumulation_dtype(dtype):
    """A ring block (GQA by head count, the causal diagonal block): torch's attention and the logsumexp of the
    scores; lse float32, float64 for float64 inputs (docs/multi-gpu.md, return_lse)."""
    from attention_core.parallel.blocks import block_forward
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, lse = block_forward(q.to(dtype), k.to(dtype), v.to(dtype), None, True, 0.5, {})
    ref, ref_lse = _sdpa_and_lse(q, k, v, causal=True, scale=0.5)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-2}[dtype]
    assert (out.double() - ref).abs().max() < tol and (lse.double() - ref_lse).abs().max() < tol


@pytest.mark.parametrize("mask_kind", ["key_padding", "full", "none"])
def test_block_backward_sums_to_torchs_gradients(mask_kind):
    """Each K/V block's gradient given the GLOBAL out and lse (and the gradient of lse): the blocks' dq sum to
    torch's dq, their dk, dv and dmask are torch's for their keys (dmask summed over the mask's broadcast dims,
    in the mask's shape and dtype); without need_dmask no mask gradient is computed. Float64 inputs give float64,
    float32 inputs float32 (the accumulation dtype)."""
    from attention_core.parallel.blocks import block_backward
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 10, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = {"key_padding": torch.randn(2, 1, 1, 10, generator=g, dtype=torch.float64),
            "full": torch.randn(2, 4, 5, 10, generator=g, dtype=torch.float64), "none": None}[mask_kind]
    leaves = [q, k, v] + ([mask.requires_grad_(True)] if mask is not None else [])
    dout = torch.randn(2, 4, 5, 6, generator=g, dtype=torch.float64)
    dlse = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    ref, ref_lse = _sdpa_and_lse(q, k, v, mask, scale=0.4)
    want = torch.autograd.grad([ref, ref_lse], leaves, [dout, dlse])
    out, lse = ref.detach(), ref_lse.detach()
    dq = 0
    parts = []
    for s in (slice(0, 3), slice(3, 10)):
        m = None if mask is None else mask.detach()[..., s]
        got = block_backward(dout, q.detach(), k.detach()[:, :, s], v.detach()[:, :, s], out, lse, m, False, 0.4, {},
                             dlse, need_dmask=mask is not None)
        assert all(t.dtype == torch.float64 for t in got[:3])
        if mask is None:
            assert got[3] is None
        else:
            assert got[3].shape == m.shape and got[3].dtype == torch.float64
        dq = dq + got[0]
        parts.append(got[1:])
    assert (dq - want[0]).abs().max() < 1e-12
    for i in range(2 + (mask is not None)):
        assert (torch.cat([p[i] for p in parts], dim=-2 if i < 2 else -1) - want[1 + i]).abs().max() < 1e-12
    # float32 inputs: float32 gradients, and no mask gradient unless asked for
    got = block_backward(dout.float(), q.detach().float(), k.detach().float(), v.detach().float(), out.float(),
                         lse.float(), None if mask is None else mask.detach().float(), False, 0.4, {}, None)
    assert [t.dtype for t in got[:3]] == [torch.float32] * 3 and got[3] is None


def test_input_descriptions_read_as_shapes_and_dtypes():
    """What the disagreement message shows for each rank's q, k, v and mask."""
    from attention_core.parallel.group import _describe, _fmt
    assert _fmt(_describe(torch.zeros(2, 4, 6, 8))) == "(2, 4, 6, 8) float32"
    assert _fmt(_describe(torch.zeros(6, 8, dtype=torch.float64))) == "(6, 8) float64"
    assert _fmt(_describe(torch.zeros(7, dtype=torch.bool))) == "(7,) bool"
    assert _fmt(_describe(torch.zeros(1, 2, 3, dtype=torch.bfloat16))) == "(1, 2, 3) bfloat16"
    assert _fmt(_describe(torch.zeros(1, 2, 3, 4, dtype=torch.float16))) == "(1, 2, 3, 4) float16"
    assert _fmt(_describe(torch.zeros(1, 2, dtype=torch.int32))) == "(1, 2) other"
    assert _fmt(_describe(None)) == "None"
    assert _fmt(_describe([1.0])) == "not a tensor"
    assert _describe(torch.zeros(1, 2, 3, 4, dtype=torch.float16)) != _describe(torch.zeros(1, 2, 3, 4))


def test_ring_mask_blocks_are_the_owners_key_columns():
    """Without zigzag each rank holds one chunk: the mask block of owner j's keys is columns j*n .. (j+1)*n of the
    rank's rows; a mask without a row or key dim is passed whole along it."""
    from attention_core.parallel.ring import _Ring
    n, P = 3, 4
    full = torch.arange(2 * 1 * n * n * P, dtype=torch.float64).reshape(2, 1, n, n * P)
    for mask, want in ((full, lambda j: full[..., j * n:(j + 1) * n]),
                       (full[:, :, :1], lambda j: full[:, :, :1, j * n:(j + 1) * n]),
                       (full[..., :1], lambda j: full[..., :1])):
        ring = _Ring(None, 1, P, [1], n, False, 1.0, mask, {})
        for owner in range(P):
            (qs, ks, diag, m), = ring.pairs(owner)
            assert (qs, ks, diag) == (slice(0, n), slice(0, n), False)
            assert torch.equal(m, want(owner)), owner
    causal = _Ring(None, 1, P, [1], n, True, 1.0, None, {})
    assert [[diag for _, _, diag, _ in causal.pairs(o)] for o in range(P)] == [[False], [True], [], []]


@pytest.mark.parametrize("algo", ALGOS)
def test_one_rank_is_torchs_attention(one_rank, algo):
    """P = 1: the engine on the whole sequence, as torch's SDPA (default scale 1/sqrt(E), GQA, masks, lse)."""
    from attention_core import parallel
    fn = getattr(parallel, f"{algo}_attention")
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, 7, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 7, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.randn(7, 7, generator=g, dtype=torch.float64)
    ref, ref_lse = _sdpa_and_lse(q, k, v, mask[None, None])
    out, lse = fn(q, k, v, mask, enable_gqa=True, return_lse=True)
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    ref, _ = _sdpa_and_lse(q, k, v, causal=True, scale=0.2)
    assert (fn(q, k, v, is_causal=True, scale=0.2, enable_gqa=True) - ref).abs().max() < 1e-12


@pytest.mark.parametrize("algo", ALGOS)
def test_one_rank_under_torch_func_is_the_engines_own(one_rank, algo):
    """P = 1 crosses no rank: torch.func transforms and forward-mode AD are the engine's, exact (the refusal is for
    calls across ranks only)."""
    from attention_core import parallel
    from reference import math_sdpa
    fn = getattr(parallel, f"{algo}_attention")
    g = torch.Generator().manual_seed(9)
    q, k, v, t = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(4))
    for f in (torch.func.grad, torch.func.jacfwd):
        got = f(lambda q: fn(q, k, v, is_causal=True).sin().sum())(q)
        want = f(lambda q: math_sdpa(q, k, v, is_causal=True).sin().sum())(q)
        assert (got - want).abs().max() < 1e-12
    got = torch.func.vmap(lambda q: fn(q, k, v))(torch.stack([q, 2 * q]))
    assert (got - torch.func.vmap(lambda q: math_sdpa(q, k, v))(torch.stack([q, 2 * q]))).abs().max() < 1e-12
    assert fn(q[:, :0], k[:, :0], v[:, :0]).shape == (1, 0, 5, 4)  # zero heads: torch's empty result


def _raised(fn, *args, **kwargs):
    with pytest.raises(Exception) as e:
        fn(*args, **kwargs)
    return type(e.value).__name__, str(e.value)


REJECTED = ("{fn} (rank 0 of 1): rank(s) [0] rejected the call, so every rank stops here before anything is sent; "
            "rank 0: ")


@pytest.mark.parametrize("algo", ALGOS)
def test_one_rank_names_what_is_wrong_with_its_inputs(one_rank, algo):
    """Issue 17.7 / docs/multi-gpu.md: a malformed input or option raises a ValueError naming the rank and the
    problem, before anything is sent. Every check, with the value at its boundary accepted."""
    from attention_core import parallel
    fn_name = f"{algo}_attention"
    fn = getattr(parallel, fn_name)
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    pre = REJECTED.format(fn=fn_name)
    cases = [
        ((q[0], q, q), {}, "q must be [B, H, N/P, D] (4-D), got shape (4, 6, 8)"),
        ((q, q[None], q), {}, "k must be [B, H, N/P, D] (4-D), got shape (1, 1, 4, 6, 8)"),
        ((q, q, "v"), {}, "v must be a tensor, got str"),
        ((q.long(), q.long(), q.long()), {}, "q, k, v must share one floating dtype, got torch.int64, torch.int64, "
                                             "torch.int64"),
        ((q, q.float(), q), {}, "q, k, v must share one floating dtype, got torch.float64, torch.float32, "
                                "torch.float64"),
        ((q, q, q.float()), {}, "q, k, v must share one floating dtype, got torch.float64, torch.float64, "
                                "torch.float32"),
        ((q, q[:, :2], q), {}, "shapes do not fit together: q (1, 4, 6, 8), k (1, 2, 6, 8), v (1, 4, 6, 8) "
                               "(expected q [B, H, n, E], k [B, Hkv, n, E], v [B, Hkv, n, Ev])"),
        ((q, q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1)), {}, "shapes do not fit together: q (1, 4, 6, 8), "
         "k (2, 4, 6, 8), v (2, 4, 6, 8) (expected q [B, H, n, E], k [B, Hkv, n, E], v [B, Hkv, n, Ev])"),
        ((q, q[..., :4], q), {}, "shapes do not fit together: q (1, 4, 6, 8), k (1, 4, 6, 4), v (1, 4, 6, 8) "
                                 "(expected q [B, H, n, E], k [B, Hkv, n, E], v [B, Hkv, n, Ev])"),
        ((q, q, q[:, :, :5]), {}, "shapes do not fit together: q (1, 4, 6, 8), k (1, 4, 6, 8), v (1, 4, 5, 8) "
                                  "(expected q [B, H, n, E], k [B, Hkv, n, E], v [B, Hkv, n, Ev])"),
        ((q, q[:, :, :5], q[:, :, :5]), {}, "q holds 6 tokens but k/v hold 5: sequence-parallel attention is "
         "self-attention over one sharded sequence (call plain SDPA for cross-attention to unsharded keys)"),
        ((q, q, q), {"attn_mask": [1.0]}, "attn_mask must be a tensor or None, got list"),
        ((q, q, q), {"attn_mask": torch.ones(6, dtype=torch.bool), "is_causal": True},
         "attn_mask and is_causal=True together are not allowed (as in torch's SDPA)"),
        ((q, q, q), {"attn_mask": torch.ones(1, 1, 1, 6, 6)}, "attn_mask must have 1 to 4 dims, got shape "
                                                              "(1, 1, 1, 6, 6)"),
        ((q, q, q), {"attn_mask": torch.tensor(1.0)}, "attn_mask must have 1 to 4 dims, got shape ()"),
        ((q, q, q), {"attn_mask": torch.ones(6, dtype=torch.int64)}, "attn_mask must be bool or floating point "
                                                                     "(as in torch's SDPA), got torch.int64"),
        ((q, q, q), {"dropout_p": 1.5}, "dropout_p must be in [0, 1], got 1.5"),
        ((q, q, q), {"dropout_p": -0.25}, "dropout_p must be in [0, 1], got -0.25"),
        ((q, q, q), {"return_lse": 1}, "return_lse must be True or False, got 1"),
        ((q, q[:, :2], q[:, :2]), {}, "q has 4 heads but k/v have 2: pass enable_gqa=True for grouped-query "
                                      "attention (as torch's SDPA requires)"),
        ((q, q[:, :3], q[:, :3]), {"enable_gqa": True}, "GQA needs q heads (4) divisible by k/v heads (3)"),
        ((q, q, q), {"tier": "fastest"}, "tier must be one of ('auto', 'chunked', 'inplace', 'online'), got "
                                         "'fastest'"),
        ((q, q, q), {"block_size": 16, "blocks": 2}, "unknown option(s) ['block_size', 'blocks']; the engine "
         "options are ['tier', 'block_q', 'block_kv', 'memory_budget', 'precision', 'flush_to_zero'] (plus "
         "return_lse); torch's SDPA arguments are attn_mask, dropout_p, is_causal, scale, enable_gqa"),
    ]
    for args, kwargs, problem in cases:
        assert _raised(fn, *args, **kwargs) == ("ValueError", pre + problem), (args, kwargs)
    # the boundaries are accepted: a 1-D and a 4-D mask, dropout 0 (and 1 for Ulysses: the ring has none), GQA
    assert fn(q, q, q, attn_mask=torch.ones(6, dtype=torch.bool)).shape == (1, 4, 6, 8)
    assert fn(q, q, q, attn_mask=torch.zeros(1, 1, 6, 6, dtype=torch.float64), dropout_p=0.0).shape == (1, 4, 6, 8)
    assert fn(q, q[:, :2], q[:, :2], enable_gqa=True).shape == (1, 4, 6, 8)
    if algo == "ulysses":
        assert torch.equal(fn(q, q, q, dropout_p=1.0), torch.zeros_like(q))
    else:
        assert _raised(fn, q, q, q, dropout_p=1.0) == (
            "NotImplementedError", "ring_attention: dropout_p=1.0 is not supported by the ring (its blocks would "
            "need one dropout pattern across ranks); use ulysses_attention for dropout.")


@pytest.mark.parametrize("algo", ALGOS)
def test_one_rank_names_the_mask_dim_that_does_not_broadcast(one_rank, algo):
    """The mask holds this rank's query rows and all N key columns; a dim that is neither 1 nor full is named."""
    from attention_core import parallel
    fn_name = f"{algo}_attention"
    fn = getattr(parallel, fn_name)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    for shape, what, size in (((3, 1, 1, 6), "batch", 3), ((1, 2, 1, 6), "heads", 2),
                              ((5, 6), "query rows (N/P)", 5), ((5,), "key columns (all N tokens)", 5)):
        mask = torch.ones(shape, dtype=torch.bool)
        assert _raised(fn, q, q, q, attn_mask=mask) == ("ValueError", (
            f"{fn_name}: attn_mask of shape {shape} does not broadcast to [B, H, N/P, N] = [2, 4, 6, 6] (its {what} "
            f"dim is {size}); each rank passes its own query rows and every key column.")), shape
    for shape in ((2, 4, 6, 6), (2, 1, 1, 6), (1, 4, 1, 1), (6, 1)):
        assert fn(q, q, q, attn_mask=torch.ones(shape, dtype=torch.bool)).shape == q.shape, shape


def test_with_gloo_the_small_exchanges_go_through_the_cpu(one_rank):
    """gloo carries CPU tensors: the agreement and the error exchange use the CPU whatever device the inputs are on
    (here the meta device, which has no data to send: the call still agrees, rejects or runs)."""
    from attention_core.parallel import ring_attention, ulysses_attention
    from attention_core.parallel.group import _comm_device
    q = torch.randn(1, 4, 6, 8, device="meta")
    assert _comm_device(None, q) == torch.device("cpu")
    for fn in (ulysses_attention, ring_attention):
        assert fn(q, q, q).shape == (1, 4, 6, 8)
        kind, msg = _raised(fn, q, q, q, tier="fastest")
        assert kind == "ValueError" and msg.endswith("rank 0: tier must be one of ('auto', 'chunked', 'inplace', "
                                                     "'online'), got 'fastest'"), msg


def test_one_rank_shares_at_most_480_bytes_of_its_message(one_rank):
    """The error text every rank receives is cut at 480 bytes (docs/multi-gpu.md: one all-gather of 480 bytes)."""
    from attention_core.parallel import ulysses_attention
    q = torch.randn(1, 4, 6, 8)
    name = "x" * 600
    full = (f"unknown option(s) ['{name}']; the engine options are ['tier', 'block_q', 'block_kv', "
            f"'memory_budget', 'precision', 'flush_to_zero'] (plus return_lse)")
    kind, msg = _raised(ulysses_attention, q, q, q, **{name: 1})
    pre = REJECTED.format(fn="ulysses_attention")
    assert kind == "ValueError" and msg.startswith(pre)
    assert msg[len(pre):] == full[:480]


def test_flash_layout_attention_is_flash_attn_funcs_convention():
    """[B, L, H, D] tensors, GQA by head count, softmax_scale and causal as flash_attn_func; what the engine does
    not have raises NotImplementedError naming every option given."""
    from attention_core.parallel import flash_layout_attention
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 7, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    for kw in ({}, {"softmax_scale": 0.25}, {"causal": True}):
        ref, _ = _sdpa_and_lse(*(t.transpose(1, 2) for t in (q, k, v)), causal=kw.get("causal", False),
                               scale=kw.get("softmax_scale"))
        out = flash_layout_attention(q, k, v, **kw)
        assert out.shape == (2, 7, 4, 8) and (out - ref.transpose(1, 2)).abs().max() < 1e-12, kw
    for kw, said in (({"window_size": (4, 0)}, "window_size=(4, 0), softcap=0.0, alibi_slopes=None, "
                                               "return_attn_probs=False"),
                     ({"window_size": [-1, 2]}, "window_size=[-1, 2], softcap=0.0, alibi_slopes=None, "
                                                "return_attn_probs=False"),
                     ({"softcap": 30.0}, "window_size=(-1, -1), softcap=30.0, alibi_slopes=None, "
                                         "return_attn_probs=False"),
                     ({"alibi_slopes": torch.ones(4)}, "window_size=(-1, -1), softcap=0.0, alibi_slopes=set, "
                                                       "return_attn_probs=False"),
                     ({"return_attn_probs": True}, "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
                                                   "return_attn_probs=True")):
        assert _raised(flash_layout_attention, q, k, v, **kw) == ("NotImplementedError", (
            f"flash_layout_attention: {said} are not supported by the tiled engine; only dropout_p, softmax_scale "
            f"and causal are")), kw
    assert flash_layout_attention(q, k, v, window_size=[-1, -1]).shape == (2, 7, 4, 8)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_rank(groups, world, algo, case):
    spec = CASES[case]
    want = expected(spec, algo)
    runs = groups(world)
    for rank in range(world):
        res = runs[rank][(case, algo)]
        where = f"{algo} {case} rank {rank}/{world}"
        if want != "ok":
            assert res["outcome"] == want, f"{where}: expected {want} on every rank, got {res}"
            assert res["seconds"] < GROUP_TIMEOUT_S / 2, f"{where}: the error took {res['seconds']:.1f} s"
            continue
        assert res["outcome"] == "ok", f"{where}: {res.get('trace', res)}"
        assert res["finite"], where
        if spec.get("autocast"):
            assert res["dtype"] == "torch.bfloat16", where
        if "err" not in res:
            continue
        if res["torch_err"] is not None:  # fp32: within a few times torch's own fp32 error
            for what, e, te, s in zip(("out", "dq", "dk", "dv"), res["err"], res["torch_err"], res["scale"]):
                assert e <= 8 * te + 1e-6 * s, f"{where} {what}: error {e:.3g} vs torch fp32 {te:.3g}"
        else:
            if spec.get("no_grad"):
                assert res["what"] == ["out", "lse"] and res["no_grad"], where
            else:
                n_what = 4 + bool(spec.get("mask_grad")) + bool(spec.get("lse"))
                assert len(res["err"]) == len(res["what"]) == n_what, where
            for what, e, s in zip(res["what"], res["err"], res["scale"]):
                assert e <= 1e-10 * max(1.0, s), f"{where} {what}: max error {e:.3g} (scale {s:.3g})"


def test_zigzag_balances_causal_work():
    """Causal ring: with the zigzag layout every rank attends the same number of (query, key) pairs."""
    from attention_core.parallel.ring import _Ring, zigzag_chunks

    def work(seg, P, chunks_of=None):
        ring = _Ring(None, 0, P, seg, 1, True, 1.0, None, {})
        if chunks_of:
            ring.chunks_of = chunks_of
        return sum(0.5 if diag else 1.0 for owner in range(P) for _, _, diag, _ in ring.pairs(owner))

    for P in (2, 4, 8):
        zig = [work(zigzag_chunks(r, P), P) for r in range(P)]
        assert len(set(zig)) == 1 and sum(zig) == (2 * P) ** 2 / 2, zig
        contiguous = [work([r], P, lambda o: [o % P]) for r in range(P)]
        assert contiguous == [r + 0.5 for r in range(P)]  # what the zigzag avoids: rank P-1 does 2P-1 times more


@pytest.mark.parametrize("world", WORLDS)
def test_zero_heads_give_torchs_empty_result(groups, world):
    """Issue 22.8 (Ulysses raised ZeroDivisionError): no query heads give torch's empty out [B, 0, N/P, Ev] and lse
    [B, 0, N/P] with zero (empty) gradients, on every rank, without an exchange; query heads over no kv heads raise
    the same ValueError on every rank; the group works after both."""
    runs = groups(world)
    for rank in range(world):
        res = runs[rank][("zero_heads", "both")]
        for algo in ALGOS:
            where = f"{algo} rank {rank}/{world}"
            for name in ("no_heads", "no_q_heads_gqa"):
                r = res[(algo, name)]
                assert r["outcome"] == "ok", f"{where} {name}: {r}"
                assert r["out"] == r["want"] == ((1, 0, 3, 8), "torch.float64"), f"{where} {name}: {r}"
                assert r["lse"] == (1, 0, 3) and r["plain"] == (1, 0, 3, 8), f"{where} {name}: {r}"
                kv = 0 if name == "no_heads" else 2
                assert r["grads"] == [((1, 0, 3, 8), True), ((1, kv, 3, 8), True), ((1, kv, 3, 8), True)], r
                assert r["seconds"] < GROUP_TIMEOUT_S / 2, f"{where} {name}: {r}"
            r = res[(algo, "no_kv_heads_gqa")]
            assert r["outcome"] == "ValueError", r
            assert "GQA needs q heads (4) divisible by k/v heads (0)" in r["message"], r
            assert res[(algo, "after")] < 1e-12, where


@pytest.mark.parametrize("world", WORLDS)
def test_torch_func_across_ranks_is_refused_on_every_rank(groups, world):
    """One rank alone under torch.func.grad, every rank under torch.func.jvp, one rank with dual tensors: every
    rank raises the same NotImplementedError before anything is sent, naming the function and the transform; the
    group works after each."""
    runs = groups(world)
    for algo in ALGOS:
        for name, who, what in (
                ("grad_on_rank1", [1], r"torch\.func transforms \(active here: grad\)"),
                ("jvp_everywhere", list(range(world)), r"torch\.func transforms \(active here: jvp\)"),
                ("dual_on_rank0", [0], r"forward-mode AD \(torch\.autograd\.forward_ad dual tensors\)")):
            messages = set()
            for rank in range(world):
                r = runs[rank][("transform_on_one_rank", "both")][(algo, name)]
                assert r["outcome"] == "NotImplementedError", f"{algo} {name} rank {rank}/{world}: {r}"
                assert r["seconds"] < GROUP_TIMEOUT_S / 2, r
                messages.add(re.sub(r"\(rank \d+ of", "(rank r of", r["message"]))
            assert len(messages) == 1, messages
            msg = messages.pop()
            assert re.search(rf"rank\(s\) {re.escape(str(who))} rejected the call.*{algo}_attention does not "
                             rf"support {what} across ranks", msg), msg
        for rank in range(world):
            assert runs[rank][("transform_on_one_rank", "both")][(algo, "after")] < 1e-12


@pytest.mark.parametrize("world", WORLDS)
def test_a_rank_that_never_calls_gives_an_error_not_a_hang(groups, world):
    runs = groups(world)
    assert runs[1][("absent_rank", "ulysses")]["outcome"] == "did not call"
    for rank in [0] + list(range(2, world)):
        res = runs[rank][("absent_rank", "ulysses")]
        assert res["outcome"] == "RuntimeError", res
        assert res["message"].startswith(
            f"ulysses_attention (rank {rank} of {world}): not every rank of the process group joined the call within "
            f"its timeout (each rank must call ulysses_attention the same number of times, in the same order): "
        ), res["message"]
        assert res["seconds"] < ABSENT_TIMEOUT_S + 20, res


@pytest.mark.parametrize("world", WORLDS)
def test_the_ring_sends_each_kv_block_once_round(groups, world):
    """docs/multi-gpu.md: each rank sends its K/V block P-1 times (its kv heads only under GQA, not repeated);
    the backward sends K/V P-1 times and the dK/dV accumulators P times (one more hop home). Causal is the same."""
    runs = groups(world)
    kv = 1 * 2 * 4 * (8 + 4) * 8  # B x Hkv x n x (D + Dv) float64 values of one rank's K and V
    for rank in range(world):
        for causal in (False, True):
            assert runs[rank][("traffic", "ring")][causal] == ((world - 1) * kv, (world - 1) * kv + world * kv), (
                rank, causal)


@pytest.mark.parametrize("world", WORLDS)
def test_the_causal_ring_gives_every_rank_the_same_work(groups, world):
    """docs/multi-gpu.md: causal attention is load-balanced (zigzag): every rank's forward computes 2P + 1 blocks
    of (n/2)^2 (query, key) pairs (its diagonal blocks masked inside), not rank r's 2r + 1 halves; without causal
    each rank computes all P blocks of n^2."""
    runs = groups(world)
    n = 4
    for rank in range(world):
        assert runs[rank][("traffic", "ring")]["work", True] == (2 * world + 1) * (n // 2) ** 2, rank
        assert runs[rank][("traffic", "ring")]["work", False] == world * n * n, rank


def test_two_sequence_parallel_groups_in_one_world(groups):
    """The group may be a subgroup of the world (xDiT's sequence-parallel groups): with {0, 2} and {1, 3} of 4
    ranks, both algorithms are exact in each group, forward and backward, causal or not."""
    runs = groups(4)
    for rank in range(4):
        res = runs[rank][("subgroups", "both")]
        assert set(res) == {(a, c) for a in ALGOS for c in (False, True)}
        for key, err in res.items():
            assert isinstance(err, float) and err < 1e-12, (rank, key, err)


@pytest.mark.parametrize("world", WORLDS)
def test_yunchang_ulysses_with_this_engine(groups, world):
    """The README recipe for yunchang (and xDiT, which attends through it): exact on every rank."""
    runs = groups(world)
    for rank in range(world):
        res = runs[rank][("yunchang", "ulysses")]
        if res["outcome"] == "missing":
            from comfy_harness import missing
            missing(f"yunchang is not installed (pip install --no-deps yunchang==0.6.4): {res['message']}")
        assert res["outcome"] == "ok", res.get("trace", res)
        assert res["err"] < 1e-12, res


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("algo,kind", list(RECOVERY))
def test_an_error_leaves_the_group_usable(groups, world, algo, kind):
    """Issue 17.7: every rank raises promptly (the same message where the inputs are at fault), and the next
    valid call on the same process group gives the right answer on every rank, well within its timeout."""
    runs = groups(world)
    want = RECOVERY[(algo, kind)]
    where_failed = "backward" if kind.endswith("backward") else "forward"
    messages = set()
    for rank in range(world):
        res = runs[rank][("recover", algo, kind)]
        where = f"{algo} {kind} rank {rank}/{world}"
        err = res["error"]
        expect = want if isinstance(want, str) else want.get(rank, want["others"])
        assert err["outcome"] == expect, f"{where}: expected {expect}, got {err}"
        assert err["seconds"] < RECOVER_TIMEOUT_S / 2, f"{where}: the error took {err['seconds']:.1f} s"
        if isinstance(want, str):
            # the same words on every rank; what each rank read of its own free memory may differ by a few MB
            messages.add(re.sub(r"free memory found on (\w+): \d+ MB", r"free memory found on \1: X MB",
                                re.sub(r"\(rank \d+ of \d+\)", "(rank r)", err["message"])))
        elif rank != 1:  # the others name rank 1 and its exception
            assert err["message"] == (
                f"{algo}_attention (rank {rank} of {world}): rank(s) [1] failed during the call, so every rank stops "
                f"here (the process group stays usable). rank 1: OutOfMemoryError: injected: out of memory on rank "
                f"1 in the {where_failed}"), err["message"]
        else:
            assert err["message"] == f"injected: out of memory on rank 1 in the {where_failed}", err["message"]
        after = res["after"]
        assert after["outcome"] == "ok", f"{where}: the next call on the group failed: {after}"
        assert after["err"] < 1e-10 and after["seconds"] < RECOVER_TIMEOUT_S / 2, f"{where}: {after}"
    if isinstance(want, str):
        assert len(messages) == 1, f"{algo} {kind}: the ranks raised different messages: {messages}"
    if kind.endswith("unknown_tier"):
        msg = messages.pop()
        assert "'fastest'" in msg and ("rank(s) [1]" in msg) == kind.startswith("rank1_"), msg
        if not kind.startswith("rank1_"):  # every rank rejected the call for the same reason: said once
            assert f"rank(s) {list(range(world))} rejected the call" in msg and "every one of them: " in msg, msg
            assert msg.count("'fastest'") == 1, msg
    if kind == "unknown_option":
        assert "block_size" in messages.pop()


def _described(q, k, v, mask, requires_grad):
    return (f"q {q} float64, k {k} float64, v {v} float64, mask {mask}, is_causal 0.0, scale (-1: default) -1.0, "
            f"enable_gqa 0.0, dropout_p 0.0, attn_mask requires grad {requires_grad}")


@pytest.mark.parametrize("world", WORLDS)
def test_messages_name_the_problem(groups, world):
    """docs/multi-gpu.md: every rank raises the same ValueError naming the rank(s) and the problem (with its own
    rank in the prefix): each rank's shapes, dtypes and flags where they disagree, each rejecting rank's reason
    (said once when they agree), the head count Ulysses cannot split."""
    runs = groups(world)
    six, seven, four = "(1, 4, 6, 8)", "(1, 4, 7, 8)", "(1, 4, 4, 8)"
    for rank in range(world):
        def msg(case, algo):
            return runs[rank][(case, algo)]["message"]
        assert msg("heads_not_divisible", "ulysses") == (
            f"ulysses_attention: 3 query heads do not split over {world} ranks; Ulysses needs the head count "
            f"divisible by the number of ranks (use ring_attention, or a group of a size dividing 3)")
        for algo in ALGOS:
            fn = f"{algo}_attention (rank {rank} of {world}): "
            disagree = (fn + "the ranks disagree on their inputs; every rank must pass the same shapes, dtype and "
                        "flags (each holding N/P tokens). rank 0: ")
            assert msg("ranks_disagree", algo) == disagree + _described(six, six, six, "None", 0.0) + (
                "; rank 1: " + _described(seven, seven, seven, "None", 0.0))
            assert msg("mask_grad_disagree", algo) == disagree + _described(
                four, four, four, f"(1, 1, 1, {4 * world}) float64", 0.0) + "; rank 1: " + _described(
                four, four, four, f"(1, 1, 1, {4 * world}) float64", 1.0)  # ranks 2, 3 agree with rank 0
            rejected = fn + "rank(s) {} rejected the call, so every rank stops here before anything is sent; "
            assert msg("rank0_malformed", algo) == rejected.format([0]) + (
                "rank 0: q must be [B, H, N/P, D] (4-D), got shape (4, 6, 8)")
            assert msg("ranks_reject_differently", algo) == rejected.format([0, 1]) + (
                "rank 0: q must be [B, H, N/P, D] (4-D), got shape (4, 6, 8); rank 1: q, k, v must share one "
                "floating dtype, got torch.float64, torch.float64, torch.float32")
        assert msg("dropout", "ring") == (
            "ring_attention: dropout_p=0.3 is not supported by the ring (its blocks would need one dropout pattern "
            "across ranks); use ulysses_attention for dropout.")


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
