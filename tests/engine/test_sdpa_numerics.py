"""Half precision: overflow guard, flush-to-zero, bf16 -> fp16 only when values fit; dropout expectation."""
import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.numerics import FTZ_THRESHOLD, choose_numerics
from reference import math_sdpa, reference

TIERS = ["chunked", "inplace", "online"]


@pytest.mark.parametrize("tier", TIERS)
def test_fp16_scores_beyond_fp16_range_stay_finite(tier):
    """|q.k * scale| ~ 1e6 > 65504: torch's fp16 math gives inf/NaN, the engine recomputes those tiles in fp32."""
    torch.manual_seed(6)
    q = (torch.randn(1, 2, 16, 64) * 40).half()
    k = (torch.randn(1, 2, 24, 64) * 40).half()
    k[..., 3, :] = q[..., 0, :]  # one huge aligned score
    v = torch.randn(1, 2, 24, 64).half()
    ref = reference(q, k, v)
    out = sdpa(q, k, v, tier=tier, precision="keep", block_q=4, block_kv=8)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("tier", TIERS)
def test_fp16_value_sums_do_not_overflow(tier):
    """Unnormalised weights x V summed over many keys could pass 65504 in fp16; the result must not."""
    q = torch.zeros(1, 1, 4, 8).half()
    k = torch.zeros(1, 1, 3000, 8).half()
    v = torch.full((1, 1, 3000, 8), 60000.0).half()
    out = sdpa(q, k, v, tier=tier, precision="keep", block_q=4, block_kv=3000)
    assert torch.isfinite(out).all()
    assert (out.float() - 60000).abs().max() <= 64


@pytest.mark.parametrize("tier", TIERS)
def test_flush_to_zero_makes_negligible_keys_weigh_nothing(tier):
    """One key 25 above 20000 others: with flush-to-zero (default in fp16) the others weigh exactly 0,
    not 20000 * e^-25 (~3e-7 of the mass, which e^-20 clamping would make 4e-5)."""
    n = 20000
    q = torch.zeros(1, 1, 2, 4)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 4)
    k[..., 0, 0] = 25.0 * 2  # scale = 1/2 -> score 25 for key 0, 0 for the rest
    v = torch.zeros(1, 1, n, 4)
    v[..., 0, :] = 1.0
    v[..., 1:, :] = 1000.0
    out16 = sdpa(q.half(), k.half(), v.half(), tier=tier, precision="keep", block_q=2, block_kv=4096)
    assert torch.equal(out16.float(), torch.ones(1, 1, 2, 4))
    # fp32 keeps them, as torch does. Values of 1e5 make each negligible key's share (e^-25 * 1e5 = 1.4e-6) large
    # enough to survive fp32 accumulation in any summation order (1000 does not: MKL's sequential sum drops
    # 1.4e-8 steps against 1.0), so the check does not depend on which BLAS runs the matmuls.
    v32 = v.clone()
    v32[..., 1:, :] = 1e5
    out32 = sdpa(q, k, v32, tier=tier, block_q=2, block_kv=4096)
    ref = reference(q, k, v32)
    torch_err = (math_sdpa(q, k, v32).double() - ref).abs().max()
    assert (out32.double() - ref).abs().max() <= max(2 * torch_err, 1e-6 * ref.abs().max())
    assert (out32 - 1).abs().min() > 0.02  # 20000 * e^-25 * 1e5 = 0.028 of the output: not flushed in fp32


def test_flush_to_zero_threshold_is_exact_zero_below():
    from attention_core.kernel.numerics import flush_to_zero_
    s = torch.tensor([0.0, -19.99, -20.0, -20.01, -1e4, float("nan")])
    w = flush_to_zero_(s.clone()).exp()
    assert w[1] > 0 and w[3] == 0 and w[4] == 0 and torch.isnan(w[5])
    assert FTZ_THRESHOLD == -20.0


def test_bf16_to_fp16_only_when_values_fit():
    dev = torch.device("cpu")
    small = torch.randn(4, 4).bfloat16()
    big = small.clone()
    big[0, 0] = 1e6
    assert choose_numerics(torch.bfloat16, dev, "fp16", (small,)).compute == torch.float16
    assert choose_numerics(torch.bfloat16, dev, "fp16", (small, big)).compute == torch.float32
    assert choose_numerics(torch.bfloat16, dev, "keep", (big,)).compute == torch.bfloat16
    assert choose_numerics(torch.bfloat16, dev, "auto", (big,)).compute == torch.float32  # CPU: fp32 is faster
    assert choose_numerics(torch.float16, dev, "keep").ftz and not choose_numerics(torch.float32, dev).ftz


def test_bf16_out_of_fp16_range_is_exact_and_bf16():
    torch.manual_seed(7)
    q, k = torch.randn(1, 2, 8, 16).bfloat16(), torch.randn(1, 2, 8, 16).bfloat16()
    v = (torch.randn(1, 2, 8, 16) * 1e5).bfloat16()  # beyond fp16's range
    out = sdpa(q, k, v, precision="fp16")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = reference(q, k, v)
    assert ((out.double() - ref).abs() / ref.abs().max()).max() < 1e-2


def test_bf16_converted_to_fp16_is_accurate():
    torch.manual_seed(8)
    q, k, v = (torch.randn(1, 2, 30, 16).bfloat16() for _ in range(3))
    out = sdpa(q, k, v, precision="fp16", block_q=8)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference(q, k, v)).abs().max() < 2e-2


@pytest.mark.parametrize("tier", TIERS)
def test_dropout_has_torch_expectation(tier):
    """E[out] with dropout equals the output without it (torch scales kept weights by 1/(1-p))."""
    torch.manual_seed(9)
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    ref = reference(q, k, v)
    runs = torch.stack([sdpa(q, k, v, dropout_p=0.4, tier=tier, block_q=3, block_kv=4) for _ in range(3000)])
    assert (runs.double().mean(0) - ref).abs().max() < 0.06
    kept = (runs == 0).float().mean()
    assert kept < 0.5  # the output is a sum over kept keys; zeros are rare


def test_dropout_is_reproducible_and_independent_of_tiling():
    q, k, v = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    outs = []
    for tier, bq, bk in [("chunked", 4, None), ("inplace", 9, None), ("online", 2, 5)]:
        torch.manual_seed(42)
        outs.append(sdpa(q, k, v, dropout_p=0.5, tier=tier, block_q=bq, block_kv=bk))
    assert all(torch.allclose(outs[0], o, atol=1e-6) for o in outs[1:])
    assert not torch.allclose(outs[0], sdpa(q, k, v))


def test_dropout_one_gives_zeros():
    q = torch.randn(1, 2, 4, 8)
    assert torch.equal(sdpa(q, q, q, dropout_p=1.0), torch.zeros(1, 2, 4, 8))


@pytest.mark.parametrize("tier", TIERS)
def test_autocast_like_torch_and_tiles_keep_their_dtype(tier):
    """Under autocast torch's SDPA computes in the autocast dtype; the engine does the same, and autocast does
    not reach inside it (its fp32 tiles stay fp32)."""
    torch.manual_seed(13)
    q, k, v = torch.randn(1, 2, 20, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        got = sdpa(q, k, v, tier=tier, block_q=8, block_kv=8, precision="fp32")
    assert got.dtype == want.dtype == torch.bfloat16
    ref = reference(q.bfloat16(), k.bfloat16(), v.bfloat16())
    rel = ((got.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max()
    assert rel <= 2 ** -8  # within bf16's final rounding: with autocast inside, bf16 matmuls gave ~2x that


def test_the_fp16_backward_guard_counts_the_dropout_rescaling():
    """The backward's fp16 guard bounds the dV partial sums by rows x max|dO| / (1 - p): kept weights are scaled up
    by 1 / (1 - p). 64 rows x max|dO| 400 = 25,600 fits fp16's safe range (32,752) without dropout; with p = 0.5
    the bound is 51,200 and the backward must switch to fp32 (everything else here is tiny)."""
    from attention_core.kernel.numerics import FP16_SAFE, choose_numerics
    from attention_core.kernel.problem import normalize
    from attention_core.kernel.tiers.backward import backward_dtype
    from attention_core.kernel.tiles import TileSource
    q = torch.full((1, 1, 64, 16), 0.01, dtype=torch.float16)
    dout = torch.zeros(1, 1, 1, 64, 16, dtype=torch.float16)
    dout[..., 0, 0] = 400
    assert 64 * 400 < FP16_SAFE <= 64 * 400 / 0.5
    got = {}
    for p in (0.0, 0.5):
        src = TileSource(normalize(q, q, q, dropout_p=p), choose_numerics(torch.float16, q.device, "fp16"))
        got[p] = backward_dtype(src, dout, 64, 64)
    assert got == {0.0: torch.float16, 0.5: torch.float32}
