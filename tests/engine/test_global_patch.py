"""The global patch of torch's SDPA: off at import, on/off by enable()/disable(), patched() blocks that nest and
overlap across threads, CausalBias masks."""
import threading

import pytest
import torch
import torch.nn.functional as F

import attention_core
import attention_core.patch as patch_mod

TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _restore():
    yield
    attention_core.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_import_patches_nothing():
    import importlib
    importlib.reload(attention_core)
    assert F.scaled_dot_product_attention is TORCH_SDPA and not attention_core.is_enabled()


def test_enable_disable_restores_original(monkeypatch):
    calls = []
    import attention_core.sdpa as sd
    real = sd.scaled_dot_product_attention
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q = torch.randn(1, 2, 8, 4)
    attention_core.enable(force=True, tier="online")
    assert attention_core.is_enabled() and F.scaled_dot_product_attention is not TORCH_SDPA
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls == [1]
    assert torch.allclose(out, TORCH_SDPA(q, q, q, is_causal=True), atol=1e-6)
    attention_core.enable(force=True)  # twice: no double wrap
    F.scaled_dot_product_attention(q, q, q)
    assert calls == [1, 1]
    attention_core.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not attention_core.is_enabled()
    with attention_core.patched(force=True):
        F.scaled_dot_product_attention(q, q, q)
    assert calls == [1, 1, 1] and F.scaled_dot_product_attention is TORCH_SDPA


def test_patch_passes_through_when_not_needed(monkeypatch):
    monkeypatch.setenv("TILED_ATTENTION", "off")
    import attention_core.sdpa as sd
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: pytest.fail("engine used"))
    q = torch.randn(1, 2, 8, 4)
    with attention_core.patched():
        F.scaled_dot_product_attention(q, q, q)


def _engine_options(monkeypatch):
    """Record the options each engine call gets."""
    import attention_core.sdpa as sd
    seen, real = [], sd.scaled_dot_product_attention
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: seen.append(k) or real(*a, **k))
    return seen


def test_patched_inside_enable_keeps_the_global_patch(monkeypatch):
    seen = _engine_options(monkeypatch)
    q = torch.randn(1, 2, 8, 4)
    attention_core.enable(force=True, tier="online")
    with attention_core.patched(force=True, tier="chunked"):
        with attention_core.patched(force=True, tier="inplace"):
            F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert attention_core.is_enabled() and F.scaled_dot_product_attention is not TORCH_SDPA
    F.scaled_dot_product_attention(q, q, q)
    assert [k["tier"] for k in seen] == ["inplace", "chunked", "online"]
    attention_core.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_block_open_in_a_thread_when_enable_is_called_keeps_the_global_patch():
    """A thread's patched() block exiting after enable() used to restore what it saw on entry (off)."""
    entered, leave = threading.Event(), threading.Event()

    def body():
        with attention_core.patched(force=True):
            entered.set()
            assert leave.wait(10)

    t = threading.Thread(target=body)
    t.start()
    assert entered.wait(10)
    attention_core.enable(force=True)
    leave.set()
    t.join()
    assert attention_core.is_enabled() and F.scaled_dot_product_attention is not TORCH_SDPA


def _in_thread(steps, gates):
    """Run `steps` (a list of 'enter'/'exit') in a thread, each step after its gate is set; returns the thread
    and an event per step set when the step is done."""
    done = [threading.Event() for _ in steps]
    errors = []

    def body():
        ctx = attention_core.patched(force=True)
        try:
            for step, gate, ev in zip(steps, gates, done):
                assert gate.wait(10), "choreography stalled"
                ctx.__enter__() if step == "enter" else ctx.__exit__(None, None, None)
                ev.set()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            for ev in done:
                ev.set()

    t = threading.Thread(target=body)
    t.start()
    return t, done, errors


@pytest.mark.parametrize("order", ["A+ B+ A- B-", "A+ B+ B- A-", "A+ A- B+ B-"])
def test_overlapping_blocks_in_threads_restore_torch(order):
    """A enters, B enters, A exits, B exits used to leave the patch on."""
    go = {k: threading.Event() for k in ("A+", "A-", "B+", "B-")}
    ta, (a_in, a_out), ea = _in_thread(["enter", "exit"], [go["A+"], go["A-"]])
    tb, (b_in, b_out), eb = _in_thread(["enter", "exit"], [go["B+"], go["B-"]])
    done = {"A+": a_in, "A-": a_out, "B+": b_in, "B-": b_out}
    open_blocks = set()
    for step in order.split():
        go[step].set()
        assert done[step].wait(10)
        open_blocks.add(step[0]) if step.endswith("+") else open_blocks.discard(step[0])
        assert attention_core.is_enabled() == bool(open_blocks), step
        assert (F.scaled_dot_product_attention is TORCH_SDPA) == (not open_blocks), step
    ta.join(), tb.join()
    assert not ea and not eb
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_many_threads_nesting_leave_nothing_patched():
    q = torch.randn(1, 2, 8, 4)
    want = TORCH_SDPA(q, q, q)
    errors = []

    def worker():
        try:
            for _ in range(20):
                with attention_core.patched(force=True):
                    with attention_core.patched(force=True, tier="online"):
                        assert torch.allclose(F.scaled_dot_product_attention(q, q, q), want, atol=1e-5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors and F.scaled_dot_product_attention is TORCH_SDPA and not attention_core.is_enabled()


def test_causal_bias_masks_through_the_patch():
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    for make in (causal_upper_left, causal_lower_right):
        for lq in (6, 10):
            mask = make(lq, 10)
            qq = torch.randn(1, 2, lq, 8)
            want = TORCH_SDPA(qq, k, v, attn_mask=mask)
            with attention_core.patched(force=True):
                got = F.scaled_dot_product_attention(qq, k, v, attn_mask=mask)
            assert (got - want).abs().max() < 1e-5, (make.__name__, lq)
    with attention_core.patched(force=True), pytest.raises(ValueError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=causal_upper_left(6, 10), is_causal=True)


@pytest.mark.parametrize("mask", ["none", "bool", "float", "key_padding"])
def test_multihead_attention_through_the_patch(mask, engine_calls_counter):
    """nn.MultiheadAttention (training path) calls F.scaled_dot_product_attention: same output and gradients."""
    torch.manual_seed(4)
    mha = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    am = {"bool": (torch.rand(6, 6) > 0.7).fill_diagonal_(False), "float": torch.randn(6, 6)}.get(mask)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2]) if mask == "key_padding" else None

    def run():
        x.grad = None
        mha.zero_grad()
        out = mha(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
        out.square().sum().backward()
        return out.detach(), x.grad.clone(), mha.in_proj_weight.grad.clone()

    want = run()
    with attention_core.patched(force=True):
        got = run()
    assert engine_calls_counter
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.fixture
def engine_calls_counter(monkeypatch):
    import attention_core.sdpa as sd
    calls, real = [], sd.scaled_dot_product_attention
    monkeypatch.setattr(sd, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_fully_masked_rows_match_torch(engine_calls_counter):
    """Rows with every key masked: torch's float -inf mask gives NaN, a boolean mask gives 0 (math backend)."""
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    float_mask = torch.zeros(4, 6)
    float_mask[1] = float("-inf")
    bool_mask = torch.ones(4, 6, dtype=torch.bool)
    bool_mask[2] = False
    for m in (float_mask, bool_mask):
        want = TORCH_SDPA(q, k, v, attn_mask=m)
        with attention_core.patched(force=True):
            got = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got.nan_to_num(0), want.nan_to_num(0), atol=1e-6, rtol=1e-5)
    assert engine_calls_counter


def test_min_tokens_floor_counts_and_config(engine_calls_counter):
    """Calls whose longer sequence (query or key) is under min_tokens go to torch; stats() counts per outcome."""
    patch_mod.reset_stats()
    q, k_long = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 16, 4)
    assert patch_mod.config() is None
    attention_core.enable(force=True, min_tokens=16, tier="online")
    assert patch_mod.config() == (True, 16, {"tier": "online"})
    F.scaled_dot_product_attention(q, q, q)  # 8 tokens: torch's
    assert not engine_calls_counter
    F.scaled_dot_product_attention(q, k_long, k_long)  # 16 keys: the engine's
    assert len(engine_calls_counter) == 1
    assert patch_mod.stats()["torch_sdpa"] == {"routed": 1, "passed": 1, "deferred": 0, "total": 2, "compiled": 0}
    with pytest.raises(ValueError, match="min_tokens must be a whole number >= 0"):
        attention_core.enable(force=True, min_tokens=-1)
    attention_core.disable()
    F.scaled_dot_product_attention(q, k_long, k_long)
    assert patch_mod.stats()["torch_sdpa"]["total"] == 2  # off: nothing counted
    patch_mod.reset_stats()
    assert patch_mod.stats() == {}


def test_deferred_calls_go_to_torch_on_that_thread_only(engine_calls_counter):
    """deferred(): another route decided these calls (Patch Attention's pass-through): torch runs them, and
    other threads are not affected."""
    patch_mod.reset_stats()
    q = torch.randn(1, 2, 8, 4)
    attention_core.enable(force=True)
    other = []
    with patch_mod.deferred():
        with patch_mod.deferred():
            assert patch_mod.is_deferred()
            out = F.scaled_dot_product_attention(q, q, q)
        t = threading.Thread(target=lambda: other.append(F.scaled_dot_product_attention(q, q, q)))
        t.start()
        t.join()
    assert not patch_mod.is_deferred()
    assert torch.equal(out, TORCH_SDPA(q, q, q)) and len(engine_calls_counter) == 1  # the thread's call only
    assert patch_mod.stats()["torch_sdpa"] == {"routed": 1, "passed": 0, "deferred": 1, "total": 2, "compiled": 0}


def test_switched_off_inside_another_wrapper_and_on_again_never_recurses():
    """A library wraps the patched function, the patch is switched off (ours stays inside their wrapper) and on
    again: re-wrapping their wrapper made the two call each other without end on the pass-through path."""
    q = torch.randn(1, 2, 8, 4)
    seen = []
    attention_core.enable(force=True, min_tokens=10 ** 6)  # every call passes through to torch
    ours = F.scaled_dot_product_attention

    def theirs(*a, **k):
        seen.append(1)
        return ours(*a, **k)
    F.scaled_dot_product_attention = theirs
    try:
        attention_core.disable()
        assert F.scaled_dot_product_attention is theirs and not attention_core.is_enabled()
        attention_core.enable(force=True, min_tokens=10 ** 6)  # ours on top again: ours -> theirs -> ours -> torch
        assert F.scaled_dot_product_attention is ours and attention_core.is_enabled()
        assert torch.allclose(F.scaled_dot_product_attention(q, q, q), TORCH_SDPA(q, q, q))
        assert seen == [1]
        attention_core.disable()
        assert F.scaled_dot_product_attention is theirs
        assert torch.allclose(F.scaled_dot_product_attention(q, q, q), TORCH_SDPA(q, q, q)) and seen == [1, 1]
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA


def test_disable_without_closing_blocks_keeps_other_codes_open_block():
    """The process-wide mode switched off (nodes/everywhere.py) drops only enable()'s hold: a patched() block other
    code has open stays patched until it exits, then torch's function is back; plain disable() closes both."""
    attention_core.enable(force=True, tier="chunked")
    with attention_core.patched(force=True, tier="online"):
        patch_mod.disable(close_blocks=False)
        assert attention_core.is_enabled() and F.scaled_dot_product_attention is not TORCH_SDPA
        assert patch_mod.config().options.get("tier") == "online"
    assert F.scaled_dot_product_attention is TORCH_SDPA and not attention_core.is_enabled()
    attention_core.enable(force=True)
    with attention_core.patched(force=True):
        attention_core.disable()
        assert F.scaled_dot_product_attention is TORCH_SDPA
