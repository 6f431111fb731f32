"""Lines of attention_core/kernel/ that no other in-process engine test executes (issue 22.11: a mutant on a line no
test runs always survives). Each test reaches its line through the public API where one does (the SDPA function,
torch.func / forward_ad, the registered custom ops) and asserts what the line computes: results against torch's
math SDPA on float64 copies, the exact error text, or the value. GPU-only queries run with stand-ins (monkeypatched
torch.cuda / torch.xpu functions) that play the backend's contract."""
import logging
import math
import sys

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from attention_core import scaled_dot_product_attention as sdpa
from reference import f64, math_sdpa, reference


def rand(*shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# ---- autograd.py: what torch.compile traces under forward-mode AD ----------------------------------------------

def _canonical(seed=0, Lq=5, Lk=7, G=2):
    q5 = rand(1, 2, G, Lq, 4, seed=seed)
    k4 = rand(1, 2, Lk, 4, seed=seed + 1)
    v4 = rand(1, 2, Lk, 3, seed=seed + 2)
    return q5, k4, v4


def _ref5(q5, k4, v4, mask5=None, causal=False, scale=0.5):
    """math SDPA on the canonical layout (k, v broadcast over the G query heads), float64."""
    k, v = k4.unsqueeze(2).expand(-1, -1, q5.shape[2], -1, -1), v4.unsqueeze(2).expand(-1, -1, q5.shape[2], -1, -1)
    return math_sdpa(f64(q5), f64(k), f64(v), f64(mask5), is_causal=causal, scale=scale)


def _lse5(q5, k4, mask5=None, scale=0.5):
    s = torch.matmul(f64(q5) * scale, f64(k4).unsqueeze(2).transpose(-1, -2))
    if mask5 is not None:
        s = s.masked_fill(~mask5, float("-inf")) if mask5.dtype == torch.bool else s + f64(mask5)
    return torch.logsumexp(s, -1)


def test_compiled_call_under_forward_mode_is_traced_as_plain_attention(monkeypatch):
    """While torch.compile traces (stand-in: torch.compiler.is_compiling() True) inside an open forward_ad level,
    tiled_attention takes plain_attention with the call's causal flag, offset, scale and dropout; outside forward
    mode (no level, no transform) it does not."""
    from attention_core.kernel import autograd
    calls = []
    real = autograd.plain_attention

    def spy(*args):
        calls.append(args[5:])
        return real(*args)

    monkeypatch.setattr(autograd, "plain_attention", spy)
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    q5, k4, v4 = _canonical()
    config = (True, 2, 0.5, 0.0, "auto", None, None, None, "auto", None)
    with fwAD.dual_level():
        out5, lse = autograd.tiled_attention(q5, k4, v4, None, None, *config)
    assert calls == [(True, 2, 0.5, 0.0)]
    rows = torch.arange(5).view(-1, 1) + 2
    mask = torch.arange(7).view(1, -1) <= rows
    torch.testing.assert_close(f64(out5), _ref5(q5, k4, v4, mask, scale=0.5), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, _lse5(q5, k4, mask), rtol=1e-10, atol=1e-10)
    # with dropout: the call's p and seed, the same keep bits as the tiled op
    calls.clear()
    seed = torch.tensor(99)
    with fwAD.dual_level():
        out_d, _ = autograd.tiled_attention(q5, k4, v4, None, seed, True, 2, 0.5, 0.25, *config[4:])
    assert calls == [(True, 2, 0.5, 0.25)]
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: False)
    tiled, _, _ = autograd.attention_fwd(q5, k4, v4, None, seed, True, 2, 0.5, 0.25, *config[4:], True)
    torch.testing.assert_close(out_d, tiled, rtol=1e-10, atol=1e-10)
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    calls.clear()
    autograd.tiled_attention(q5, k4, v4, None, None, *config)  # compiling, but no forward mode possible
    assert calls == []


def test_plain_attention_matches_math_sdpa_and_gives_minus_inf_lse_on_empty_rows():
    """plain_attention (the compiled forward-mode path): O and L of math SDPA; a row whose keys are all masked has
    O = 0 and L = -inf; with dropout the same keep bits as the tiled op (the same seed)."""
    from attention_core.kernel import autograd
    q5, k4, v4 = _canonical(seed=3)
    mask5 = torch.ones(1, 1, 1, 5, 7, dtype=torch.bool)
    mask5[..., 1, :] = False  # row 1 sees no key
    mask5[..., 3, 2:5] = False
    out5, lse = autograd.plain_attention(q5, k4, v4, mask5, None, False, 0, 0.5, 0.0)
    ref = _ref5(q5, k4, v4, mask5)
    ref[..., 1, :] = 0.0
    torch.testing.assert_close(out5, ref, rtol=1e-10, atol=1e-10)
    assert out5.dtype == torch.float64 and lse.shape == (1, 2, 2, 5)
    want = _lse5(q5, k4, mask5)
    assert torch.isneginf(lse[..., 1]).all() and torch.isneginf(want[..., 1]).all()
    keep = ~torch.isneginf(want)
    torch.testing.assert_close(lse[keep], want[keep], rtol=1e-10, atol=1e-10)
    # bf16 inputs: computed in the statistics dtype (fp32), O returned in the input dtype, L in fp32
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q5, k4, v4))
    outb, lseb = autograd.plain_attention(qb, kb, vb, None, None, False, 0, 0.5, 0.0)
    assert outb.dtype == torch.bfloat16 and lseb.dtype == torch.float32
    torch.testing.assert_close(f64(outb), _ref5(qb, kb, vb), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(f64(lseb), _lse5(qb, kb), rtol=1e-6, atol=1e-6)
    # dropout: the tiled op's keep bits
    seed = torch.tensor(1234)
    out_d, lse_d = autograd.plain_attention(q5, k4, v4, None, seed, False, 0, 0.5, 0.3)
    tiled, tlse, _ = autograd.attention_fwd(q5, k4, v4, None, seed, False, 0, 0.5, 0.3, "chunked", None, None,
                                            None, "auto", None, True)
    torch.testing.assert_close(out_d, tiled, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_d, tlse, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(out_d, autograd.plain_attention(q5, k4, v4, None, None, False, 0, 0.5, 0.0)[0])


def test_double_backward_at_dropout_one_gives_zero_gradients_and_plain_attention_zero_output():
    """dropout_p = 1 drops every weight: the differentiable backward (create_graph=True) gives dq = dk = dv = 0
    (not nan from 0 / (1 - 1)); plain_attention gives O = 0 with L of the scores."""
    from attention_core.kernel import autograd
    q, k, v = (rand(1, 2, 4, 3, seed=s).requires_grad_(True) for s in (10, 11, 12))
    out = sdpa(q, k, v, dropout_p=1.0)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out), create_graph=True)
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g)), g
    q5, k4, v4 = _canonical(seed=5)
    out5, lse = autograd.plain_attention(q5, k4, v4, None, torch.tensor(7), False, 0, 0.5, 1.0)
    assert torch.equal(out5, torch.zeros_like(out5))
    torch.testing.assert_close(lse, _lse5(q5, k4), rtol=1e-10, atol=1e-10)


def test_the_ops_are_registered_as_tiled_attention_fwd_and_bwd():
    """The documented op names (README, autograd.py): tiled_attention::fwd / ::bwd for the attention_core package.
    (Before this test the namespace came from the module's parent, attention_core.kernel, and read
    tiled_attention_attention_core_kernel.)"""
    from attention_core.kernel import autograd
    assert autograd.NS == "tiled_attention"
    assert torch.ops.tiled_attention.fwd.default._name == "tiled_attention::fwd"
    assert torch.ops.tiled_attention.bwd.default._name == "tiled_attention::bwd"


def _bwd_args(q5, k4, v4, mask5=None):
    out5, lse, rowmax = torch.ops.tiled_attention.fwd(q5, k4, v4, mask5, None, False, 0, 0.5, 0.0, "chunked", None,
                                                      None, None, "auto", None, True)
    return out5, lse, rowmax


def test_vmapped_backward_op_without_dlse_or_row_max():
    """tiled_attention::bwd under vmap with dlse = None and row max = None (both optional): the unbatched Nones
    stay None, and each sample's gradients are those of math SDPA for its dO."""
    q5, k4, v4 = _canonical(seed=20)
    out5, lse, _ = _bwd_args(q5, k4, v4)
    douts = rand(3, *out5.shape, seed=23)

    def bwd(do):
        return torch.ops.tiled_attention.bwd(do, None, q5, k4, v4, None, out5, lse, None, None, False, 0, 0.5, 0.0,
                                             False, "chunked", None, None, None, "auto", None)[:3]

    dq, dk, dv = torch.vmap(bwd)(douts)
    for i in range(3):
        leaves = [f64(t).requires_grad_(True) for t in (q5, k4, v4)]
        ref = math_sdpa(leaves[0], leaves[1].unsqueeze(2).expand(-1, -1, 2, -1, -1),
                        leaves[2].unsqueeze(2).expand(-1, -1, 2, -1, -1), scale=0.5)
        want = torch.autograd.grad(ref, leaves, douts[i])
        for got, w in zip((dq[i], dk[i], dv[i]), want):
            torch.testing.assert_close(got, w, rtol=1e-9, atol=1e-9)


def test_vmapped_backward_op_refuses_a_vmapped_dropout_seed():
    q5, k4, v4 = _canonical(seed=30)
    out5, lse, rowmax = _bwd_args(q5, k4, v4)
    seeds = torch.tensor([1, 2])

    def bwd(seed):
        return torch.ops.tiled_attention.bwd(torch.ones_like(out5), None, q5, k4, v4, None, out5, lse, rowmax, seed,
                                             False, 0, 0.5, 0.1, False, "chunked", None, None, None, "auto", None)[0]

    with pytest.raises(RuntimeError, match=r"^tiled attention under vmap: the dropout seed cannot be vmapped$"):
        torch.vmap(bwd)(seeds)


@pytest.mark.parametrize("mask_batch", [1, 2])
@pytest.mark.parametrize("vmap_mask", [False, True])
def test_vmapped_backward_op_gives_the_float_mask_gradient_summed_over_the_batch_it_broadcast_over(mask_batch,
                                                                                                   vmap_mask):
    """tiled_attention::bwd under vmap with need_dmask: dmask per sample, summed over the batch where the mask
    broadcast over it (mask batch 1, B = 2), as autograd sums a broadcast mask's gradient; the mask itself either
    shared by the samples or vmapped with them."""
    q5 = rand(2, 2, 1, 4, 3, seed=40)
    k4, v4 = rand(2, 2, 4, 3, seed=41), rand(2, 2, 4, 3, seed=42)
    masks = rand(3, mask_batch, 2, 1, 4, 4, seed=43)
    douts = rand(3, 2, 2, 1, 4, 3, seed=44)
    fwd = [_bwd_args(q5, k4, v4, masks[i]) for i in range(3)]

    def bwd(do, m, out5, lse, rowmax):
        return torch.ops.tiled_attention.bwd(do, None, q5, k4, v4, m, out5, lse, rowmax, None, False, 0, 0.5, 0.0,
                                             True, "chunked", None, None, None, "auto", None)

    if vmap_mask:
        outs = [torch.stack(t) for t in zip(*fwd)]
        dq, dk, dv, dm = torch.vmap(bwd)(douts, masks, *outs)
    else:
        dq, dk, dv, dm = torch.vmap(bwd, in_dims=(0, None, None, None, None))(douts, masks[0], *fwd[0])
    assert dm.shape == (3, mask_batch, 2, 1, 4, 4)
    for i in range(3):
        m64 = masks[i if vmap_mask else 0].clone().requires_grad_(True)
        ref = math_sdpa(q5, k4.unsqueeze(2), v4.unsqueeze(2), m64, scale=0.5)
        (want,) = torch.autograd.grad(ref, m64, douts[i])
        torch.testing.assert_close(dm[i], want, rtol=1e-9, atol=1e-9)


# ---- problem.py: validation with torch's rules, CausalBias, head groups -----------------------------------------

def test_head_group_of_all_heads_is_the_problem_itself():
    from attention_core.kernel.problem import normalize
    p = normalize(rand(1, 3, 4, 2, seed=1), rand(1, 3, 4, 2, seed=2), rand(1, 3, 4, 2, seed=3))
    assert p.head_group(0, 3) is p
    sub = p.head_group(1, 3)
    assert sub is not p and sub.Hkv == 2 and sub.head_offset == 1 and sub.heads_total == 3


@pytest.mark.parametrize("shapes, msg", [
    (((2, 1, 4, 8), (3, 1, 4, 8), (3, 1, 4, 8)), "batch sizes 2 and 3 do not broadcast"),
    (((1, 6, 4, 8), (1, 2, 4, 8), (1, 3, 4, 8)), "key/value head sizes 2 and 3 do not broadcast"),
    (((1, 4, 4, 8), (1, 3, 4, 8), (1, 3, 4, 8)), "query/key head sizes 4 and 3 do not broadcast"),
    (((1, 1, 4, 8), (1, 1, 4, 6), (1, 1, 4, 8)), "query and key head dims differ: 8 vs 6"),
])
def test_shapes_that_do_not_broadcast_are_named(shapes, msg):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(RuntimeError, match="^scaled_dot_product_attention: " + msg + "$"):
        sdpa(q, k, v)


def test_causal_bias_on_a_torch_without_it_passes_the_arguments_through(monkeypatch):
    """torch < 2.3 has no torch.nn.attention.bias: the mask and is_causal pass through unchanged."""
    from attention_core.kernel.problem import causal_bias
    monkeypatch.setitem(sys.modules, "torch.nn.attention.bias", None)  # import raises ImportError
    mask = torch.ones(3, 3, dtype=torch.bool)
    a, c, off = causal_bias(mask, True, 3, 3)
    assert a is mask and c is True and off == 0
    assert causal_bias(None, False, 3, 5) == (None, False, 0)


def test_lower_right_causal_bias_of_other_lengths_is_materialised_and_broadcast():
    """A lower-right CausalBias whose lengths differ from the call's (2 x 1 against 2 queries, 5 keys) is torch's
    materialised mask, broadcast: query 0 sees no key (O = 0), query 1 sees every key."""
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = rand(1, 2, 2, 4, seed=50), rand(1, 2, 5, 4, seed=51), rand(1, 2, 5, 3, seed=52)
    with pytest.warns(UserWarning):
        bias = causal_lower_right(2, 1)
    out = sdpa(q, k, v, bias)
    want = reference(q, k, v, bias._materialize("cpu").as_subclass(torch.Tensor))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :]))
    torch.testing.assert_close(out[..., 1, :], reference(q, k, v)[..., 1, :], rtol=1e-10, atol=1e-10)


def test_causal_bias_with_an_unknown_variant_is_refused():
    from torch.nn.attention.bias import causal_upper_left
    bias = causal_upper_left(2, 3)
    bias.variant = "diagonal"
    q, k, v = rand(1, 2, 4, seed=1), rand(1, 3, 4, seed=2), rand(1, 3, 4, seed=3)
    with pytest.raises(ValueError, match="^CausalBias.variant must be a CausalVariant type, but found: diagonal$"):
        sdpa(q, k, v, bias)


def test_argument_errors_name_the_argument():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="^scaled_dot_product_attention: nested tensors are not supported by "
                                           "the tiled engine$"):
        nt = torch.nested.nested_tensor([torch.zeros(2, 4, 8), torch.zeros(2, 3, 8)])
        sdpa(nt, nt, nt)
    qi = torch.zeros(1, 2, 4, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="^scaled_dot_product_attention: query must be floating point, got "
                                           "torch.int64$"):
        sdpa(qi, qi, qi)
    with pytest.raises(RuntimeError, match=r"^scaled_dot_product_attention: query, key and value must be on one "
                                           r"device, got cpu, meta, cpu$"):
        sdpa(q, q.to("meta"), q)
    with pytest.raises(RuntimeError, match=r"^scaled_dot_product_attention: dropout_p must be in \[0, 1\], "
                                           r"got 1.5$"):
        sdpa(q, q, q, dropout_p=1.5)
    sdpa(q, q, q, dropout_p=1.0)  # the bounds themselves are valid
    sdpa(q, q, q, dropout_p=0.0)
    assert torch.equal(sdpa(q, q, q, dropout_p=-0.1), sdpa(q, q, q))  # below 0: no dropout, as torch's math SDPA
    with pytest.raises(RuntimeError, match="^scaled_dot_product_attention: Expected attn_mask dtype to be bool or "
                                           "float, got torch.int32$"):
        sdpa(q, q, q, torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"^scaled_dot_product_attention: attn_mask of shape \(1, 1, 1, 4, 4\) "
                                           r"does not broadcast to \(1, 2, 4, 4\)$"):
        sdpa(q, q, q, torch.ones(1, 1, 1, 4, 4, dtype=torch.bool))
    sdpa(q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool))  # as many dims as the weights: fine


# ---- tangents.py --------------------------------------------------------------------------------------------------

def test_forward_mode_active_while_compiling_is_whether_forward_mode_is_possible(monkeypatch):
    """Traced tensors cannot tell whether they carry a tangent: while compiling, an open dual level (even with no
    dual tensor) counts as forward mode, no level does not."""
    from attention_core.kernel.tangents import forward_mode_active
    x = torch.zeros(2)
    with fwAD.dual_level():
        assert forward_mode_active((x,)) is False  # eager: x carries no tangent
        monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
        assert forward_mode_active((x,)) is True
    assert forward_mode_active((x,)) is False


def test_transform_checks_for_old_torch_under_compile(monkeypatch):
    """_transform_active: whether a torch.func transform is active; compiled_transform_needs_plain_ops: only on an
    old torch (< 2.14) and only inside a transform."""
    from attention_core.kernel import tangents
    seen = []

    def probe(x):
        seen.append((tangents._transform_active(), tangents.compiled_transform_needs_plain_ops()))
        return x

    assert tangents._transform_active() is False
    monkeypatch.setattr(tangents, "_OLD_COMPILE", True)
    assert tangents.compiled_transform_needs_plain_ops() is False
    torch.vmap(probe)(torch.zeros(2))
    monkeypatch.setattr(tangents, "_OLD_COMPILE", False)
    torch.vmap(probe)(torch.zeros(2))
    assert seen == [(True, True), (True, False)]


def test_forward_mode_tangent_of_an_empty_query():
    """No query rows: the forward-mode tangents of O and L are empty zeros of their shapes and dtypes."""
    q, k, v = torch.zeros(1, 2, 0, 4), rand(1, 2, 3, 4, seed=1).float(), rand(1, 2, 3, 4, seed=2).float()
    with fwAD.dual_level():
        out, lse = sdpa(fwAD.make_dual(q, torch.ones_like(q)), k, fwAD.make_dual(v, torch.ones_like(v)),
                        return_lse=True)
        d_out, d_lse = fwAD.unpack_dual(out).tangent, fwAD.unpack_dual(lse).tangent
    assert d_out.shape == (1, 2, 0, 4) and d_out.dtype == torch.float32
    assert d_lse.shape == (1, 2, 0)


# ---- numerics.py --------------------------------------------------------------------------------------------------

def test_choose_numerics_refuses_an_unknown_precision():
    from attention_core.kernel.numerics import PRECISIONS, choose_numerics
    with pytest.raises(ValueError, match=rf"^precision must be one of {re_escape(PRECISIONS)}, got 'fp8'$"):
        choose_numerics(torch.float16, torch.device("cpu"), "fp8")
    assert choose_numerics(torch.float16, torch.device("cpu"), "keep").compute == torch.float16  # alias of input


def re_escape(x):
    import re
    return re.escape(str(x))


def test_bf16_on_an_accelerator_without_bf16_hardware_computes_fp16_when_the_values_fit(monkeypatch):
    """precision "auto", bf16 inputs on a GPU (stand-in device, detection's answer patched): bf16 where the device
    has bf16 hardware; else fp16 when every value fits fp16's range, fp32 when not."""
    from attention_core.device import detection
    from attention_core.kernel.numerics import choose_numerics
    asked = []
    hw = {"cuda": False}
    monkeypatch.setattr(detection, "bf16_hardware", lambda d: asked.append(d) or hw[d.type])
    dev = torch.device("cuda", 0)
    small = torch.ones(3, dtype=torch.bfloat16)
    big = torch.tensor([1e6], dtype=torch.bfloat16)
    assert choose_numerics(torch.bfloat16, dev, "auto", (small,)).compute == torch.float16
    assert choose_numerics(torch.bfloat16, dev, "auto", (small, big)).compute == torch.float32
    assert asked == [dev, dev]
    hw["cuda"] = True
    n = choose_numerics(torch.bfloat16, dev, "auto", (small, big))
    assert n.compute == torch.bfloat16 and n.ftz is True
    assert choose_numerics(torch.float16, dev, "auto", (big,)).compute == torch.float16
    assert choose_numerics(torch.bfloat16, torch.device("cpu"), "auto", (small,)).compute == torch.float32


def test_fits_fp16_skips_none_and_empty_tensors():
    from attention_core.kernel.numerics import fits_fp16
    assert fits_fp16([None, torch.empty(0), torch.tensor([1.0, -2.0])]) is True
    assert fits_fp16([torch.empty(0), None, torch.tensor([7e4])]) is False
    assert fits_fp16([None, torch.empty(0, 3)]) is True


# ---- tiers/chunked.py: keys-major layout with flush-to-zero -----------------------------------------------------

def test_keys_major_layout_flushes_weights_below_the_row_max(monkeypatch):
    """The chunked tier's keys-major layout with flush_to_zero on fp32: a key 25 below the row max gets weight
    exactly 0 (its value of 1e12 would add ~10 to the output otherwise); the shift is by the row max (raw scores
    here are 30, 5 and 29, none below the threshold unshifted)."""
    from attention_core.device import profiles
    monkeypatch.setenv(profiles.ENV_LAYOUT, "keys")
    q = torch.zeros(1, 1, 2, 4)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 3, 4)
    k[..., 0, 0], k[..., 1, 0], k[..., 2, 0] = 30.0, 5.0, 29.0
    v = torch.tensor([[1.0, 0.0], [1e12, 1e12], [0.0, 1.0]]).view(1, 1, 3, 2)
    out, lse = sdpa(q, k, v, scale=1.0, tier="chunked", flush_to_zero=True, return_lse=True)
    visible = torch.tensor([True, False, True]).view(1, 3)
    want = reference(q, k, v, visible.expand(2, 3), scale=1.0)
    torch.testing.assert_close(f64(out), want, rtol=1e-6, atol=1e-6)
    # L is of all scores (the flushed weight is e^-25 of the row's sum): log(e^30 + e^5 + e^29)
    want_lse = torch.logsumexp(torch.tensor([30.0, 5.0, 29.0], dtype=torch.float64), 0)
    torch.testing.assert_close(f64(lse), want_lse.expand(1, 1, 2), rtol=1e-6, atol=1e-6)
    unflushed = sdpa(q, k, v, scale=1.0, tier="chunked", flush_to_zero=False)
    assert (unflushed[..., 0] - out[..., 0]).abs().min() > 1.0  # the flush is what removed the far key


# ---- memory.py: free memory on other backends, and when the query fails ------------------------------------------

def test_free_memory_of_an_xpu_is_the_driver_free_bytes(monkeypatch):
    from attention_core.kernel import memory
    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda d=None: (5 << 30, 16 << 30), raising=False)
    assert memory.free_memory(torch.device("xpu", 0)) == 5 << 30
    assert memory.tile_budget(torch.device("xpu", 0)) == int((5 << 30) * memory.FREE_FRACTION["other"])


def test_a_failing_memory_query_means_unknown_and_the_budget_assumes_4_gib(monkeypatch):
    from attention_core.kernel import memory

    def broken(d=None):
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    assert memory.free_memory(torch.device("cuda", 0)) is None
    assert memory.tile_budget(torch.device("cuda", 0)) == int((4 << 30) * memory.FREE_FRACTION["other"])
    assert memory.tile_budget(torch.device("cuda", 0), 12345) == 12345


# ---- ops.py / driver.py: option errors, a forced tier that does not fit ------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    ({"block_q": 0}, "block_q must be a positive int, got 0"),
    ({"block_kv": True}, "block_kv must be a positive int, got True"),
    ({"block_q": 2.0}, "block_q must be a positive int, got 2.0"),
    ({"flush_to_zero": 1}, "flush_to_zero must be None, True or False, got 1"),
    ({"flush_to_zero": "yes"}, "flush_to_zero must be None, True or False, got 'yes'"),
])
def test_engine_option_errors_name_the_option(kw, msg):
    q = torch.zeros(1, 1, 4, 8)
    with pytest.raises(ValueError, match="^" + re_escape(msg) + "$"):
        sdpa(q, q, q, **kw)


def test_valid_engine_options_pass():
    q, k, v = rand(1, 1, 4, 8, seed=1), rand(1, 1, 4, 8, seed=2), rand(1, 1, 4, 8, seed=3)
    for kw in ({"block_q": 1}, {"block_kv": 1}, {"flush_to_zero": False}, {"flush_to_zero": True}):
        torch.testing.assert_close(sdpa(q, k, v, **kw), reference(q, k, v), rtol=1e-10, atol=1e-10)


def test_a_forced_tier_that_does_not_fit_warns_and_runs_the_next_tier(caplog):
    """tier="chunked" with a budget too small for its tile: a warning names the tier and the next tier down
    computes the result; the last tier (online) has no next tier, so no such warning."""
    q, k, v = rand(1, 2, 16, 8, seed=60), rand(1, 2, 256, 8, seed=61), rand(1, 2, 256, 8, seed=62)
    with caplog.at_level(logging.WARNING, logger="attention_core.kernel.driver"):
        out = sdpa(q, k, v, tier="chunked", memory_budget=8 << 10)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-10, atol=1e-10)
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("tiled attention: the chunked tier does not fit in 0 MB for q (1,)x2 heads x 16 x 8")
               and m.endswith("; using the next tier down") for m in msgs), msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attention_core.kernel.driver"):
        out = sdpa(q, k, v, tier="online", memory_budget=8 << 10)
    torch.testing.assert_close(out, reference(q, k, v), rtol=1e-10, atol=1e-10)
    assert not [r for r in caplog.records if "using the next tier down" in r.getMessage()]
