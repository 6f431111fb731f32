"""What torch's SDPA refuses, the engine refuses, with torch's exception type and a message naming what is wrong; what
torch accepts, the engine computes as torch does. Directly and through the global patch (attention_core.patched).

The yardstick is torch's math backend: it is what torch runs on the GPUs the engine is for (no flash, no
memory-efficient kernel), so it is what the engine replaces. torch's fused kernels differ from it in corners, and
there the engine follows math on purpose:
  - a 0-d or 1-d attn_mask: math broadcasts it; the CPU's flash kernel raises IndexError
  - dropout_p < 0 or NaN: math applies no dropout (`if (dropout_p > 0.0)`); the CPU's flash kernel raises
  - an attn_mask on another device (meta): math raises; the CPU's flash kernel ignores where it is
  - key and value of different lengths: math raises; the CPU's flash kernel reads past the shorter
  - is_causal=True with an attn_mask: math raises; torch 2.5's CPU flash kernel ignores the mask
and complex inputs raise NotImplementedError (torch 2.14's type; torch 2.5's softmax raised a RuntimeError, which
NotImplementedError is a subclass of, so every handler written for torch catches the engine's).
Red before: a float64 (or fp16 / bf16) mask with a float32 query, is_causal / enable_gqa given as a tensor, an int,
a numpy bool, None or a string, a 1-d scale or a dropout_p that needs grad were all accepted; dropout_p < 0 raised;
GQA with key and value head counts that differ (both dividing the query's) raised; a meta mask with CPU
tensors was used as if it held values.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from reference import math_sdpa

g = torch.Generator().manual_seed(0)


def r(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


Q, K, V = r(1, 4, 6, 8), r(1, 4, 7, 8), r(1, 4, 7, 8)
HALF = dict(q=Q.half(), k=K.half(), v=V.half())
DOUBLE = dict(q=Q.double(), k=K.double(), v=V.double())

# name: (arguments, a word the engine's message must contain when it refuses: what is wrong)
CASES = {
    "mask int64": (dict(attn_mask=torch.ones(6, 7, dtype=torch.int64)), "attn_mask"),
    "mask uint8": (dict(attn_mask=torch.ones(6, 7, dtype=torch.uint8)), "attn_mask"),
    "mask complex": (dict(attn_mask=torch.ones(6, 7, dtype=torch.complex64)), "attn_mask"),
    "mask list": (dict(attn_mask=[[0.0] * 7] * 6), "attn_mask"),
    "mask not broadcasting": (dict(attn_mask=r(5, 7)), "attn_mask"),
    "mask 5-d": (dict(attn_mask=r(1, 1, 1, 6, 7)), "attn_mask"),
    "mask 0-d": (dict(attn_mask=torch.tensor(0.5)), None),
    "mask 1-d": (dict(attn_mask=r(7)), None),
    "mask on meta": (dict(attn_mask=torch.zeros(6, 7, device="meta")), "attn_mask"),
    "mask with is_causal": (dict(is_causal=True, attn_mask=r(6, 7)), "is_causal"),
    "is_causal tensor": (dict(is_causal=torch.tensor(True)), "is_causal"),
    "is_causal tensor False": (dict(is_causal=torch.tensor(False)), "is_causal"),
    "is_causal int": (dict(is_causal=1), "is_causal"),
    "is_causal numpy bool": (dict(is_causal=np.bool_(True)), "is_causal"),
    "is_causal None": (dict(is_causal=None), "is_causal"),
    "is_causal str": (dict(is_causal="yes"), "is_causal"),
    "dropout negative": (dict(dropout_p=-0.1), None),
    "dropout tiny negative": (dict(dropout_p=-1e-9), None),
    "dropout above 1": (dict(dropout_p=1.5), "dropout_p"),
    "dropout nan": (dict(dropout_p=float("nan")), None),
    "dropout inf": (dict(dropout_p=float("inf")), "dropout_p"),
    "dropout 0-d tensor": (dict(dropout_p=torch.tensor(0.0)), None),
    "dropout tensor with grad": (dict(dropout_p=torch.tensor(0.0, requires_grad=True)), "dropout_p"),
    "dropout int": (dict(dropout_p=0), None),
    "dropout bool": (dict(dropout_p=False), None),
    "dropout numpy": (dict(dropout_p=np.float64(0.0)), None),
    "dropout str": (dict(dropout_p="0.1"), "dropout_p"),
    "dropout None": (dict(dropout_p=None), "dropout_p"),
    "scale 0-d tensor": (dict(scale=torch.tensor(0.5)), None),
    "scale 1-d tensor": (dict(scale=torch.tensor([0.5])), "scale"),
    "scale negative": (dict(scale=-0.5), None),
    "scale zero": (dict(scale=0.0), None),
    "scale nan": (dict(scale=float("nan")), None),
    "scale inf": (dict(scale=float("inf")), None),
    "scale int": (dict(scale=2), None),
    "scale bool": (dict(scale=True), None),
    "scale numpy float32": (dict(scale=np.float32(0.5)), None),
    "scale str": (dict(scale="0.5"), "scale"),
    "gqa heads not dividing": (dict(q=r(1, 6, 6, 8), k=r(1, 4, 7, 8), v=r(1, 4, 7, 8), enable_gqa=True), "heads"),
    "gqa more kv heads": (dict(q=r(1, 2, 6, 8), k=r(1, 4, 7, 8), v=r(1, 4, 7, 8), enable_gqa=True), "heads"),
    "gqa key and value heads differ": (dict(q=r(1, 4, 6, 8), k=r(1, 2, 7, 8), v=r(1, 4, 7, 8), enable_gqa=True),
                                       None),
    "gqa value fewer heads": (dict(q=r(1, 6, 6, 8), k=r(1, 3, 7, 8), v=r(1, 2, 7, 8), enable_gqa=True), None),
    "heads differ without gqa": (dict(q=r(1, 4, 6, 8), k=r(1, 2, 7, 8), v=r(1, 2, 7, 8)), "head"),
    "gqa as tensor": (dict(q=r(1, 4, 6, 8), k=r(1, 2, 7, 8), v=r(1, 2, 7, 8), enable_gqa=torch.tensor(True)),
                      "enable_gqa"),
    "gqa as int": (dict(q=r(1, 4, 6, 8), k=r(1, 2, 7, 8), v=r(1, 2, 7, 8), enable_gqa=1), "enable_gqa"),
    "gqa 3-d": (dict(q=r(4, 6, 8), k=r(2, 7, 8), v=r(2, 7, 8), enable_gqa=True), None),
    "1-d query": (dict(q=r(8), k=r(7, 8), v=r(7, 8)), "dims"),
    "1-d all": (dict(q=r(8), k=r(8), v=r(8)), "dims"),
    "0-d": (dict(q=torch.tensor(1.0), k=torch.tensor(1.0), v=torch.tensor(1.0)), "dims"),
    "2-d": (dict(q=r(6, 8), k=r(7, 8), v=r(7, 8)), None),
    "key float64": (dict(k=K.double()), "dtype"),
    "value float16": (dict(v=V.half()), "dtype"),
    "key on meta": (dict(k=torch.zeros(1, 4, 7, 8, device="meta")), "device"),
    "integer inputs": (dict(q=Q.long(), k=K.long(), v=V.long()), "floating point"),
    "bool inputs": (dict(q=Q > 0, k=K > 0, v=V > 0), "floating point"),
    "complex inputs": (dict(q=Q.to(torch.complex64), k=K.to(torch.complex64), v=V.to(torch.complex64)), "complex"),
    "head dims differ": (dict(k=r(1, 4, 7, 9)), "head dim"),
    "key and value lengths differ": (dict(v=r(1, 4, 5, 8)), "sequence length"),
    "value head dim differs": (dict(v=r(1, 4, 7, 3)), None),
    "batch sizes differ": (dict(q=r(2, 4, 6, 8), k=r(3, 4, 7, 8), v=r(3, 4, 7, 8)), "batch"),
    "batch broadcast": (dict(q=r(2, 4, 6, 8), k=r(1, 4, 7, 8), v=r(1, 4, 7, 8)), None),
    "query a list": (dict(q=[[1.0]]), "query"),
    "no query rows": (dict(q=r(1, 4, 0, 8)), None),
    "no keys": (dict(k=r(1, 4, 0, 8), v=r(1, 4, 0, 8)), None),
    "unknown keyword": (dict(foo=1), "foo"),
}
# the mask's dtype against the query's: torch takes bool, float32 and the query's own dtype
for q_name, q_dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
                        ("fp64", torch.float64)):
    for m_name, m_dtype in (("bool", torch.bool), ("fp16", torch.float16), ("bf16", torch.bfloat16),
                            ("fp32", torch.float32), ("fp64", torch.float64)):
        mask = (r(6, 7) > 0) if m_dtype == torch.bool else r(6, 7, dtype=m_dtype)
        CASES[f"mask {m_name} with query {q_name}"] = (
            dict(q=Q.to(q_dtype), k=K.to(q_dtype), v=V.to(q_dtype), attn_mask=mask), "attn_mask")


def call(fn, case):
    kw = dict(case)
    args = [kw.pop("q", Q), kw.pop("k", K), kw.pop("v", V)]
    return fn(*args, **kw)


def patched_call(*args, **kw):
    with ac.patched(force=True):
        return F.scaled_dot_product_attention(*args, **kw)


@pytest.mark.parametrize("route", ["engine", "global patch"])
@pytest.mark.parametrize("name", list(CASES))
def test_refuses_what_torch_refuses_and_computes_what_it_accepts(name, route):
    case, what = CASES[name]
    fn = ac.scaled_dot_product_attention if route == "engine" else patched_call
    try:
        want = call(math_sdpa, case)
    except Exception as theirs:  # noqa: BLE001
        with pytest.raises(type(theirs)) as ours:
            call(fn, case)
        if route == "engine" and what is not None:
            assert what in str(ours.value), (str(ours.value), what)
        return
    got = call(fn, case)
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
    tol = 1e-5 if want.dtype in (torch.float32, torch.float64) else 1e-2
    assert torch.allclose(got.double(), want.double(), atol=tol, rtol=tol, equal_nan=True), name


def test_dropout_below_zero_or_nan_is_no_dropout_and_above_one_refused():
    """torch's math backend applies dropout only when dropout_p > 0 and then refuses p > 1 (its dropout's check)."""
    plain = ac.scaled_dot_product_attention(Q, K, V)
    for p in (-0.5, -1e-12, float("nan"), -float("inf")):
        assert torch.equal(ac.scaled_dot_product_attention(Q, K, V, dropout_p=p), plain), p
    for p in (1.0 + 1e-9, 2.0, float("inf")):
        with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\]"):
            ac.scaled_dot_product_attention(Q, K, V, dropout_p=p)
    assert torch.equal(ac.scaled_dot_product_attention(Q, K, V, dropout_p=1.0), torch.zeros_like(plain))


def test_gqa_with_key_and_value_head_counts_of_their_own():
    """torch repeats key heads by Hq / Hk and value heads by Hq / Hv (each must divide Hq): query head h reads key
    head h // (Hq / Hk) and value head h // (Hq / Hv). Exact against torch, and differentiable."""
    for hq, hk, hv in ((4, 2, 4), (6, 3, 2), (6, 2, 3), (8, 4, 2)):
        q = r(2, hq, 5, 8, dtype=torch.float64).requires_grad_(True)
        k = r(2, hk, 6, 8, dtype=torch.float64).requires_grad_(True)
        v = r(2, hv, 6, 4, dtype=torch.float64).requires_grad_(True)
        want = math_sdpa(q, k, v, enable_gqa=True)
        manual = math_sdpa(q, k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hv, 1))
        got = ac.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert torch.allclose(want, manual) and torch.allclose(got, want, atol=1e-12)
        w = torch.randn(got.shape, dtype=torch.float64, generator=g)
        grads = torch.autograd.grad((got * w).sum(), (q, k, v))
        ref = torch.autograd.grad((want * w).sum(), (q, k, v))
        assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(grads, ref))


def test_messages_say_what_to_change():
    with pytest.raises(RuntimeError, match=r"attn_mask.dtype: torch.float64 and query.dtype: torch.float32: pass "
                                           r"attn_mask.to\(torch.float32\)"):
        ac.scaled_dot_product_attention(Q, K, V, r(6, 7, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"argument 'is_causal' must be bool, not Tensor"):
        ac.scaled_dot_product_attention(Q, K, V, is_causal=torch.tensor(True))
    with pytest.raises(RuntimeError, match=r"attn_mask is on meta but query on cpu: move the mask to cpu"):
        ac.scaled_dot_product_attention(Q, K, V, torch.zeros(6, 7, device="meta"))
    assert math.isnan(float(ac.scaled_dot_product_attention(Q, K, V, scale=float("nan")).sum()))
