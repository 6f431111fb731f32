"""The raw ops (attention_forward -> (out, lse), attention_backward given O and L) and return_lse, against
float64 torch references: lse = torch.logsumexp of the scaled, masked float64 scores."""
import math

import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.ops import attention_backward, attention_forward
from reference import math_sdpa

TIERS = ["chunked", "inplace", "online"]
TINY = dict(block_q=3, block_kv=4)


def ref_scores(q, k, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """Scaled, masked float64 scores in torch's layout (the definition of lse's argument), differentiable."""
    q, k = q.double(), k.double()
    if enable_gqa:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.double()
    return s


def case(name, dtype=torch.float64):
    g = torch.Generator().manual_seed(hash(name) % 1000)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    q, k, v = r(2, 4, 7, 8), r(2, 4, 9, 8), r(2, 4, 9, 6)
    kw = {}
    if name == "causal":
        kw = {"is_causal": True}
    elif name == "bool_mask":  # row 2 sees no key
        m = torch.rand(7, 9, generator=g) > 0.3
        m[2] = False
        kw = {"attn_mask": m}
    elif name == "float_mask":
        kw = {"attn_mask": r(1, 4, 7, 9)}
    elif name == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw = {"enable_gqa": True}
    return q, k, v, kw


CASES = ["plain", "causal", "bool_mask", "float_mask", "gqa"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", CASES)
def test_forward_returns_out_and_lse(tier, name):
    q, k, v, kw = case(name)
    out, lse = attention_forward(q, k, v, tier=tier, **TINY, **kw)
    s = ref_scores(q, k, **kw)
    assert lse.dtype == torch.float64 and lse.shape == s.shape[:-1]
    ref_lse = torch.logsumexp(s, -1)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max() < 1e-12
    assert (out - math_sdpa(q, k, v, **kw)).abs().max() < 1e-12
    if name == "bool_mask":
        assert torch.isneginf(lse[:, :, 2]).all() and (out[:, :, 2] == 0).all()


def test_forward_lse_is_float32_for_half_inputs():
    q, k, v, _ = case("plain", torch.float16)
    out, lse = attention_forward(q, k, v)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert (lse.double() - torch.logsumexp(ref_scores(q, k), -1)).abs().max() < 1e-2


@pytest.mark.parametrize("name", CASES)
def test_backward_given_out_and_lse_matches_torch(name):
    q, k, v, kw = case(name)
    dout = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    out, lse = attention_forward(q, k, v, **kw)
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, **TINY, **kw)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    math_sdpa(*leaves, **kw).backward(dout)
    for a, b in zip((dq, dk, dv), leaves):
        assert a.shape == b.shape and (a - b.grad).abs().max() < 1e-12


@pytest.mark.parametrize("tier", TIERS)
def test_ring_blocks_with_global_out_and_lse_sum_to_the_full_gradient(tier):
    """Ring attention: per K/V block forward, merge (out, lse) by log-sum-exp, per block backward with the
    GLOBAL out and lse; dq summed over blocks and dk, dv per block are the full attention's gradients."""
    q, k, v, _ = case("plain")
    dout = torch.randn(2, 4, 7, 6, dtype=torch.float64)
    blocks = [(0, 4), (4, 9)]
    parts = [attention_forward(q, k[:, :, a:b], v[:, :, a:b], tier=tier, **TINY) for a, b in blocks]
    lse = torch.logsumexp(torch.stack([p[1] for p in parts]), 0)
    out = sum(torch.exp(l - lse).unsqueeze(-1) * o for o, l in parts)
    assert (out - math_sdpa(q, k, v)).abs().max() < 1e-12
    grads = [attention_backward(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, **TINY) for a, b in blocks]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    math_sdpa(*leaves).backward(dout)
    assert (sum(g[0] for g in grads) - leaves[0].grad).abs().max() < 1e-12
    assert (torch.cat([g[1] for g in grads], 2) - leaves[1].grad).abs().max() < 1e-12
    assert (torch.cat([g[2] for g in grads], 2) - leaves[2].grad).abs().max() < 1e-12


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", CASES)
def test_return_lse_is_differentiable_in_both_outputs(tier, name):
    q, k, v, kw = case(name)
    mask = kw.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        mask = kw["attn_mask"] = mask.clone().requires_grad_(True)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = sdpa(*xs, tier=tier, return_lse=True, **TINY, **kw)
    g = torch.Generator().manual_seed(5)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    fin = torch.isfinite(lse)
    ((out * w_out).sum() + (lse[fin] * w_lse[fin]).sum()).backward()
    got = [t.grad for t in xs] + ([mask.grad] if mask is not None and mask.requires_grad else [])

    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kw_ref = dict(kw)
    if mask is not None and mask.requires_grad:
        kw_ref["attn_mask"] = m2 = mask.detach().clone().requires_grad_(True)
    s = ref_scores(*ys[:2], **kw_ref)
    ref_lse = torch.logsumexp(s, -1)
    ref_out = math_sdpa(*ys, **kw_ref)
    ((ref_out * w_out).sum() + (ref_lse[fin] * w_lse[fin]).sum()).backward()
    want = [t.grad for t in ys] + ([m2.grad] if mask is not None and mask.requires_grad else [])
    for a, b in zip(got, want):
        assert (a - b).abs().max() < 1e-11


def test_public_sdpa_still_matches_torch_on_fully_masked_rows():
    q, k, v, kw = case("bool_mask")
    out = sdpa(q, k, v, **kw)
    assert torch.equal(torch.isnan(out), torch.isnan(math_sdpa(q, k, v, **kw)))
    assert (out - math_sdpa(q, k, v, **kw)).abs().max() < 1e-12
