"""Issue 38.9: torch's native op overrides (torch._native) and the GPUs this pack is for.

The torch versions that ship torch._native register Python overrides of some aten ops on the GPU's dispatch key
(CUDA, which ROCm's HIP builds share). The one written in Triton covers aten::bmm of an outer product,
(B, M, 1) x (B, 1, N); Triton cannot target gfx906, so the public gfx906 images deregister the overrides at start-up.
The engine never issues such a GEMM (attention_core/kernel/gemm.py computes an outer product as a broadcast
product), whatever the tile edges, the head dim or the sequence lengths; the other overrides of this torch cover
ops the engine does not call. Checked here on the CPU: the GEMMs the engine asks torch for are recorded at
torch.matmul (every GEMM of the engine's tiers goes through it), and the overrides come from torch's own registry."""
import pytest
import torch

from attention_core import scaled_dot_product_attention
from attention_core.kernel import gemm
from reference import math_sdpa

# (op, DSL) of the overrides the torch versions with torch._native register (2.14.1: checked in its
# torch/_native/ops), and whether the engine calls the op: bmm is how torch.matmul runs batched GEMMs
KNOWN = {("bmm", "triton"): "outer products only: never issued by the engine (gemm.matmul)",
         ("_foreach_mm", "native"): "not called by the engine",
         ("linalg_polar", "native"): "not called by the engine",
         ("linalg_polar.out", "native"): "not called by the engine"}

# shapes whose tiles have edges of one: 257 keys / queries (one more than a multiple of the tile widths an 8 KiB
# budget gives: 26 outer products per call in every tier before gemm.matmul), a single key, a single query, head
# dim 1
SHAPES = [(257, 257, 8), (33, 1, 8), (1, 33, 8), (40, 40, 1), (130, 65, 8)]
TIERS = ("chunked", "inplace", "online", "auto")


@pytest.fixture
def outer_products(monkeypatch):
    """The torch.matmul calls whose shared dimension is 1 (what becomes an outer-product bmm on the GPU)."""
    real, seen = torch.matmul, []

    def recording(a, b, *args, **kwargs):
        if a.dim() >= 2 and b.dim() >= 2 and a.shape[-1] == 1:
            seen.append((tuple(a.shape), tuple(b.shape)))
        return real(a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "matmul", recording)
    return seen


@pytest.mark.parametrize("tier", TIERS)
def test_the_engine_issues_no_outer_product_gemm_and_stays_exact(tier, outer_products):
    g = torch.Generator().manual_seed(0)
    for n, m, d in SHAPES:
        q, k, v = (torch.randn(1, 2, L, d, generator=g).requires_grad_() for L in (n, m, m))
        # a small budget: tiles of a few dozen rows, so 257 leaves one-wide tiles in every tier
        out = scaled_dot_product_attention(q, k, v, tier=tier, memory_budget=1 << 13)
        dout = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert outer_products == [], (tier, (n, m, d), outer_products[:3])
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = math_sdpa(q64, k64, v64)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
        torch_out = math_sdpa(q.detach(), k.detach(), v.detach())  # torch's own fp32 error, the bound's scale
        bound = 8 * max(float((torch_out.double() - ref.detach()).abs().max()), 1e-6)
        assert float((out.detach().double() - ref.detach()).abs().max()) <= bound, (tier, (n, m, d))
        for a, b in zip(grads, ref_grads):
            assert float((a.double() - b).abs().max()) <= 64 * bound * max(1.0, float(b.abs().max())), (tier, n, m, d)


def test_an_outer_product_is_the_broadcast_product_exactly():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        a, b = torch.randn(3, 2, 7, 1, generator=g).to(dtype), torch.randn(3, 2, 1, 5, generator=g).to(dtype)
        assert torch.equal(gemm.matmul(a, b), torch.matmul(a, b)), dtype
        out = torch.empty(3, 2, 7, 5, dtype=dtype)
        assert gemm.matmul(a, b, out=out) is out and torch.equal(out, torch.matmul(a, b))
    a, b = torch.randn(4, 6, 3, generator=g), torch.randn(4, 3, 2, generator=g)
    assert torch.equal(gemm.matmul(a, b), torch.matmul(a, b))


def test_the_native_overrides_of_this_torch_are_known():
    """Every override this torch registers is one checked above; a new one (another op, or another DSL such as
    Triton for an op the engine calls) fails here, naming it, until it is checked."""
    try:
        from torch._native import registry
    except ImportError:
        pytest.skip(f"not applicable: torch {torch.__version__} has no native op overrides (torch._native)")
    found = {(op, node.dsl_name) for (op, _key), nodes in registry._graphs.items() for node in nodes}
    unknown = sorted(found - set(KNOWN))
    assert not unknown, f"torch {torch.__version__} registers native overrides not checked for the engine: {unknown}"
