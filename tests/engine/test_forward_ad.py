"""Forward-mode AD through the engine: torch.func.jvp, jacfwd, hessian and torch.autograd.forward_ad dual tensors,
each against torch's math SDPA on float64 (masks, causal, GQA, tiny tiles so the tiled rule crosses blocks), the
tangent of the log-sum-exp, and dropout against a central difference with the same dropout bits."""
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.attention.bias import CausalBias, causal_lower_right

from attention_core import scaled_dot_product_attention as sdpa
from reference import math_sdpa

TILES = {"block_q": 2, "block_kv": 3}


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def case(name):
    """(q, k, v, mask, kwargs for both, tangents) for one named case."""
    q, k, v = rand(2, 4, 5, 3, seed=1), rand(2, 4, 7, 3, seed=2), rand(2, 4, 7, 4, seed=3)
    kw, mask = {}, None
    if name == "causal":
        kw = {"is_causal": True}
    elif name == "bool_mask":
        mask = rand(2, 1, 5, 7, seed=4) > -0.3
        mask[0, 0, 1] = False  # a row with no visible key: O = 0, tangent 0
    elif name == "float_mask":
        mask = rand(1, 4, 5, 7, seed=4)
    elif name == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw = {"enable_gqa": True, "is_causal": True}
    elif name == "causal_bias":  # lower-right causal (a causal offset in the engine, no mask tensor)
        mask = causal_lower_right(5, 7)
    elif name == "scale":
        kw = {"scale": 0.7}
    tangents = [rand(*t.shape, seed=10 + i) for i, t in enumerate((q, k, v))]
    return q, k, v, mask, kw, tangents


CASES = ["plain", "causal", "bool_mask", "float_mask", "gqa", "causal_bias", "scale"]


def ref_out(q, k, v, mask, kw):
    if isinstance(mask, CausalBias):
        mask = torch.ones(5, 7, dtype=torch.bool).tril(7 - 5)
    out = math_sdpa(q, k, v, mask, **kw)
    return torch.nan_to_num(out)  # math SDPA may give NaN on a fully masked row on older torch; ours gives 0


def close(a, b, tol=1e-10):
    assert a is not None, "no tangent"
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err < tol, f"max error {err:.3g}"


@pytest.mark.parametrize("tiles", [{}, TILES], ids=["one_tile", "tiny_tiles"])
@pytest.mark.parametrize("name", CASES)
def test_func_jvp_matches_math_sdpa(name, tiles):
    q, k, v, mask, kw, tangents = case(name)
    out, d_out = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, mask, **kw, **tiles), (q, k, v), tuple(tangents))
    ref, d_ref = torch.func.jvp(lambda q, k, v: ref_out(q, k, v, mask, kw), (q, k, v), tuple(tangents))
    close(out, ref)
    assert d_ref.abs().max() > 0.1  # the case has a real tangent to get right
    close(d_out, d_ref)


def test_func_jvp_float_mask_tangent():
    """A float mask with a tangent of its own: dS gains dMask."""
    q, k, v, mask, kw, tangents = case("float_mask")
    dmask = rand(*mask.shape, seed=20)
    args, tans = (q, k, v, mask), (*tangents, dmask)
    _, d_out = torch.func.jvp(lambda q, k, v, m: sdpa(q, k, v, m, **TILES), args, tans)
    _, d_ref = torch.func.jvp(lambda q, k, v, m: math_sdpa(q, k, v, m), args, tans)
    close(d_out, d_ref)
    _, d_mask_only = torch.func.jvp(lambda m: sdpa(q, k, v, m), (mask,), (dmask,))
    _, d_mask_ref = torch.func.jvp(lambda m: math_sdpa(q, k, v, m), (mask,), (dmask,))
    assert d_mask_ref.abs().max() > 0.1
    close(d_mask_only, d_mask_ref)


@pytest.mark.parametrize("name", ["plain", "causal", "gqa"])
def test_forward_ad_dual_tensors(name):
    q, k, v, mask, kw, tangents = case(name)
    _, d_ref = torch.func.jvp(lambda q, k, v: ref_out(q, k, v, mask, kw), (q, k, v), tuple(tangents))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(t, dt) for t, dt in zip((q, k, v), tangents)]
        out = sdpa(*duals, mask, **kw, **TILES)
        d_out = fwAD.unpack_dual(out).tangent
    close(d_out, d_ref)
    with fwAD.dual_level():  # a tangent on v alone (q and k plain tensors)
        out = sdpa(q, k, fwAD.make_dual(v, tangents[2]), mask, **kw)
        d_v = fwAD.unpack_dual(out).tangent
    _, d_v_ref = torch.func.jvp(lambda v: ref_out(q, k, v, mask, kw), (v,), (tangents[2],))
    close(d_v, d_v_ref)


def test_forward_ad_under_no_grad():
    """Forward mode does not depend on grad mode: inside torch.no_grad() the tangent is still computed."""
    q, k, v, mask, kw, tangents = case("plain")
    _, d_ref = torch.func.jvp(lambda q: math_sdpa(q, k, v), (q,), (tangents[0],))
    with torch.no_grad(), fwAD.dual_level():
        d_out = fwAD.unpack_dual(sdpa(fwAD.make_dual(q, tangents[0]), k, v)).tangent
    close(d_out, d_ref)


@pytest.mark.parametrize("name", ["plain", "float_mask", "gqa"])
def test_jacfwd_matches_jacrev_of_math(name):
    q, k, v, mask, kw, _ = case(name)
    q, k, v = q[:1, :2, :3], k[:1, :, :4], v[:1, :, :4]
    if mask is not None:
        mask = mask[:1, :2, :3, :4]
    k, v = (k[:, :1], v[:, :1]) if name == "gqa" else (k[:, :2], v[:, :2])
    jac = torch.func.jacfwd(lambda q, k, v: sdpa(q, k, v, mask, **kw, **TILES), argnums=(0, 1, 2))(q, k, v)
    ref = torch.func.jacrev(lambda q, k, v: math_sdpa(q, k, v, mask, **kw), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(jac, ref):
        close(a, b)


def test_hessian_matches_math():
    q, k, v, *_ = case("causal")
    q, k, v = q[:1, :1, :3], k[:1, :1, :4], v[:1, :1, :4]

    def loss(f):
        return lambda q: (f(q, k, v, is_causal=True) ** 2).sum()
    close(torch.func.hessian(loss(sdpa))(q), torch.func.hessian(loss(math_sdpa))(q))


def test_forward_over_reverse_with_dual_tensors():
    """The gradient of a dual tensor carries a tangent (forward over reverse, no create_graph): the backward
    takes the differentiable recompute when forward mode sees it."""
    q, k, v, mask, kw, tangents = case("float_mask")
    dout = rand(*q.shape[:-1], v.shape[-1], seed=30)
    results = []
    for f in (lambda q: sdpa(q, k, v, mask, **TILES), lambda q: math_sdpa(q, k, v, mask)):
        with fwAD.dual_level():
            qd = fwAD.make_dual(q.clone().requires_grad_(True), tangents[0])
            grad, = torch.autograd.grad(f(qd), qd, dout)
            results.append(fwAD.unpack_dual(grad).tangent)
    assert results[1].abs().max() > 0.1
    close(*results)


def test_lse_tangent():
    """return_lse: dL = sum_j P_ij dS_ij, against the log-sum-exp of torch's float64 scores."""
    q, k, v, mask, kw, tangents = case("float_mask")

    def ref_lse(q, k):
        return torch.logsumexp(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask, -1)
    (_, lse), (_, d_lse) = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, mask, return_lse=True, **TILES),
                                          (q, k, v), tuple(tangents))
    ref, d_ref = torch.func.jvp(ref_lse, (q, k), tuple(tangents[:2]))
    close(lse, ref)
    close(d_lse, d_ref)


@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dropout_tangent_is_the_derivative_with_the_same_bits(p):
    """With dropout the output for a fixed RNG state is a smooth function of q, k, v: the tangents of O and L
    equal their central differences (the same seed is drawn each call; p = 1: O = 0, L still moves)."""
    q, k, v, mask, kw, tangents = case("causal")

    def f(q, k, v):
        torch.manual_seed(7)
        return sdpa(q, k, v, dropout_p=p, is_causal=True, return_lse=True, **TILES)
    eps = 1e-6
    plus = f(*(t + eps * dt for t, dt in zip((q, k, v), tangents)))
    minus = f(*(t - eps * dt for t, dt in zip((q, k, v), tangents)))
    (out, lse), (d_out, d_lse) = torch.func.jvp(f, (q, k, v), tuple(tangents))
    for primal, tangent, a, b, ref in zip((out, lse), (d_out, d_lse), plus, minus, f(q, k, v)):
        fd = (a - b) / (2 * eps)
        close(primal, ref)
        close(tangent, fd, tol=1e-7)
    assert ((plus[1] - minus[1]) / (2 * eps)).abs().max() > 0.1
    if p < 1:
        assert ((plus[0] - minus[0]) / (2 * eps)).abs().max() > 0.1


def test_float32_tangent_close_to_float64():
    q, k, v, mask, kw, tangents = case("causal")
    f32 = [t.float() for t in (q, k, v)]
    _, d_out = torch.func.jvp(lambda q, k, v: sdpa(q, k, v, is_causal=True), tuple(f32),
                              tuple(t.float() for t in tangents))
    _, d_ref = torch.func.jvp(lambda q, k, v: math_sdpa(q, k, v, is_causal=True), (q, k, v), tuple(tangents))
    assert d_out.dtype == torch.float32
    close(d_out.double(), d_ref, tol=1e-4)


def test_raw_forward_op_refuses_forward_mode():
    """ops.attention_forward has no autograd: a dual tensor gets a clear error, not a missing tangent."""
    from attention_core.kernel.ops import attention_forward
    q, k, v, mask, kw, tangents = case("plain")
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD.*return_lse=True"):
        attention_forward(fwAD.make_dual(q, tangents[0]), k, v)
    with pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.func.jvp(lambda v: attention_forward(q, k, v)[0], (v,), (tangents[2],))
    out, lse = attention_forward(q, k, v)  # plain tensors: unchanged
    close(out, math_sdpa(q, k, v))


@pytest.mark.parametrize("name", ["plain", "float_mask", "gqa"])
def test_jacrev_of_jacfwd_matches_math(name):
    """Issue 22.3: reverse over forward (jacrev(jacfwd(f))) vmaps the backward of the forward-mode Function; its
    saved tensors must be one list for jvp and backward (it crashed: "flat_bdims must not be None")."""
    q, k, v, mask, kw, _ = case(name)
    q, k, v = q[:1, :2, :3], k[:1, :, :4], v[:1, :, :4]
    k, v = (k[:, :1], v[:, :1]) if name == "gqa" else (k[:, :2], v[:, :2])
    if mask is not None:
        mask = mask[:1, :2, :3, :4]
    w = rand(*q.shape[:-1], v.shape[-1], seed=40)

    def loss(f):
        return lambda q, k: (f(q, k, v, mask, **kw) * w).sum()
    got = torch.func.jacrev(torch.func.jacfwd(loss(lambda *a, **x: sdpa(*a, **x, **TILES)), argnums=(0, 1)))(q, k)
    want = torch.func.jacrev(torch.func.jacfwd(loss(math_sdpa), argnums=(0, 1)))(q, k)
    assert want[0].abs().max() > 0.1
    for a, b in zip(got, want):
        close(a, b)


def compiled_cases():
    """(id, backend, transform, case name, engine kwargs)."""
    return [("eager-jvp-float_mask", "eager", "jvp", "float_mask", TILES),
            ("eager-dual-gqa", "eager", "dual", "gqa", {}),
            ("eager-hessian-causal_bias", "eager", "hessian", "causal_bias", {}),
            ("eager-jacfwd-bool_mask", "eager", "jacfwd", "bool_mask", TILES),
            ("aot_eager-dual-plain", "aot_eager", "dual", "plain", {}),
            ("aot_eager-jvp-causal", "aot_eager", "jvp", "causal", TILES)]


@pytest.mark.parametrize("backend,transform,name,tiles", [c[1:] for c in compiled_cases()],
                         ids=[c[0] for c in compiled_cases()])
def test_forward_mode_through_torch_compile(backend, transform, name, tiles):
    """Issue 22.1: torch.compile in its default mode under forward-mode AD. The tangent was dropped (zeros under
    torch.func.jvp, None for a dual tensor): forward_mode_active answered False while dynamo traced, so the call took
    the custom op, which has no forward rule. Now a traced call under forward mode is plain differentiable torch
    ops (and an untraced one runs eagerly with the tiled rule); attention sits inside the compiled function with
    work around it, so the graph continues after it."""
    torch._dynamo.reset()
    q, k, v, mask, kw, tangents = case(name)

    def body(attention):
        return lambda q, k, v: attention(q * 1.5, k, v, mask, **kw).sin() * 2
    f = torch.compile(body(lambda *a, **x: sdpa(*a, **x, **tiles)), backend=backend)
    ref = body(lambda *a, **x: ref_out(*a, x))
    if transform == "jvp":
        got, want = (torch.func.jvp(g, (q, k, v), tuple(tangents))[1] for g in (f, ref))
    elif transform == "dual":
        got, want = [], torch.func.jvp(ref, (q, k, v), tuple(tangents))[1]
        with fwAD.dual_level():
            got = fwAD.unpack_dual(f(*(fwAD.make_dual(t, dt) for t, dt in zip((q, k, v), tangents)))).tangent
    elif transform == "jacfwd":
        q, k, v = (t[:1, :2].clone() for t in (q, k, v))
        mask = mask[:1] if isinstance(mask, torch.Tensor) else mask
        got, want = (torch.func.jacfwd(g, argnums=(0, 1))(q, k, v) for g in (f, ref))
    else:  # (clones: dynamo cannot take a view as a functorch-wrapped input, for torch's own SDPA neither)
        q, k, v = (t[:1, :1].clone() for t in (q, k, v))
        got, want = (torch.func.hessian(lambda q: g(q, k, v).sum())(q) for g in (f, ref))
    for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        assert b.abs().max() > 0.1
        close(a, b)


def test_compiled_code_traced_without_forward_mode_is_retraced_under_it():
    """A compiled function first traced for plain calls, then called with dual tensors and under torch.func.jvp:
    dynamo's guard on forward_ad's dual level (read while tracing) and on functorch's stack make it trace again,
    and the tangent is exact (not the cached graph's custom op with no forward rule)."""
    torch._dynamo.reset()
    q, k, v, mask, kw, tangents = case("causal")
    f = torch.compile(lambda q, k, v: sdpa(q, k, v, **kw) * 2, backend="eager")
    close(f(q, k, v), 2 * ref_out(q, k, v, None, kw))
    _, want = torch.func.jvp(lambda q: 2 * ref_out(q, k, v, None, kw), (q,), (tangents[0],))
    with fwAD.dual_level():
        close(fwAD.unpack_dual(f(fwAD.make_dual(q, tangents[0]), k, v)).tangent, want)
    close(torch.func.jvp(lambda q: f(q, k, v), (q,), (tangents[0],))[1], want)


def test_compiled_forward_mode_keeps_the_dropout_bits_and_the_lse():
    """Traced under forward mode with dropout and return_lse: the plain ops draw the same keep bits as the eager
    tiled rule (one seed, the same hash), so out, lse and both tangents equal the eager call's."""
    torch._dynamo.reset()
    q, k, v, mask, kw, tangents = case("float_mask")

    def f(q, k, v):
        torch.manual_seed(3)
        return sdpa(q, k, v, mask, dropout_p=0.4, return_lse=True, **TILES)
    (out, lse), (d_out, d_lse) = torch.func.jvp(torch.compile(f, backend="eager"), (q, k, v), tuple(tangents))
    (out_e, lse_e), (d_out_e, d_lse_e) = torch.func.jvp(f, (q, k, v), tuple(tangents))
    assert d_out_e.abs().max() > 0.1 and (out_e - sdpa(q, k, v, mask)).abs().max() > 0.1  # dropout at work
    for a, b in ((out, out_e), (lse, lse_e), (d_out, d_out_e), (d_lse, d_lse_e)):
        close(a, b)
