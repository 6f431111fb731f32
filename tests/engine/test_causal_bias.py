"""torch.nn.attention.bias.CausalBias masks handled exactly as torch's SDPA does (issue 9 item 2): directly,
through the global patch, forward and backward, and torch's ValueError with is_causal=True."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import attention_core
from attention_core import scaled_dot_product_attention as sdpa
from reference import f64

TIERS = ["chunked", "inplace", "online"]
MAKERS = {"upper_left": causal_upper_left, "lower_right": causal_lower_right}


def torch_ref(q, k, v, bias):
    """torch's own handling of the bias (its __torch_function__), on float64 copies; fully masked rows are 0."""
    leaves = [f64(t).requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=bias)
    return leaves, out


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("variant", list(MAKERS))
@pytest.mark.parametrize("lq,lk", [(6, 6), (4, 9), (9, 4)])
def test_causal_bias_forward_and_backward_match_torch(tier, variant, lq, lk):
    g = torch.Generator().manual_seed(lq * 10 + lk)
    q = torch.randn(2, 3, lq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, lk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lower right with lq > lk warns about NaNs
        bias = MAKERS[variant](lq, lk)
    leaves, ref = torch_ref(q, k, v, bias)
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(dout)
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa(*xs, attn_mask=bias, tier=tier, block_q=3, block_kv=4)
    ok = torch.isfinite(ref)  # torch may give NaN on rows with no key (lower right, lq > lk); ours gives 0
    assert (out[ok] - ref[ok]).abs().max() < 1e-12
    out.backward(dout)
    for a, b in zip(xs, leaves):
        if torch.isfinite(b.grad).all():
            assert (a.grad - b.grad).abs().max() < 1e-11


def test_causal_bias_with_is_causal_raises_torchs_error():
    q = torch.randn(1, 1, 4, 8)
    for make in MAKERS.values():
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            F.scaled_dot_product_attention(q, q, q, attn_mask=make(4, 4), is_causal=True)
        with pytest.raises(ValueError, match="CausalBias should not be used with causal=True"):
            sdpa(q, q, q, attn_mask=make(4, 4), is_causal=True)


@pytest.mark.parametrize("variant", list(MAKERS))
def test_causal_bias_through_the_global_patch(variant, monkeypatch):
    import attention_core.sdpa as sd
    calls = []
    real = sd.scaled_dot_product_attention
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 7, 8, dtype=torch.float64)
    bias = MAKERS[variant](4, 7)
    want = F.scaled_dot_product_attention(q, k, k, attn_mask=bias)
    with attention_core.patched(force=True):
        got = F.scaled_dot_product_attention(q, k, k, attn_mask=bias)
        with pytest.raises(ValueError, match="CausalBias"):
            F.scaled_dot_product_attention(q, k, k, attn_mask=bias, is_causal=True)
    assert calls, "the engine was not used"
    assert (got - want).abs().max() < 1e-12
