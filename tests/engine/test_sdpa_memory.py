"""Tier choice from a memory budget, out-of-memory retries (injected) with exact results, and the final error."""
import logging

import pytest
import torch

import attention_core.sdpa as sdpa_mod
from attention_core import AttentionMemoryError
from attention_core.kernel import memory
from attention_core import scaled_dot_product_attention as sdpa
from attention_core.kernel.memory import free_memory, plan_backward, plan_forward, tile_budget
from attention_core.kernel.numerics import choose_numerics
from attention_core.kernel.problem import normalize
from attention_core.kernel.tiers import TIERS
from reference import reference


def qkv(n=64, h=4, e=16):
    torch.manual_seed(10)
    return torch.randn(1, h, n, e), torch.randn(1, h, n, e), torch.randn(1, h, n, e)


@pytest.fixture
def spy_tiers(monkeypatch):
    """Record (tier, block_q, kv heads) of every tier call; `fail` maps a tier to how many calls raise OOM."""
    calls, fail = [], {}

    def wrap(name, fn):
        def run(src, bq, bk, need_stats, **kw):
            calls.append((name, bq, src.p.Hkv))
            if fail.get(name, 0) != 0:
                fail[name] -= 1
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {bq} rows (injected)")
            return fn(src, bq, bk, need_stats, **kw)
        return run
    for name, fn in list(TIERS.items()):
        monkeypatch.setitem(TIERS, name, wrap(name, fn))
    return calls, fail


def test_auto_picks_tier_by_budget(spy_tiers, monkeypatch):
    calls, _ = spy_tiers
    q, k, v = qkv(n=256)
    ref = reference(q, k, v)
    row = 256  # score elements per (head, query row); tiers split heads before they give up
    # fp32 on the CPU: chunked and inplace hold 4 bytes a score (the chunked softmax overwrites its scores), so
    # chunked goes straight to online; each needs 16 query rows of one head at least
    for budget, tier in [(1 << 30, "chunked"), (row * 4 * 16, "chunked"), (row * 4 * 10, "online")]:
        calls.clear()
        out = sdpa(q, k, v, memory_budget=budget)
        assert calls[-1][0] == tier, (budget, calls)
        assert (out.double() - ref).abs().max() < 1e-5
    # where chunked holds S and P apart (GPUs: 8 bytes a score), inplace (4) comes between
    monkeypatch.setitem(memory.CHUNKED_SCORE_BUFFERS, "cpu", 2)
    for budget, tier in [(1 << 30, "chunked"), (row * 8 * 16, "chunked"), (row * 8 * 10, "inplace"),
                         (row * 4 * 8, "online")]:
        calls.clear()
        out = sdpa(q, k, v, memory_budget=budget)
        assert calls[-1][0] == tier, (budget, calls)
        assert (out.double() - ref).abs().max() < 1e-5


def test_oom_retries_smaller_tiles_then_next_tier(spy_tiers, caplog):
    calls, fail = spy_tiers
    q, k, v = qkv()
    ref = reference(q, k, v)
    fail["chunked"] = 2
    out = sdpa(q, k, v, tier="chunked", block_q=64)
    # halve the head group first (4 -> 2 -> 1 heads), then rows
    assert calls[:3] == [("chunked", 64, 4), ("chunked", 64, 2), ("chunked", 64, 1)]
    assert (out.double() - ref).abs().max() < 1e-5
    calls.clear()
    fail["chunked"] = -1  # always
    with caplog.at_level(logging.INFO):
        out = sdpa(q, k, v, tier="chunked", block_q=32)
    assert [c for c in calls if c[0] == "chunked"] == [("chunked", 32, 4), ("chunked", 32, 2), ("chunked", 32, 1),
                                                       ("chunked", 16, 1)]
    assert calls[-1][0] == "inplace"
    assert (out.double() - ref).abs().max() < 1e-5
    assert "next tier" in caplog.text


def test_oom_everywhere_raises_a_message_that_names_the_problem(spy_tiers):
    _, fail = spy_tiers
    fail.update(chunked=-1, inplace=-1, online=-1)
    q, k, v = qkv()
    with pytest.raises(AttentionMemoryError) as e:
        sdpa(q, k, v, memory_budget=1 << 20)
    msg = str(e.value)
    assert "64" in msg and "float32" in msg and "1 MB" in msg and "memory_budget" in msg


def test_other_errors_are_not_swallowed(monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setitem(TIERS, "chunked", boom)
    q, k, v = qkv()
    with pytest.raises(RuntimeError, match="illegal"):
        sdpa(q, k, v, tier="chunked")


def test_backward_retries_on_oom(monkeypatch):
    import attention_core.kernel.driver as drv
    real, count = drv.backward_tiles, {"n": 0}

    def flaky(*args):
        count["n"] += 1
        if count["n"] == 1:
            raise torch.OutOfMemoryError("out of memory (injected)")
        return real(*args)
    monkeypatch.setattr(drv, "backward_tiles", flaky)
    q, k, v = (t.double().requires_grad_() for t in qkv(n=40))
    sdpa(q, k, v, block_q=32).sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(q2, k2, v2).sum().backward()
    assert count["n"] == 3 and torch.allclose(q.grad, q2.grad)  # 4 heads failed, then 2 groups of 2 and torch.allclose(v.grad, v2.grad)


def test_plans_fit_the_budget():
    q, k, v = qkv(n=4096, h=16, e=64)
    p = normalize(q, k, v)
    num = choose_numerics(p.dtype, p.device)
    budget = 64 << 20
    for tier, per in (("chunked", 4), ("inplace", 4)):  # CPU chunked: P overwrites S
        plan = plan_forward(p, num, tier, budget)
        assert plan.block_q * plan.block_h * 4096 * per <= budget
    plan = plan_forward(p, num, "online", 1 << 18)
    assert plan is not None and plan.block_q * plan.block_kv * plan.block_h * 4 <= (1 << 18)  # fp32: 4 a score
    assert plan_forward(p, num, "chunked", 1 << 18) is not None  # 16 rows x 4096 keys x 4 bytes = 256 KiB
    assert plan_forward(p, num, "chunked", (1 << 18) - 1) is None


def test_free_memory_on_cpu_and_explicit_budget():
    assert free_memory(torch.device("cpu")) > 0
    assert tile_budget(torch.device("cpu"), 12345) == 12345
    with pytest.raises(ValueError):
        tile_budget(torch.device("cpu"), 0)


def test_free_memory_asks_each_backend_for_its_own_device_only(monkeypatch):
    """The MPS figure (recommended maximum less what the driver holds) is for mps devices; a device type no
    backend answers for (meta, hpu, ...) is unknown (None), even where MPS could answer."""
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 16 << 30, raising=False)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 6 << 30, raising=False)
    assert free_memory(torch.device("mps")) == 10 << 30
    for other in ("meta", "hpu", "lazy"):
        assert free_memory(torch.device(other)) is None, other


@pytest.mark.parametrize("tier", ["chunked", "inplace", "online"])
def test_head_groups_exact_forward_backward_dropout(tier, monkeypatch):
    """Small tiles split the heads into groups: results, gradients (float masks per head, per batch, both, neither)
    and dropout bits are the same as one tile over all heads."""
    import attention_core.kernel.memory as mem
    from reference import reference_grads
    torch.manual_seed(12)
    q, k, v = (torch.randn(2, 6, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for mask in (torch.randn(2, 6, 40, 40, dtype=torch.float64, requires_grad=True),
                 torch.randn(40, 40, dtype=torch.float64, requires_grad=True),
                 torch.randn(1, 6, 40, 40, dtype=torch.float64, requires_grad=True),  # per head, shared by batch
                 torch.randn(2, 1, 40, 40, dtype=torch.float64, requires_grad=True)):  # per batch, shared by heads
        dout = torch.randn(2, 6, 40, 8, dtype=torch.float64)
        ref_out, ref_grads = reference_grads(q, k, v, dout, mask)
        small = {"cpu": 2 * 16 * 40, "other": 2 * 16 * 40}  # 2 batches x 16 rows x 40 keys: fewer than 6 heads
        monkeypatch.setattr(mem, "TARGET_TILE_ELEMS", small)
        monkeypatch.setattr(mem, "ONLINE_TILE_ELEMS", small)  # online's own target
        monkeypatch.setattr(mem, "BACKWARD_TILE_ELEMS", small)  # the backward has its own target
        prob, num = normalize(q, k, v, mask), choose_numerics(torch.float64, q.device)
        assert plan_forward(prob, num, tier, 1 << 30).block_h < 6
        assert plan_backward(prob, num, 1 << 30).block_h < 6
        for t in (q, k, v, mask):
            t.grad = None
        out = sdpa(q, k, v, mask, tier=tier)
        out.backward(dout)
        assert (out - ref_out).abs().max() < 1e-10
        for got, want in zip((q.grad, k.grad, v.grad, mask.grad), ref_grads):
            assert (got - want).abs().max() < 1e-10
        monkeypatch.undo()
    torch.manual_seed(7)
    split = sdpa(q.detach(), k.detach(), v.detach(), dropout_p=0.3, tier=tier, block_q=40)
    monkeypatch.setattr(mem, "TARGET_TILE_ELEMS", {"cpu": 2 * 16 * 40, "other": 2 * 16 * 40})
    monkeypatch.setattr(mem, "ONLINE_TILE_ELEMS", {"cpu": 2 * 16 * 40, "other": 2 * 16 * 40})
    torch.manual_seed(7)
    assert torch.allclose(sdpa(q.detach(), k.detach(), v.detach(), dropout_p=0.3, tier=tier), split)
