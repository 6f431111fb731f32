"""The yardstick: torch's math SDPA on float64 copies.

torch's own function, the builtin torch._C._nn.scaled_dot_product_attention, never torch.nn.functional's attribute:
a test that turns the global patch or the process-wide mode on would otherwise compare the engine with itself."""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

TORCH_SDPA = torch._C._nn.scaled_dot_product_attention  # what F.scaled_dot_product_attention is while unpatched


def f64(t):
    return None if t is None else (t.detach().double() if t.is_floating_point() else t.detach())


def math_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    with sdpa_kernel([SDPBackend.MATH]):
        return TORCH_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                          enable_gqa=enable_gqa)


def reference(q, k, v, attn_mask=None, **kw):
    """Forward in float64 with torch's math backend."""
    return math_sdpa(f64(q), f64(k), f64(v), f64(attn_mask), **kw)


def reference_grads(q, k, v, dout, attn_mask=None, **kw):
    """(out, dq, dk, dv[, dmask]) in float64 from torch's math backend."""
    leaves = [f64(t).requires_grad_(True) for t in (q, k, v)]
    m = f64(attn_mask)
    if m is not None and m.is_floating_point():
        m = m.requires_grad_(True)
    out = math_sdpa(*leaves, m, **kw)
    out.backward(f64(dout))
    grads = [t.grad for t in leaves]
    if m is not None and m.requires_grad:
        grads.append(m.grad)
    return out.detach(), grads
