"""Every SDPA argument against torch's math backend on float64 copies, each tier with tiny tiles."""
import random

import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from reference import reference

TIERS = ["chunked", "inplace", "online"]
TINY = dict(block_q=5, block_kv=7)


def rnd(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def check(out, ref, tol=1e-10):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("tier", TIERS + ["auto"])
@pytest.mark.parametrize("shape", [
    ((3, 11, 8), (3, 13, 8), (3, 13, 8)),  # 3-D (N, L, E)
    ((2, 4, 17, 16), (2, 4, 9, 16), (2, 4, 9, 5)),  # 4-D, Lq != Lkv, Ev != E
    ((2, 3, 2, 10, 8), (2, 3, 2, 12, 8), (2, 3, 2, 12, 8)),  # 5-D
    ((9, 8), (6, 8), (6, 4)),  # 2-D
    ((2, 3, 4, 8), (1, 1, 5, 8), (1, 1, 5, 3)),  # batch and head broadcast
    ((2, 1, 4, 8), (2, 3, 5, 8), (2, 3, 5, 3)),  # query head broadcast
])
def test_shapes(tier, shape):
    q, k, v = (rnd(*s) for s in shape)
    check(sdpa(q, k, v, tier=tier, **TINY), reference(q, k, v))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mshape", [(13, 21), (2, 1, 1, 21), (2, 4, 13, 21), (21,), (1, 4, 1, 21), (13, 1)])
def test_masks(tier, kind, mshape):
    torch.manual_seed(1)
    q, k, v = rnd(2, 4, 13, 8), rnd(2, 4, 21, 8), rnd(2, 4, 21, 6)
    if kind == "bool":
        mask = torch.rand(*mshape) > 0.3
    else:
        mask = torch.randn(*mshape, dtype=torch.float64)
        mask[torch.rand(*mshape) > 0.7] = float("-inf")
    check(sdpa(q, k, v, mask, tier=tier, **TINY), reference(q, k, v, mask))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero(tier, kind):
    q, k, v = rnd(1, 2, 6, 8), rnd(1, 2, 9, 8), rnd(1, 2, 9, 8)
    if kind == "bool":
        mask = torch.ones(6, 9, dtype=torch.bool)
        mask[2] = False
    else:
        mask = torch.zeros(6, 9, dtype=torch.float64)
        mask[2] = float("-inf")
    out = sdpa(q, k, v, mask, tier=tier, block_q=2, block_kv=4)
    ref = reference(q, k, v, mask)
    check(out, ref)
    assert (out[:, :, 2] == 0).all()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("lq,lk", [(13, 13), (7, 19), (19, 7), (1, 9)])
def test_causal_top_left(tier, lq, lk):
    q, k, v = rnd(2, 3, lq, 8), rnd(2, 3, lk, 8), rnd(2, 3, lk, 8)
    check(sdpa(q, k, v, is_causal=True, tier=tier, **TINY), reference(q, k, v, is_causal=True))


@pytest.mark.parametrize("tier", TIERS)
def test_custom_scale(tier):
    q, k, v = rnd(1, 2, 10, 8), rnd(1, 2, 12, 8), rnd(1, 2, 12, 8)
    check(sdpa(q, k, v, scale=0.77, tier=tier, **TINY), reference(q, k, v, scale=0.77))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 1), (4, 4)])
def test_gqa(tier, hq, hkv):
    q, k, v = rnd(2, hq, 11, 8), rnd(2, hkv, 14, 8), rnd(2, hkv, 14, 4)
    mask = torch.rand(2, hq, 11, 14) > 0.2
    check(sdpa(q, k, v, mask, enable_gqa=True, tier=tier, **TINY), reference(q, k, v, mask, enable_gqa=True))
    check(sdpa(q, k, v, is_causal=True, enable_gqa=True, tier=tier, **TINY),
          reference(q, k, v, is_causal=True, enable_gqa=True))


def test_gqa_does_not_materialize_repeated_kv(monkeypatch):
    """K and V reach the GEMMs with Hkv heads: no repeat_interleave / expand copy of size Hq."""
    seen = []
    real = torch.matmul

    def spy(a, b, *args, **kw):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kw)
    monkeypatch.setattr(torch, "matmul", spy)
    q, k, v = rnd(1, 8, 10, 4), rnd(1, 2, 12, 4), rnd(1, 2, 12, 4)
    sdpa(q, k, v, enable_gqa=True, tier="chunked")
    assert seen and all(b[1] == 2 for _, b in seen)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("precision", ["auto", "keep", "fp32"])
@pytest.mark.parametrize("tier", TIERS)
def test_dtypes(dtype, tol, precision, tier):
    torch.manual_seed(2)
    q, k, v = rnd(1, 3, 20, 16, dtype=dtype), rnd(1, 3, 24, 16, dtype=dtype), rnd(1, 3, 24, 16, dtype=dtype)
    mask = torch.rand(20, 24) > 0.2
    out = sdpa(q, k, v, mask, tier=tier, precision=precision, **TINY)
    assert out.dtype == dtype
    check(out, reference(q, k, v, mask), tol)


def test_errors_match_torch():
    q = rnd(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="same dtype"):
        sdpa(q, q.float(), q)
    with pytest.raises(RuntimeError, match="is_causal"):
        sdpa(q, q, q, torch.ones(4, 4, dtype=torch.bool), is_causal=True)
    with pytest.raises(RuntimeError, match="divide"):
        sdpa(rnd(1, 6, 4, 8), rnd(1, 4, 4, 8), rnd(1, 4, 4, 8), enable_gqa=True)
    with pytest.raises(RuntimeError, match="broadcast"):
        sdpa(q, q, q, torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="tier"):
        sdpa(q, q, q, tier="fast")
    with pytest.raises(RuntimeError, match="key and value sequence lengths differ: 4 vs 3"):
        sdpa(q, q, rnd(1, 2, 3, 8))


@pytest.mark.parametrize("tier", TIERS)
def test_a_zero_head_dim_averages_the_values_as_torch_does(tier):
    """E = 0 (queries and keys of width 0, values not): every score is 0 with the default scale, so each row is
    the plain mean of the values, as torch's math SDPA gives; forward and gradients."""
    q, k, v = rnd(2, 3, 4, 0), rnd(2, 3, 5, 0), rnd(2, 3, 5, 6)
    v.requires_grad_(True)
    out = sdpa(q, k, v, tier=tier)
    check(out, reference(q, k, v))
    check(out, v.mean(dim=-2, keepdim=True).expand(2, 3, 4, 6))
    out.sum().backward()
    check(v.grad, torch.full_like(v, 4 / 5))


def test_empty_sequences():
    q, k, v = rnd(2, 3, 4, 8), rnd(2, 3, 0, 8), rnd(2, 3, 0, 5)
    check(sdpa(q, k, v), reference(q, k, v))
    check(sdpa(rnd(2, 3, 0, 8), rnd(2, 3, 5, 8), rnd(2, 3, 5, 5)), reference(rnd(2, 3, 0, 8), rnd(2, 3, 5, 8),
                                                                          rnd(2, 3, 5, 5)))


@pytest.mark.parametrize("seed", range(12))
def test_random_sweep(seed):
    """Random shapes, masks, GQA, causal, scale and tiles: every tier equals torch's math SDPA."""
    r = random.Random(seed)
    B, hkv, g = r.randint(1, 3), r.randint(1, 3), r.choice([1, 1, 2, 3])
    gqa = g > 1
    lq, lk, e, ev = r.randint(1, 40), r.randint(1, 40), r.choice([4, 8, 16]), r.choice([4, 8, 12])
    q, k, v = rnd(B, hkv * g, lq, e), rnd(B, hkv, lk, e), rnd(B, hkv, lk, ev)
    causal = r.random() < 0.3
    mask = None
    if not causal and r.random() < 0.6:
        shape = r.choice([(lq, lk), (B, 1, 1, lk), (B, hkv * g, lq, lk), (1, hkv * g, 1, lk)])
        mask = torch.rand(*shape) > 0.25 if r.random() < 0.5 else torch.randn(*shape, dtype=torch.float64)
    scale = r.choice([None, 0.3, 1.7])
    ref = reference(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    for tier in TIERS:
        out = sdpa(q, k, v, mask, is_causal=causal, scale=scale, enable_gqa=gqa, tier=tier,
                   block_q=r.randint(1, 9), block_kv=r.randint(1, 9))
        check(out, ref)


def test_non_tensor_arguments_are_named():
    q = rnd(1, 2, 4, 8)
    with pytest.raises(TypeError, match="query"):
        sdpa([1, 2], q, q)
    with pytest.raises(TypeError, match="key"):
        sdpa(q, None, q)
    with pytest.raises(TypeError, match="attn_mask"):
        sdpa(q, q, q, attn_mask=[[True]])
