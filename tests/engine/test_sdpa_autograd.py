"""Gradients of every tier against torch's math SDPA, and O(N) saved memory."""
import pytest
import torch

from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.numerics import dropout_keep
from reference import f64, reference_grads

TIERS = ["chunked", "inplace", "online"]


def leaves(*shapes, dtype=torch.float64):
    return [torch.randn(*s, dtype=dtype, requires_grad=True) for s in shapes]


def grads_of(out, dout, tensors):
    out.backward(dout)
    return [t.grad for t in tensors]


def close(a, b, tol=1e-9):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b).abs().max().item()
    assert err <= tol, f"max error {err:.3g}"


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", ["plain", "bool_mask", "float_mask", "causal", "gqa", "scale", "pad_mask",
                                  "broadcast", "3d", "empty_row"])
def test_gradients_match_torch(tier, case):
    torch.manual_seed(3)
    hq, hkv, lq, lk = 4, 4, 13, 17
    kw, mask = {}, None
    if case == "gqa":
        hkv, kw = 2, {"enable_gqa": True}
    q, k, v = leaves((2, hq, lq, 8), (2, hkv, lk, 8), (2, hkv, lk, 6))
    if case == "bool_mask":
        mask = torch.rand(2, hq, lq, lk) > 0.3
    elif case == "float_mask":
        mask = torch.randn(lq, lk, dtype=torch.float64, requires_grad=True)
    elif case == "pad_mask":
        mask = torch.rand(2, 1, 1, lk) > 0.3
    elif case == "empty_row":
        mask = torch.ones(lq, lk, dtype=torch.bool)
        mask[4] = False
    elif case == "causal":
        kw = {"is_causal": True}
    elif case == "scale":
        kw = {"scale": 0.41}
    elif case == "broadcast":
        q, k, v = leaves((2, hq, lq, 8), (1, 1, lk, 8), (1, 1, lk, 6))
    elif case == "3d":
        q, k, v = leaves((3, lq, 8), (3, lk, 8), (3, lk, 6))
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64)
    if case == "broadcast":
        dout = torch.randn(2, hq, lq, 6, dtype=torch.float64)
    ref_out, ref_grads = reference_grads(q, k, v, dout, mask, **kw)
    out = sdpa(q, k, v, mask, tier=tier, block_q=4, block_kv=5, **kw)
    close(out.detach(), ref_out)
    tensors = [q, k, v] + ([mask] if mask is not None and mask.dtype != torch.bool else [])
    for g, r in zip(grads_of(out, dout, tensors), ref_grads):
        close(g, r)


@pytest.mark.parametrize("tier", TIERS)
def test_gradients_fp32(tier):
    torch.manual_seed(4)
    q, k, v = leaves((1, 2, 33, 16), (1, 2, 40, 16), (1, 2, 40, 16), dtype=torch.float32)
    dout = torch.randn(1, 2, 33, 16)
    _, ref = reference_grads(q, k, v, dout, is_causal=True)
    out = sdpa(q, k, v, is_causal=True, tier=tier, block_q=8, block_kv=16)
    for g, r in zip(grads_of(out, dout, [q, k, v]), ref):
        close(g, r, 1e-4)


def test_only_linear_memory_is_saved():
    """Autograd keeps q, k, v, O and per-row statistics: nothing of size Lq x Lk."""
    n = 256
    q, k, v = leaves((1, 2, n, 8), (1, 2, n, 8), (1, 2, n, 8), dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sdpa(q, k, v, tier="chunked")
    assert saved and max(saved) <= 2 * n * 8, saved
    out.sum().backward()
    assert q.grad is not None


@pytest.mark.parametrize("tier", TIERS)
def test_dropout_gradients(tier):
    """With dropout, gradients equal those of softmax(S) * keep / (1-p) @ V built from the same keep bits."""
    torch.manual_seed(5)
    p = 0.3
    q, k, v = leaves((1, 2, 9, 8), (1, 2, 11, 8), (1, 2, 11, 8))
    torch.manual_seed(123)
    out = sdpa(q, k, v, dropout_p=p, tier=tier, block_q=4, block_kv=3)
    dout = torch.randn_like(out)
    got = grads_of(out, dout, [q, k, v])
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2 ** 62, (1,), dtype=torch.int64).item())
    head = torch.arange(2).view(1, 2, 1, 1)
    keep = dropout_keep(seed, p, head, torch.arange(9).view(-1, 1), torch.arange(11).view(1, -1), 9, 11)
    rq, rk, rv = (f64(t).requires_grad_(True) for t in (q, k, v))
    w = torch.softmax(rq @ rk.transpose(-1, -2) / 8 ** 0.5, -1) * keep.view(1, 2, 9, 11) / (1 - p)
    ref = w @ rv
    close(out.detach(), ref.detach())
    ref.backward(dout)
    for g, r in zip(got, (rq.grad, rk.grad, rv.grad)):
        close(g, r)
