"""Normalisers, accumulators and unnormalised P V products that could leave the compute dtype's range, where
torch's result is finite (issue 9 item 1): every tier against torch's math SDPA in float64."""
import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from reference import math_sdpa, reference

TIERS = ["chunked", "inplace", "online"]


@pytest.mark.parametrize("tier", TIERS)
def test_fp16_softmax_denominator_beyond_fp16_range(tier):
    """q = 0: 70000 keys of weight exactly 1, so l = 70000 > 65504; torch gives the mean of v = 1."""
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(1, 1, 4, 8, dtype=torch.float16)
    k = torch.randn(1, 1, 70000, 8, generator=g).half()
    v = torch.ones(1, 1, 70000, 8, dtype=torch.float16)
    out = sdpa(q, k, v, tier=tier, precision="input")
    assert out.dtype == torch.float16
    assert (out.double() - reference(q, k, v)).abs().max() < 1e-3, out[0, 0, :, 0]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_near_the_dtype_max_stay_finite(tier, dtype):
    """|v| near the dtype's max: torch's normalised P @ V is finite, so must ours be (forward and backward)."""
    g = torch.Generator().manual_seed(1)
    big = torch.finfo(dtype).max / 3
    q, k = (torch.randn(1, 2, 9, 8, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    v = (torch.rand(1, 2, 9, 4, generator=g, dtype=torch.float64) * 2 - 1).to(dtype) * big
    ref = reference(q, k, v)
    assert torch.isfinite(ref).all()
    out = sdpa(q, k, v, tier=tier, block_q=4, block_kv=4)
    assert torch.isfinite(out).all()
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-12), rel
    # the backward recomputes with the values as they are: finite wherever torch's own (same dtype) is
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    sdpa(*xs, tier=tier, block_q=4, block_kv=4).sum().backward()
    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    math_sdpa(*ys).sum().backward()
    for a, b in zip(xs, ys):
        assert torch.isfinite(a.grad[torch.isfinite(b.grad)]).all()
