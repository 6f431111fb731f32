"""The engine under torch.autocast is cast as torch's SDPA is cast (attention_core/kernel/autocast.py): for each
autocast the CPU's torch.autocast accepts (bf16, fp16), the ones it refuses (fp32, fp64: warned and left off, as
torch does), the thread state other device types' torch.autocast leaves (CUDA accepts float32, the autocast
WanVideoWrapper's fp32 mode runs its model under; set here for the CPU) and a CUDA autocast around CPU tensors
(nothing cast), x q/k/v in fp32, fp16, bf16, fp64 x no mask, a bool mask, a float32 mask, a mask in the inputs'
dtype:

  - the output dtype is torch's own SDPA's under the same autocast (or the engine raises where torch raises,
    an exception torch's handler would catch),
  - the error against torch's math SDPA in float64 on the inputs as given is within a small multiple of torch's
    own error under the same autocast (plus a floor of 1e-6 of the output's size),
  - gradients come back in torch's dtypes, as close as torch's,

through every entry: attention_core.scaled_dot_product_attention, the global patch, the raw ops (forward and
backward), the head split over devices (its worker threads start without the caller's autocast) and Ulysses / ring
attention (one rank), and inside torch.compile. Red against the engine's old rule (fp32 inputs cast, nothing else):
fp16 inputs under a bf16 autocast came back fp16, bf16 inputs under a float32 autocast came back bf16 with about
10^4 times torch's error.
"""
import datetime

import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core.kernel.ops import attention_backward, attention_forward
from attention_core.multidevice import scaled_dot_product_attention_on_devices
from autocast_states import AUTOCASTS
from reference import TORCH_SDPA, math_sdpa

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
MASKS = ("none", "bool", "float32", "input dtype")
B, H, L, E = 1, 2, 24, 16
FLOOR = 1e-6  # relative to the output's largest value
FACTOR = 4


def inputs(dtype, mask_kind, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, E, generator=g).to(dtype) for _ in range(3))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(L, L, generator=g) > 0.3
        mask[:, 0] = True
    elif mask_kind in ("float32", "input dtype"):
        mask = (torch.randn(L, L, generator=g) * 2).to(torch.float32 if mask_kind == "float32" else dtype)
    if grad:
        for t in (q, k, v) + ((mask,) if mask is not None and mask.is_floating_point() else ()):
            t.requires_grad_(True)
    return q, k, v, mask


def rel_err(out, ref):
    return float((out.double() - ref).abs().max() / ref.abs().max())


def reference(q, k, v, mask):
    """torch's math SDPA in float64 on the inputs as given (the casts' rounding counts against both)."""
    f64 = [t.detach().double() if t is not None and t.is_floating_point() else t for t in (q, k, v, mask)]
    return math_sdpa(*f64[:3], attn_mask=f64[3])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo process group of this process alone: Ulysses and ring attention on one rank run the agreement, the
    autocast casts and the engine."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    init = "file://" + str(tmp_path_factory.mktemp("autocast_rank") / "rendezvous")
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _patched(q, k, v, mask):
    with ac.patched(force=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _ulysses(q, k, v, mask):
    from attention_core.parallel import ulysses_attention
    return ulysses_attention(q, k, v, mask)


def _ring(q, k, v, mask):
    from attention_core.parallel import ring_attention
    return ring_attention(q, k, v, mask)


ENTRIES = {
    "sdpa": lambda q, k, v, mask: ac.scaled_dot_product_attention(q, k, v, mask),
    "global patch": _patched,
    "ops.attention_forward": lambda q, k, v, mask: attention_forward(q, k, v, mask)[0],
    "head split": lambda q, k, v, mask: scaled_dot_product_attention_on_devices(q, k, v, mask,
                                                                               devices=["cpu", "cpu"]),
    "ulysses": _ulysses,
    "ring": _ring,
}


def check_like_torch(entry, autocast, dtype, mask_kind):
    q, k, v, mask = inputs(DTYPES[dtype], mask_kind)
    with AUTOCASTS[autocast]():
        try:
            want = TORCH_SDPA(q, k, v, attn_mask=mask)
        except Exception as theirs:  # noqa: BLE001 - the engine must refuse it too
            with pytest.raises(type(theirs)):
                ENTRIES[entry](q, k, v, mask)
            return None
        got = ENTRIES[entry](q, k, v, mask)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    ref = reference(q, k, v, mask)
    theirs, ours = rel_err(want, ref), rel_err(got, ref)
    assert ours <= FACTOR * theirs + FLOOR, (ours, theirs)
    return ours, theirs


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("autocast", list(AUTOCASTS))
@pytest.mark.parametrize("entry", ["sdpa", "global patch"])
def test_dtype_and_error_as_torch(entry, autocast, dtype, mask_kind):
    check_like_torch(entry, autocast, dtype, mask_kind)


@pytest.mark.parametrize("mask_kind", ["none", "float32"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("autocast", ["cpu-bf16", "cpu-fp16", "state-fp32", "cpu-fp32-refused"])
@pytest.mark.parametrize("entry", ["ops.attention_forward", "head split", "ulysses", "ring"])
def test_every_entry_casts_as_torch(entry, autocast, dtype, mask_kind, request):
    if entry in ("ulysses", "ring"):
        request.getfixturevalue("one_rank")
    check_like_torch(entry, autocast, dtype, mask_kind)


def test_the_float32_autocast_keeps_half_inputs_in_float32():
    """WanVideoWrapper's fp32 base precision: bf16 q, k, v under a float32 autocast (CUDA's, here the CPU's state)
    are computed in fp32 by torch; the engine's old rule left them bf16, ~10^4 x torch's error per call."""
    ours, theirs = check_like_torch("sdpa", "state-fp32", "bf16", "none")
    assert ours <= FACTOR * theirs + FLOOR and ours < 1e-5, (ours, theirs)


def _grads(fn, q, k, v, mask, region):
    with region():
        out = fn(q, k, v, mask)
    w = torch.linspace(-1, 1, out.numel()).view(out.shape)
    (out.double() * w).sum().backward()
    leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
    return out, [t.grad for t in leaves], w


def _split(q, k, v, mask):
    return scaled_dot_product_attention_on_devices(q, k, v, mask, devices=["cpu", "cpu"])


@pytest.mark.parametrize("mask_kind", ["none", "float32"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("autocast", ["cpu-bf16", "state-fp32"])
@pytest.mark.parametrize("entry", ["sdpa", "global patch", "head split"])
def test_gradients_in_torchs_dtypes_and_as_close(entry, autocast, dtype, mask_kind):
    fn = {"sdpa": ENTRIES["sdpa"], "global patch": _patched, "head split": _split}[entry]
    theirs_in = inputs(DTYPES[dtype], mask_kind, seed=3, grad=True)
    ours_in = inputs(DTYPES[dtype], mask_kind, seed=3, grad=True)
    want, want_grads, w = _grads(lambda q, k, v, m: TORCH_SDPA(q, k, v, attn_mask=m), *theirs_in,
                                 AUTOCASTS[autocast])
    got, got_grads, _ = _grads(fn, *ours_in, AUTOCASTS[autocast])
    assert got.dtype == want.dtype
    assert [g.dtype for g in got_grads] == [g.dtype for g in want_grads] == \
        [t.dtype for t in ours_in if t is not None and t.requires_grad]
    leaves = [t.detach().double().requires_grad_(True) if t is not None and t.is_floating_point() else t
              for t in ours_in]
    (math_sdpa(*leaves[:3], attn_mask=leaves[3]) * w.double()).sum().backward()
    for ours, theirs, ref in zip(got_grads, want_grads, [t.grad for t in leaves if t is not None and
                                                         t.requires_grad]):
        assert rel_err(ours, ref) <= FACTOR * rel_err(theirs, ref) + FLOOR, (rel_err(ours, ref),
                                                                             rel_err(theirs, ref))


@pytest.mark.parametrize("autocast", ["cpu-bf16", "state-fp32"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_raw_backward_returns_gradients_in_the_inputs_dtypes(autocast, dtype):
    """ops.attention_backward under autocast casts as the forward did and gives dq, dk, dv in q, k, v's own
    dtypes, as autograd does through torch's casts; values as torch's gradients."""
    q, k, v, mask = inputs(DTYPES[dtype], "float32", seed=5, grad=True)
    want, want_grads, w = _grads(lambda q, k, v, m: TORCH_SDPA(q, k, v, attn_mask=m),
                                 *(t.detach().clone().requires_grad_(True) for t in (q, k, v)), mask.detach(),
                                 AUTOCASTS[autocast])
    with AUTOCASTS[autocast]():
        out, lse = attention_forward(q, k, v, mask.detach())
        dq, dk, dv = attention_backward(w.to(out.dtype), q, k, v, out, lse, mask.detach())
    assert out.dtype == want.dtype
    assert (dq.dtype, dk.dtype, dv.dtype) == tuple(g.dtype for g in want_grads) == (q.dtype, k.dtype, v.dtype)
    for ours, theirs in zip((dq, dk, dv), want_grads):
        scale = float(theirs.double().abs().max())
        assert float((ours.double() - theirs.double()).abs().max()) <= 0.05 * scale


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_inside_torch_compile_the_same_casts(dtype):
    """Traced by dynamo (fullgraph), the autocast state is read at trace time and the casts are in the graph."""
    q, k, v, mask = inputs(DTYPES[dtype], "float32", seed=7)
    fn = torch.compile(lambda q, k, v, m: ac.scaled_dot_product_attention(q, k, v, m), backend="aot_eager",
                       fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = TORCH_SDPA(q, k, v, attn_mask=mask)
        got = fn(q, k, v, mask)
    assert got.dtype == want.dtype == torch.bfloat16
    ref = reference(q, k, v, mask)
    assert rel_err(got, ref) <= FACTOR * rel_err(want, ref) + FLOOR


def test_the_rule_itself_against_torchs_source():
    """kernel/autocast.py's eligibility: floating, not float64, on the autocast's device type (CUDA: also XLA);
    the dispatcher picks the highest backend's autocast (CUDA over CPU); a CausalBias is never cast."""
    from attention_core.kernel.autocast import autocast_inputs, dispatch_device_type, eligible
    from torch.nn.attention.bias import causal_upper_left
    x = torch.zeros(2, 3)
    assert eligible(x, "cpu") and eligible(x.half(), "cpu") and eligible(x.bfloat16(), "cpu")
    assert not eligible(x.double(), "cpu") and not eligible(x.bool(), "cpu") and not eligible(x.long(), "cpu")
    assert not eligible(x, "cuda") and not eligible(x.to("meta"), "cpu")
    assert dispatch_device_type((x, x.to("meta"))) == "cpu"  # meta: no autocast of its own
    assert dispatch_device_type((None, 1.0)) is None
    bias = causal_upper_left(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v, m = autocast_inputs(x.half(), x, x.double(), bias)
    assert (q.dtype, k.dtype, v.dtype) == (torch.bfloat16, torch.bfloat16, torch.float64) and m is bias
