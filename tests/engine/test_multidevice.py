"""Head split over several devices of one process: exact against torch's math SDPA (float64), on CPU "devices"."""
import logging
import threading

import pytest
import torch

from attention_core import multidevice
from attention_core.multidevice import plan_head_split, scaled_dot_product_attention_on_devices as on_devices
from reference import reference_grads

CPU3 = ["cpu", "cpu", "cpu"]


def test_split_is_contiguous_and_even():
    groups = plan_head_split(24, 24, ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"])
    assert [(g.q_heads.start, g.q_heads.stop) for g in groups] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 24)]
    gqa = plan_head_split(8, 2, CPU3)  # fewer kv heads than devices: two groups of 4 query heads
    assert [(g.kv_heads.start, g.kv_heads.stop, g.q_heads.start, g.q_heads.stop) for g in gqa] == [
        (0, 1, 0, 4), (1, 2, 4, 8)]
    with pytest.raises(ValueError, match="devices is empty"):
        plan_head_split(4, 4, [])


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "mask_heads", "mask_broadcast", "tier_online"])
def test_split_matches_torch(case):
    torch.manual_seed(5)
    H, Hkv, kw, engine, mask = 7, 7, {}, {}, None
    if case == "gqa":
        H, Hkv, kw = 8, 2, {"enable_gqa": True}
    q = torch.randn(2, H, 19, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, Hkv, 23, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, Hkv, 23, 6, dtype=torch.float64, requires_grad=True)
    if case == "causal":
        kw["is_causal"] = True
    elif case == "mask_heads":
        mask = torch.randn(2, H, 19, 23, dtype=torch.float64)
    elif case == "mask_broadcast":
        mask = torch.rand(19, 23) > 0.3
        mask[:, 0] = True
    elif case == "tier_online":
        engine = {"tier": "online", "block_q": 16, "block_kv": 16}
    dout = torch.randn(2, H, 19, 6, dtype=torch.float64)
    out = on_devices(q, k, v, mask, devices=CPU3, **kw, **engine)
    out.backward(dout)
    ref, ref_grads = reference_grads(q, k, v, dout, attn_mask=mask, **kw)
    assert (out - ref).abs().max() < 1e-12
    for t, g in zip((q, k, v), ref_grads):
        assert (t.grad - g).abs().max() < 1e-12


def test_groups_run_in_their_own_threads_and_are_logged(caplog):
    seen = []
    real = multidevice.scaled_dot_product_attention
    all_three_running = threading.Barrier(3, timeout=30)  # breaks (and fails the test) unless the groups overlap

    def spy(*a, **kw):
        seen.append((threading.get_ident(), a[0].shape[-3]))
        all_three_running.wait()
        return real(*a, **kw)

    q, k, v = (torch.randn(1, 6, 10, 4) for _ in range(3))
    multidevice.scaled_dot_product_attention = spy
    try:
        with caplog.at_level(logging.INFO, logger="attention_core.multidevice"):
            out = on_devices(q, k, v, devices=CPU3, log_level=logging.INFO)
    finally:
        multidevice.scaled_dot_product_attention = real
    assert sorted(h for _, h in seen) == [2, 2, 2]
    assert len({t for t, _ in seen}) == 3 and threading.get_ident() not in {t for t, _ in seen}
    assert out.shape == (1, 6, 10, 4)
    assert "cpu: query heads 0-1 (2)" in caplog.text and "cpu: query heads 4-5 (2)" in caplog.text
    assert "MB in" in caplog.text


def test_no_grad_and_inference_mode_carry_into_the_device_threads():
    modes = []
    real = multidevice.scaled_dot_product_attention

    def spy(*a, **kw):
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return real(*a, **kw)

    q, k, v = (torch.randn(1, 4, 10, 4, requires_grad=True) for _ in range(3))
    multidevice.scaled_dot_product_attention = spy
    try:
        with torch.no_grad():
            assert not on_devices(q, k, v, devices=CPU3).requires_grad
        assert modes == [(False, False)] * 3
        modes.clear()
        with torch.inference_mode():
            assert on_devices(q.detach(), k.detach(), v.detach(), devices=CPU3).is_inference()
        assert modes == [(False, True)] * 3
        modes.clear()
        assert on_devices(q, k, v, devices=CPU3).requires_grad
        assert modes == [(True, False)] * 3
    finally:
        multidevice.scaled_dot_product_attention = real


def test_autocast_decides_the_dtype_as_on_one_device():
    """Autocast state is per thread; the split takes the caller's (fp32 inputs computed in bf16, as torch does)."""
    from attention_core import scaled_dot_product_attention
    q, k, v = (torch.randn(1, 4, 10, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = scaled_dot_product_attention(q, k, v)
        split = on_devices(q, k, v, devices=CPU3)
    assert one.dtype == split.dtype == torch.bfloat16
    assert torch.equal(one, split)


@pytest.mark.parametrize("case", ["gqa_mask", "causal"])
def test_return_lse_through_the_split(case):
    """return_lse=True gives (out, lse) as in one process: lse exact against torch's logsumexp of the float64
    scores (scaled, masked), and differentiable (issue 17.6: the split crashed on the tuple)."""
    import math
    import torch.nn.functional as F
    torch.manual_seed(6)
    H, Hkv, L, S = 6, 3, 11, 13
    q = torch.randn(2, H, L, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, Hkv, S, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, Hkv, S, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(2, H, L, S, dtype=torch.float64) if case == "gqa_mask" else None
    causal = case == "causal"
    dout, dlse = torch.randn(2, H, L, 5, dtype=torch.float64), torch.randn(2, H, L, dtype=torch.float64)
    out, lse = on_devices(q, k, v, mask, is_causal=causal, enable_gqa=True, scale=0.3, devices=CPU3,
                          return_lse=True)
    assert lse.shape == (2, H, L) and lse.dtype == torch.float64
    grads = torch.autograd.grad([out, lse], [q, k, v], [dout, dlse])
    s = q @ k.repeat_interleave(H // Hkv, 1).transpose(-1, -2) * 0.3
    s = s + mask if mask is not None else s.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), -math.inf)
    ref_lse = torch.logsumexp(s, dim=-1)
    ref = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal, scale=0.3, enable_gqa=True)
    ref_grads = torch.autograd.grad([ref, ref_lse], [q, k, v], [dout, dlse])
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max() < 1e-12


def test_split_gives_the_remainder_to_the_first_devices_and_skips_idle_ones():
    """docs/multi-gpu.md: heads are cut into contiguous kv-head groups, as even as possible, the first devices
    taking the remainder; a device gets nothing when there are fewer kv heads than devices."""
    def spans(H, Hkv, n):
        return [(str(g.device), g.kv_heads.start, g.kv_heads.stop, g.q_heads.start, g.q_heads.stop)
                for g in plan_head_split(H, Hkv, [f"cuda:{i}" for i in range(n)])]
    assert spans(24, 24, 4) == [("cuda:0", 0, 6, 0, 6), ("cuda:1", 6, 12, 6, 12), ("cuda:2", 12, 18, 12, 18),
                                ("cuda:3", 18, 24, 18, 24)]
    assert spans(7, 7, 3) == [("cuda:0", 0, 3, 0, 3), ("cuda:1", 3, 5, 3, 5), ("cuda:2", 5, 7, 5, 7)]
    assert spans(12, 3, 2) == [("cuda:0", 0, 2, 0, 8), ("cuda:1", 2, 3, 8, 12)]  # GQA: 4 query heads a kv head
    assert spans(4, 1, 3) == [("cuda:0", 0, 1, 0, 4)]  # MQA: one kv head, one device
    assert spans(2, 2, 3) == [("cuda:0", 0, 1, 0, 1), ("cuda:1", 1, 2, 1, 2)]
    assert [g.describe() for g in plan_head_split(12, 3, ["cuda:0", "cuda:1"])] == [
        "cuda:0: query heads 0-7 (8)", "cuda:1: query heads 8-11 (4)"]


@pytest.mark.parametrize("H,Hkv", [(6, 4), (4, 0)])
def test_split_rejects_heads_that_do_not_group(H, Hkv):
    with pytest.raises(ValueError) as e:
        plan_head_split(H, Hkv, CPU3)
    assert str(e.value) == (f"scaled_dot_product_attention_on_devices: {H} query heads do not group over {Hkv} "
                            f"key/value heads")


def test_bad_inputs_raise_before_any_device_work():
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError) as e:
        on_devices(q[0, 0], q[0, 0], q[0, 0], devices=CPU3)
    assert str(e.value) == ("scaled_dot_product_attention_on_devices: query must be a tensor [..., H, L, E]; got "
                            "torch.Size([5, 8])")
    with pytest.raises(ValueError, match=r"query must be a tensor \[\.\.\., H, L, E\]; got list"):
        on_devices([1.0], q, q, devices=CPU3)
    with pytest.raises(ValueError) as e:
        on_devices(q, q[:, :2], q[:, :2], devices=CPU3)
    assert str(e.value) == ("scaled_dot_product_attention_on_devices: q has 4 heads, k/v 2; pass enable_gqa=True "
                            "for grouped-query attention")
    with pytest.raises(ValueError, match="devices is empty; list at least one, e.g. \\['cuda:0', 'cuda:1'\\]"):
        on_devices(q, q, q, devices=[])


def test_three_dim_inputs_and_a_per_head_three_dim_mask_split_by_head():
    """[H, L, E] inputs (no batch) with a float mask [H, L, S]: each device gets its heads' mask rows, so the
    result is torch's (a 3-D mask's head dim is cut like a 4-D one's)."""
    torch.manual_seed(3)
    q = torch.randn(4, 9, 8, dtype=torch.float64)
    k, v = torch.randn(4, 11, 8, dtype=torch.float64), torch.randn(4, 11, 8, dtype=torch.float64)
    mask = torch.randn(4, 9, 11, dtype=torch.float64)
    out = on_devices(q, k, v, mask, devices=["cpu", "cpu"])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-12
    # two heads on two devices with a [2, L, S] mask: each device's single head gets its own mask
    out = on_devices(q[:2], k[:2], v[:2], mask[:2], devices=["cpu", "cpu"])
    ref = torch.nn.functional.scaled_dot_product_attention(q[:2], k[:2], v[:2], mask[:2])
    assert (out - ref).abs().max() < 1e-12


def test_one_head_mask_broadcasts_to_every_device():
    """A mask with one head ([B, 1, L, S]) applies to every head: each device gets all of it."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(2, 1, 9, 9, dtype=torch.float64)
    out = on_devices(q, k, v, mask, devices=CPU3)
    assert (out - torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)).abs().max() < 1e-12


def test_a_device_error_is_raised_in_the_caller():
    """An engine error on a device (here an unknown tier) reaches the caller, not only the device's thread."""
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match="tier must be one of .*, got 'fastest'"):
        on_devices(q, q, q, devices=CPU3, tier="fastest")


def test_one_group_on_the_query_device_runs_in_the_caller():
    """One device that is q's own: the engine runs directly (no worker thread), the split logs nothing."""
    seen = []
    real = multidevice.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(threading.get_ident())
        return real(*a, **kw)

    q, k, v = (torch.randn(1, 4, 6, 8) for _ in range(3))
    multidevice.scaled_dot_product_attention = spy
    try:
        out = on_devices(q, k, v, devices=["cpu"])
        assert seen == [threading.get_ident()]
        out2 = on_devices(q, k, v, devices=["cpu", "cpu"])
        assert len(seen) == 3 and threading.get_ident() not in seen[1:]
    finally:
        multidevice.scaled_dot_product_attention = real
    assert torch.equal(out, out2)


def test_the_log_line_gives_each_devices_heads_and_megabytes(caplog):
    """The per-call log line (docs/multi-gpu.md: the split and the MB copied to each device) at log_level, and
    nothing when that level is off (CPU devices have no peak memory to report)."""
    q = torch.randn(1, 4, 512, 64)
    k = torch.randn(1, 2, 512, 64)
    v = torch.randn(1, 2, 512, 32)
    with caplog.at_level(logging.INFO, logger="attention_core.multidevice"):
        on_devices(q, k, v, enable_gqa=True, devices=["cpu", "cpu"])  # log_level DEBUG: below INFO, not logged
        assert caplog.records == []
        on_devices(q, k, v, enable_gqa=True, devices=["cpu", "cpu"], log_level=logging.INFO)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    # each device: q 2 heads x 512 x 64 x 4 B = 256 KiB, k 1 head 128 KiB, v 1 head x 32 = 64 KiB: 0.4375 MB
    assert caplog.records[0].getMessage() == (
        "attention on 2 devices, (1, 4, 512, 64): cpu: query heads 0-1 (2), 0.4 MB in; "
        "cpu: query heads 2-3 (2), 0.4 MB in")
    caplog.clear()
    q = torch.randn(1, 3, 2048, 64, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="attention_core.multidevice"):
        on_devices(q, q, q, devices=CPU3, log_level=logging.WARNING)
    # 3 tensors x 1 head x 2048 x 64 x 8 B = 3 MB a device
    assert caplog.records[0].getMessage() == (
        "attention on 3 devices, (1, 3, 2048, 64): cpu: query heads 0-0 (1), 3.0 MB in; "
        "cpu: query heads 1-1 (1), 3.0 MB in; cpu: query heads 2-2 (1), 3.0 MB in")


def test_the_log_line_gives_each_devices_peak_in_mb(caplog, monkeypatch):
    """On CUDA each device's peak memory joins the log line, in whole MB. CPU devices measure none, so the measured
    peak is stood in for here (2.5 GiB and 700 MiB), the rest of the call real."""
    real = multidevice._run_group
    peaks = [2560 * 2**20, 700 * 2**20 + 2**18]  # by device index: the device threads finish in any order

    def run_group(*args):
        real(*args)
        results, i = args[-2], args[-1]
        results[i] = (results[i][0], peaks[i], results[i][2])

    monkeypatch.setattr(multidevice, "_run_group", run_group)
    q = torch.randn(1, 2, 512, 64)
    with caplog.at_level(logging.INFO, logger="attention_core.multidevice"):
        on_devices(q, q, q, devices=["cpu", "cpu"], log_level=logging.INFO)
    assert caplog.records[0].getMessage() == (
        "attention on 2 devices, (1, 2, 512, 64): cpu: query heads 0-0 (1), 0.4 MB in, peak 2560 MB; "
        "cpu: query heads 1-1 (1), 0.4 MB in, peak 700 MB")


def _transformed(transform, f, q, k, v, tangents, w):
    """transform applied to f(q, k, v): the tensors it gives (a missing forward_ad tangent stays None)."""
    import torch.autograd.forward_ad as fwAD
    if transform == "grad":
        return torch.func.grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2))(q, k, v)
    if transform == "jacrev":
        return torch.func.jacrev(f, argnums=(0, 2))(q, k, v)
    if transform == "jvp":
        return torch.func.jvp(f, (q, k, v), tangents)
    if transform == "vmap":
        return (torch.func.vmap(f, in_dims=(0, None, None))(torch.stack([q, 2 * q]), k, v),)
    if transform == "hessian":
        return (torch.func.hessian(lambda q: (f(q, k, v) * w).sum())(q),)
    with fwAD.dual_level():  # forward_ad dual tensors
        out = f(*(fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)))
        primal, tangent = fwAD.unpack_dual(out)
        return primal.clone(), None if tangent is None else tangent.clone()


@pytest.mark.parametrize("transform", ["grad", "jacrev", "jvp", "vmap", "hessian", "forward_ad"])
def test_split_under_torch_func_and_forward_ad_is_exact(transform):
    """Issue 22.2: functorch's transform state and the dual tensors' level belong to the calling thread, so in the
    device threads grad, jacrev and jvp came out 0 and vmap raised "tensor may have escaped". Under a transform
    (and with dual tensors) the groups now run in the calling thread: exact against torch's math SDPA, GQA and a
    per-head mask included."""
    from reference import math_sdpa
    g = torch.Generator().manual_seed(22)
    q, tq, w = (torch.randn(1, 4, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k, v, tk, tv = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.randn(1, 4, 3, 5, generator=g, dtype=torch.float64)

    def body(attention, **kw):
        return lambda q, k, v: attention(q, k, v, mask, enable_gqa=True, **kw).sin()
    got = _transformed(transform, body(on_devices, devices=CPU3), q, k, v, (tq, tk, tv), w)
    want = _transformed(transform, body(math_sdpa), q, k, v, (tq, tk, tv), w)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a is not None, f"{transform}: no tangent"
        assert b.abs().max() > 0.1 and (a - b).abs().max() < 1e-12, transform


def test_split_under_a_transform_runs_in_the_calling_thread():
    """Which thread attends each group: the calling thread under torch.func (and with dual tensors), worker threads
    otherwise (test_groups_run_in_their_own_threads_and_are_logged)."""
    import torch.autograd.forward_ad as fwAD
    seen = []
    real = multidevice.scaled_dot_product_attention

    def spy(*a, **kw):
        seen.append(threading.get_ident())
        return real(*a, **kw)
    q = torch.randn(1, 3, 4, 4, dtype=torch.float64)
    multidevice.scaled_dot_product_attention = spy
    try:
        torch.func.grad(lambda q: on_devices(q, q, q, devices=CPU3).sum())(q)
        with fwAD.dual_level():
            on_devices(fwAD.make_dual(q, torch.ones_like(q)), q, q, devices=CPU3)
        assert seen == [threading.get_ident()] * 6
        seen.clear()
        with fwAD.dual_level():  # a dual level open but no dual tensor: the threads as usual
            on_devices(q, q, q, devices=CPU3)
        assert len(seen) == 3 and threading.get_ident() not in seen
    finally:
        multidevice.scaled_dot_product_attention = real
