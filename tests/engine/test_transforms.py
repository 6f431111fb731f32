"""torch.compile(fullgraph=True), torch.func (grad, vmap, jacrev), gradcheck with batched grads, vectorized
jacobians and double backward: each against torch's math SDPA on small float64 inputs."""
import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from reference import math_sdpa


def inputs(b=2, h=2, lq=5, lk=6, e=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, e, generator=g, dtype=torch.float64) for n in (lq, lk, lk)]


def close(a, b, tol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert (a - b).abs().max() < tol


KW = [{}, {"is_causal": True}, {"tier": "online", "block_q": 2, "block_kv": 4}]


def ours(kw):
    return lambda q, k, v, **x: sdpa(q, k, v, **kw, **x)


def ref(kw):
    kw = {k: v for k, v in kw.items() if k not in ("tier", "block_q", "block_kv")}
    return lambda q, k, v, **x: math_sdpa(q, k, v, **kw, **x)


@pytest.mark.parametrize("kw", KW)
def test_torch_compile_fullgraph_forward_and_backward(kw):
    q, k, v = inputs()
    mask = torch.randn(1, 1, 5, 6, dtype=torch.float64) if not kw else None

    def f(q, k, v):
        return sdpa(q * 2, k, v, attn_mask=mask, **kw).sin()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = compiled(*xs)
    out.sum().backward()
    ys = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = ref(kw)(ys[0] * 2, *ys[1:], attn_mask=mask).sin()
    want.sum().backward()
    close(out, want)
    for a, b in zip(xs, ys):
        close(a.grad, b.grad)


def test_torch_compile_return_lse():
    q, k, v = inputs()
    out, lse = torch.compile(lambda q, k, v: sdpa(q, k, v, return_lse=True), fullgraph=True,
                             backend="aot_eager")(q, k, v)
    close(out, math_sdpa(q, k, v))
    close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 2.0, -1))


@pytest.mark.parametrize("kw", KW)
def test_func_grad(kw):
    q, k, v = inputs()
    got = torch.func.grad(lambda q, k: ours(kw)(q, k, v).sin().sum(), argnums=(0, 1))(q, k)
    want = torch.func.grad(lambda q, k: ref(kw)(q, k, v).sin().sum(), argnums=(0, 1))(q, k)
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.parametrize("kw", KW)
def test_func_vmap(kw):
    q, k, v = inputs(b=3)
    close(torch.func.vmap(ours(kw))(q, k, v), torch.func.vmap(ref(kw))(q, k, v))
    # vmapped dim not first, some inputs not vmapped, and a vmapped mask
    q = q[:2]
    mask = torch.rand(2, 2, 5, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    got = torch.func.vmap(lambda q, m: ours(kw)(q, k[0], v[0], attn_mask=m) if "is_causal" not in kw
                          else ours(kw)(q, k[0], v[0]), in_dims=(1, 0))(q, mask)
    want = torch.func.vmap(lambda q, m: ref(kw)(q, k[0], v[0], attn_mask=m) if "is_causal" not in kw
                           else ref(kw)(q, k[0], v[0]), in_dims=(1, 0))(q, mask)
    close(got, want)


@pytest.mark.parametrize("kw", KW)
def test_func_vmap_of_what_needs_the_softmax_statistics(kw):
    """Under vmap the forward keeps L (and the row max) when they are needed, batched like the output: for
    return_lse=True and for gradients taken inside the vmap (per-sample gradients), each sample's result is the
    one of that sample alone."""
    q, k, v = inputs(b=3)
    out, lse = torch.func.vmap(lambda q, k, v: ours(kw)(q, k, v, return_lse=True))(q, k, v)
    for i in range(3):
        close(out[i], ref(kw)(q[i], k[i], v[i]))
        want = ours(kw)(q[i], k[i], v[i], return_lse=True)[1]
        close(lse[i], want)
    scale = q.shape[-1] ** -0.5
    if not kw:
        close(lse, torch.logsumexp(q @ k.transpose(-1, -2) * scale, -1))
    grads = torch.func.vmap(torch.func.grad(lambda q, k, v: ours(kw)(q, k, v).sin().sum()))(q, k, v)
    for i in range(3):
        want = torch.func.grad(lambda q: ref(kw)(q, k[i], v[i]).sin().sum())(q[i])
        close(grads[i], want)


@pytest.mark.parametrize("kw", KW)
def test_func_jacrev(kw):
    q, k, v = (t[:1, :1] for t in inputs())
    got = torch.func.jacrev(lambda q, v: ours(kw)(q, k, v), argnums=(0, 1))(q, v)
    want = torch.func.jacrev(lambda q, v: ref(kw)(q, k, v), argnums=(0, 1))(q, v)
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.parametrize("kw", KW)
def test_gradcheck_with_batched_grad(kw):
    xs = [t[:1, :2, :3].clone().requires_grad_(True) for t in inputs()]
    mask = torch.randn(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: ours(kw)(q, k, v), xs, check_batched_grad=True)
    if not kw:
        assert torch.autograd.gradcheck(lambda q, k, v, m: ours(kw)(q, k, v, attn_mask=m), xs + [mask],
                                        check_batched_grad=True)
        assert torch.autograd.gradcheck(lambda q, k, v: sdpa(q, k, v, return_lse=True)[1], xs,
                                        check_batched_grad=True)


@pytest.mark.parametrize("kw", KW)
def test_jacobian_vectorized(kw):
    xs = tuple(t[:1, :1, :3] for t in inputs())
    got = torch.autograd.functional.jacobian(ours(kw), xs, vectorize=True)
    want = torch.autograd.functional.jacobian(ref(kw), xs, vectorize=True)
    for a, b in zip(got, want):
        close(a, b)


@pytest.mark.parametrize("kw", KW)
def test_double_backward_gradient_penalty(kw):
    q, k, v = inputs()
    mask = torch.randn(1, 2, 5, 6, dtype=torch.float64) if "is_causal" not in kw else None

    def penalty(fn, xs, m):
        out, = [fn(*xs, attn_mask=m)] if m is not None else [fn(*xs)]
        grads = torch.autograd.grad((out ** 2).sum(), xs + ([m] if m is not None else []), create_graph=True)
        total = sum((g ** 2).sum() for g in grads)
        total.backward()
        return [x.grad for x in xs] + ([m.grad] if m is not None else [])
    m1 = mask.clone().requires_grad_(True) if mask is not None else None
    m2 = mask.clone().requires_grad_(True) if mask is not None else None
    got = penalty(ours(kw), [t.clone().requires_grad_(True) for t in (q, k, v)], m1)
    want = penalty(ref(kw), [t.clone().requires_grad_(True) for t in (q, k, v)], m2)
    for a, b in zip(got, want):
        assert a is not None
        close(a, b, 1e-9)


def test_double_backward_through_lse():
    q, k, v = inputs()
    xs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    _, lse = sdpa(*xs, return_lse=True)
    g, = torch.autograd.grad(lse.sum(), xs[0], create_graph=True)
    (g ** 2).sum().backward()
    ys = [t.clone().requires_grad_(True) for t in (q, k)]
    g2, = torch.autograd.grad(torch.logsumexp(ys[0] @ ys[1].transpose(-1, -2) / 2.0, -1).sum(), ys[0],
                              create_graph=True)
    (g2 ** 2).sum().backward()
    close(xs[0].grad, ys[0].grad)
    close(xs[1].grad, ys[1].grad)


def test_double_backward_path_keeps_the_dropout_bits():
    """create_graph=True takes the differentiable recompute; its first-order gradients equal the tiled
    backward's, dropout bits included (same seed -> same keep mask)."""
    q, k, v = (t.requires_grad_(True) for t in inputs())
    torch.manual_seed(1)
    fast = torch.autograd.grad(sdpa(q, k, v, dropout_p=0.3).pow(2).sum(), (q, k, v))
    torch.manual_seed(1)
    diff = torch.autograd.grad(sdpa(q, k, v, dropout_p=0.3).pow(2).sum(), (q, k, v), create_graph=True)
    for a, b in zip(fast, diff):
        assert b.requires_grad
        close(a, b.detach())
