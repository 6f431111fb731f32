"""Issue 22.11: the lines of ffn/, patch.py and multidevice.py that no other in-process engine test runs, each
reached through the public API (or, for GPU-only and compile-only lines, with the GPU calls or torch.compile's
`is_compiling` stood in) and its effect asserted: outputs equal to the unchunked / unpatched call's or torch's math
SDPA on float64 copies, the exact messages, the values the line computes."""
import contextlib
import dataclasses
import logging
import re
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import attention_core
import attention_core.patch as patch_mod
from attention_core import ChunkedFFN, chunk_ffn, multidevice
from attention_core.ffn import exactness, state
from attention_core.multidevice import scaled_dot_product_attention_on_devices as on_devices
from reference import f64, math_sdpa

FFN_LOG = "attention_core.ffn"


def mlp(dim=16, hidden=32, seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))


class Lin(torch.nn.Module):
    """A token-wise Linear whose forward records the shapes it is called with."""
    def __init__(self, dim=16, seed=3):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(dim, dim)
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.lin(x)


@pytest.fixture
def tracing(monkeypatch):
    """torch.compiler.is_compiling() and is_dynamo_compiling() answer True: the code paths dynamo traces run as plain
    Python (coverage sees them; under a real torch.compile they are traced, never executed)."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)


# ---------------------------------------------------------------------------------------------- ffn/exactness.py

def test_out_of_memory_on_the_probes_decides_nothing(caplog):
    """exactness.py 52-53: a forward that runs out of memory on the check's chunks gives no verdict: the call runs
    unchunked, nothing is remembered (the next call checks again), nothing is warned."""
    class Tight(Lin):
        def forward(self, x):
            if x.shape[1] < 40:
                raise torch.OutOfMemoryError("out of memory on a chunk")
            return super().forward(x)
    m = Tight()
    x = torch.randn(2, 40, 16)
    ref = m.lin(x)
    w = chunk_ffn(m, chunks=4)
    with caplog.at_level(logging.INFO, logger=FFN_LOG):
        assert torch.equal(m(x), ref)
        assert torch.equal(m(x), ref)
    assert w.verdicts == {} and w.verified is None and w.calls_chunked == 0
    assert caplog.records == []


def test_a_forward_failing_on_chunks_runs_unchunked_and_says_why(caplog):
    """exactness.py 54-56: an exception on a chunk is a False verdict, logged at INFO with the module and error."""
    class Strict(Lin):
        def forward(self, x):
            if x.shape[1] != 40:
                raise ValueError("needs all 40 tokens")
            return super().forward(x)
    m = Strict()
    x = torch.randn(2, 40, 16)
    ref = m.lin(x)
    w = chunk_ffn(m, chunks=4)
    with caplog.at_level(logging.INFO, logger=FFN_LOG):
        assert torch.equal(m(x), ref)
    assert w.verified is False and len(w.verdicts) == 1 and w.calls_chunked == 0
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["Strict: the forward fails on token chunks (needs all 40 tokens); running it unchunked"]


def test_an_output_the_second_partition_cannot_assemble_is_not_exact():
    """exactness.py 83: the second partition (its single-token piece returns float64) cannot be assembled: the
    partitions disagree, the verdict is False; _close is False for a missing, reshaped or retyped output."""
    class OneTokenDouble(Lin):
        def forward(self, x):
            y = super().forward(x)
            return y.double() if x.shape[1] == 1 else y
    m = OneTokenDouble()
    x = torch.randn(2, 40, 16)
    ref = m.lin(x)
    w = chunk_ffn(m, chunks=4)
    assert torch.equal(m(x), ref)
    assert w.verified is False and w.calls_chunked == 0
    a = torch.randn(2, 5, 3)
    assert exactness._close(a, a.clone()) is True
    assert exactness._close(a, None) is False
    assert exactness._close(a, a[:, :4]) is False
    assert exactness._close(a, a.double()) is False


def test_integer_and_empty_outputs_compare_exactly():
    """exactness.py 85: integer (and empty) outputs are compared with torch.equal: a token-wise argmax is chunked,
    a cumulative one (mixes tokens) is not; a token-wise empty output is chunked."""
    class ArgMax(torch.nn.Module):
        def forward(self, x):
            return x.argmax(-1, keepdim=True)

    class CumSign(torch.nn.Module):
        def forward(self, x):
            return (x.cumsum(1) > 0).long()

    class Empty(torch.nn.Module):
        def forward(self, x):
            return x[..., :0] * 2
    x = torch.randn(2, 40, 16)
    for module, chunked in ((ArgMax(), True), (CumSign(), False), (Empty(), True)):
        ref = module(x)
        w = chunk_ffn(module, chunks=4)
        out = module(x)
        assert torch.equal(out, ref) and out.dtype == ref.dtype, type(module).__name__
        assert w.verified is chunked and w.calls_chunked == int(chunked), type(module).__name__


def test_non_finite_values_in_other_places_are_not_exact():
    """exactness.py 89: a module that writes inf into the first token of whatever it is given puts it elsewhere
    for each partition: not exact, run unchunked (one inf, at token 0)."""
    class FirstInf(Lin):
        def forward(self, x):
            y = super().forward(x).clone()
            y[:, 0] = float("inf")
            return y
    m = FirstInf()
    x = torch.randn(2, 40, 16)
    ref = m(x)
    w = chunk_ffn(m, chunks=4)
    out = m(x)
    assert w.verified is False and w.calls_chunked == 0
    assert torch.equal(torch.isinf(out), torch.isinf(ref)) and int(torch.isinf(out).sum()) == 2 * 16
    assert torch.allclose(out, ref)


def test_seeded_normal_on_a_device_without_its_own_generator(monkeypatch):
    """exactness.py 133-135: a device whose Generator cannot be made (meta: not an accelerator) gets the CPU
    generator's values, with the same seed and dtype, moved to the device."""
    on_meta = exactness.seeded_normal((3, 4), torch.float64, torch.device("meta"), 123)
    assert on_meta.device.type == "meta" and on_meta.shape == (3, 4) and on_meta.dtype == torch.float64
    real = torch.Generator

    def no_device_generator(device=None):
        if device is not None:
            raise RuntimeError("no generator on this device")
        return real()
    monkeypatch.setattr(torch, "Generator", no_device_generator)
    got = exactness.seeded_normal((3, 4), torch.float64, torch.device("cpu"), 123)
    want = torch.randn((3, 4), generator=real().manual_seed(123), dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------- ffn/signature.py

class Switch(Lin):
    """Token-wise unless asked to mix (a hashable flag, or an unhashable set of options)."""
    def forward(self, x, mix=False, opts=frozenset()):
        y = super().forward(x)
        return y + x.mean(dim=1, keepdim=True) if mix or "mix" in opts else y


def test_non_tensor_arguments_are_part_of_the_signature():
    """signature.py 40-42: a hashable argument is keyed by value: mix=False and mix=True get a verdict each, so the
    token-wise verdict of mix=False is never reused for the mixing call."""
    m = Switch()
    x = torch.randn(2, 40, 16)
    ref_plain, ref_mix = m(x, mix=False), m(x, mix=True)
    w = chunk_ffn(m, chunks=4)
    assert torch.allclose(m(x, mix=False), ref_plain, atol=1e-6)
    assert torch.allclose(m(x, mix=True), ref_mix, atol=1e-6)
    assert list(w.verdicts.values()) == [True, False] and w.calls_chunked == 1
    assert [k[2] for k in w.verdicts] == [("dict", ("mix", False)), ("dict", ("mix", True))]


def test_unhashable_arguments_are_keyed_by_identity():
    """signature.py 43-44: an unhashable argument (a set) is keyed by its identity: two different sets get a verdict
    each, the same set object reuses its verdict."""
    m = Switch()
    x = torch.randn(2, 40, 16)
    quiet, mixing = set(), {"mix"}
    ref_quiet, ref_mix = m(x, opts=quiet), m(x, opts=mixing)
    w = chunk_ffn(m, chunks=4)
    assert torch.allclose(m(x, opts=quiet), ref_quiet, atol=1e-6)
    assert torch.allclose(m(x, opts=mixing), ref_mix, atol=1e-6)
    assert torch.allclose(m(x, opts=quiet), ref_quiet, atol=1e-6)
    assert list(w.verdicts.values()) == [False, True] and w.calls_chunked == 2  # LRU order: quiet used last
    assert [k[2] for k in w.verdicts] == [("dict", ("opts", ("id", id(mixing)))), ("dict", ("opts", ("id", id(quiet))))]


# -------------------------------------------------------------------------------------------------- ffn/state.py

def test_at_most_max_signatures_verdicts_the_oldest_forgotten():
    """state.py 29: 65 signatures keep the latest 64 verdicts; the first one is forgotten."""
    assert state.MAX_SIGNATURES == 64
    m = torch.nn.Linear(4, 4)
    w = chunk_ffn(m, chunks=2)
    for n in range(2, 2 + 65):
        m(torch.randn(1, n, 4))
    lengths = [k[0][1][1] for k in w.verdicts]
    assert lengths == list(range(3, 2 + 65)) and all(w.verdicts.values())


# ------------------------------------------------------------------------------------------------ ffn/wrapper.py

def test_negative_chunks_are_refused_and_nothing_is_installed():
    """wrapper.py 39."""
    m = mlp()
    with pytest.raises(ValueError, match=re.escape("chunks must be >= 0 (0 = auto), got -1")):
        chunk_ffn(m, chunks=-1)
    assert "forward" not in m.__dict__
    assert ChunkedFFN(m.forward, chunks=0).chunks == 0


def test_rewrapped_keeps_the_settings_around_the_other_forward():
    """wrapper.py 63: the same module of another model: a fresh wrapper (no verdicts, its own trace key) with the
    same chunks, dim, hidden width and name, computing with the other module."""
    a, b = mlp(seed=1), mlp(seed=2)
    w = chunk_ffn(a, chunks=3, dim=0)
    x = torch.randn(12, 2, 16)
    a(x)
    w2 = w.rewrapped(b.forward)
    assert w2 is not w and w2.forward == b.forward and w2._trace_key != w._trace_key
    assert (w2.chunks, w2.dim, w2.hidden, w2.name) == (3, 0, 32, "Sequential") == (w.chunks, w.dim, w.hidden, w.name)
    assert w2.verdicts == {} and len(w.verdicts) == 1
    assert torch.allclose(w2(x), b(x), atol=1e-6) and w2.calls_chunked == 1


def test_an_explicit_module_is_the_owner_whose_state_the_check_restores():
    """wrapper.py 72: a wrapper around a plain function, given the module: the check's probes leave the module's
    buffer as they found it (only the 4 real chunk calls count), and its train/eval mode keys the verdicts."""
    class Counting(Lin):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls += 1
            return super().forward(x)
    m = Counting()
    w = ChunkedFFN(lambda x: m(x), chunks=4, module=m)
    assert w.owner() is m
    x = torch.randn(2, 40, 16)
    assert torch.allclose(w(x), m.lin(x), atol=1e-6)
    assert int(m.calls) == 4 and w.calls_chunked == 1
    m.eval()
    w(x)
    assert [k[-1] for k in w.verdicts] == [True, False]


def test_chunk_ffn_again_updates_the_installed_wrapper():
    """wrapper.py 175-177: chunk_ffn on a module already wrapped sets the new chunks and dim on the same wrapper."""
    m = Lin()
    w = chunk_ffn(m, chunks=2)
    assert chunk_ffn(m, chunks=5, dim=0) is w and m.forward is w
    assert (w.chunks, w.dim) == (5, 0)
    x = torch.randn(10, 3, 16)
    out = m(x)
    assert torch.allclose(out, m.lin(x), atol=1e-6) and w.calls_chunked == 1
    assert m.shapes[-5:] == [(2, 3, 16)] * 5


# ------------------------------------------- ffn/wrapper.py and state.py: the call as dynamo traces it (is_compiling)

def test_traced_call_chunks_a_tokenwise_module(tracing):
    """wrapper.py 91, 127-136, state.py 41: inside a trace the call is decided by decide_while_tracing (dtype and
    device as strings), chunked into the decided pieces, not counted; the verdict is the signature's."""
    m = Lin()
    x = torch.randn(2, 40, 16)
    ref = m.lin(x)
    w = chunk_ffn(m, chunks=4)
    m.shapes.clear()
    out = m(x)
    assert torch.allclose(out, ref, atol=1e-6) and w.calls_chunked == 0
    assert m.shapes[-4:] == [(2, 10, 16)] * 4 and (2, 40, 16) not in m.shapes
    assert list(w.verdicts.items()) == [
        ((("T", (2, 40, 16), torch.float32, torch.device("cpu")), ("tuple",), ("dict",), True), True)]


def test_traced_call_with_extra_arguments_runs_unchunked(tracing):
    """wrapper.py 128-129: extra arguments inside a trace: the plain call, with its arguments, nothing decided."""
    m = Switch()
    x = torch.randn(2, 40, 16)
    ref = m(x, mix=True)
    w = chunk_ffn(m, chunks=4)
    m.shapes.clear()
    assert torch.equal(m(x, mix=True), ref)
    assert m.shapes == [(2, 40, 16)] and w.verdicts == {}


def test_traced_call_of_a_mixing_module_runs_unchunked(tracing, caplog):
    """wrapper.py 133-135: the decision is 0 chunks for a module that mixes tokens: the plain call."""
    class Mixer(Lin):
        def forward(self, x):
            return super().forward(x) + x.mean(dim=1, keepdim=True)
    m = Mixer()
    x = torch.randn(2, 40, 16)
    ref = m(x)
    w = chunk_ffn(m, chunks=4)
    with caplog.at_level(logging.WARNING, logger=FFN_LOG):
        m.shapes.clear()
        out = m(x)
    assert torch.equal(out, ref) and m.shapes[-1] == (2, 40, 16) and w.verified is False
    assert [r.getMessage() for r in caplog.records] == [
        "Mixer: chunked output differs from the unchunked one or cannot be assembled (the module mixes tokens or "
        "changes their number); the compiled graph runs it unchunked"]


def test_traced_call_with_one_auto_chunk_decides_nothing(tracing):
    """wrapper.py 149: auto chunks (0) on a small input is one chunk: decide gives 0 without a check, the plain
    call runs once, no verdict."""
    m = Lin()
    x = torch.randn(2, 40, 16)
    w = chunk_ffn(m, chunks=0)
    assert w.decide((2, 40, 16), torch.float32, torch.device("cpu"), 1, True) == 0
    m.shapes.clear()
    assert torch.equal(m(x), m.lin(x))
    assert m.shapes == [(2, 40, 16)] and w.verdicts == {}


def test_traced_call_whose_chunks_cannot_be_assembled_returns_the_plain_call(tracing):
    """wrapper.py 137: the decision came from random inputs (chunked), but this input's pieces do not give one
    tensor each (a NaN makes the module return a tuple): the plain call's result is returned."""
    class NanTuple(Lin):
        def forward(self, x):
            y = super().forward(x)
            return (y, "had a NaN") if torch.isnan(x).any() else y
    m = NanTuple()
    x = torch.randn(2, 40, 16)
    x[0, 0, 0] = float("nan")
    w = chunk_ffn(m, chunks=4)
    out = m(x)
    assert w.verified is True
    assert isinstance(out, tuple) and out[1] == "had a NaN"
    assert torch.allclose(out[0], m.lin(x), equal_nan=True) and m.shapes[-1] == (2, 40, 16)


def test_compiled_call_with_a_size_marked_dynamic_runs_unchunked():
    """torch._dynamo.mark_dynamic(x, 1): the user asked for one graph for every token count, which specializing
    would break (ConstraintViolationError); the wrapped call runs plain in the graph instead, exactly, no graph
    break, no decision taken. (The module records nothing: a list of shapes would make dynamo guard on them.)"""
    from torch._dynamo.utils import counters
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    xs = [torch.randn(2, n, 16) for n in (40, 41)]
    with torch.no_grad():
        want = [m(x) for x in xs]
    w = chunk_ffn(m, chunks=4)
    for x in xs:
        torch._dynamo.mark_dynamic(x, 1)
    torch._dynamo.reset()
    counters.clear()
    try:
        c = torch.compile(m, backend="eager", fullgraph=True)
        outs = [c(x) for x in xs]
        breaks, graphs = dict(counters["graph_break"]), counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert breaks == {} and graphs == 1
    assert all(torch.allclose(o, r, atol=1e-6) for o, r in zip(outs, want))
    assert w.verdicts == {}


@pytest.mark.parametrize("dynamic", [True, None])
def test_compiled_call_with_dynamic_shapes_is_chunked_per_token_count(dynamic):
    """Under dynamo a symbolic size looks like an int to traced code, and the chunking decision takes constants
    only: the wrapper makes the shape concrete (dynamo specializes the graph on it), so dynamic=True and the
    default's automatic dynamic shapes (the 2nd token count) compile with fullgraph, no graph break, each token
    count decided (and chunked) on its own, exactly. Before: the symbolic size failed the compile."""
    from torch._dynamo.utils import counters
    m = Lin()
    w = chunk_ffn(m, chunks=4)
    xs = [torch.randn(2, n, 16) for n in (40, 41, 44)]
    torch._dynamo.reset()
    counters.clear()
    try:
        c = torch.compile(m, backend="eager", fullgraph=True, dynamic=dynamic)
        outs = [c(x) for x in xs]
        breaks = dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
    assert breaks == {}
    assert all(torch.allclose(o, m.lin(x), atol=1e-6) for o, x in zip(outs, xs))
    assert sorted(k[0][1][1] for k, v in w.verdicts.items() if v) == [40, 41, 44]  # one chunked verdict each


# --------------------------------------------------------------------------------------------------- patch.py

@pytest.fixture
def patch_restored():
    yield
    attention_core.disable()


@pytest.fixture
def torch_sdpa(monkeypatch):
    """torch's SDPA function as the test starts; the patch's state (the functions ours was put over, our function's
    wrapper attributes, F.scaled_dot_product_attention) is put back after it, whatever another library's stand-in
    did to it."""
    original = F.scaled_dot_product_attention
    monkeypatch.setattr(patch_mod, "_state", patch_mod.State(False, patch_mod.OFF, ()))
    saved = dict(patch_mod._patched_sdpa.__dict__)
    yield original
    attention_core.disable()
    F.scaled_dot_product_attention = original
    patch_mod._patched_sdpa.__dict__.clear()
    patch_mod._patched_sdpa.__dict__.update(saved)


def _qkv(seed=0, n=24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(3)]


def test_a_torch_without_causal_bias_routes_plain_masks(monkeypatch, patch_restored):
    """patch.py 73-74: where torch.nn.attention.bias cannot be imported (older torch) no mask is a CausalBias: a
    tensor mask is routed to the engine, exact."""
    monkeypatch.setitem(sys.modules, "torch.nn.attention.bias", None)
    q, k, v = _qkv()
    mask = torch.randn(1, 2, 24, 24, dtype=torch.float64)
    assert patch_mod._is_causal_bias(mask) is False
    patch_mod.reset_stats()
    with attention_core.patched(force=True):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert patch_mod.stats()[patch_mod.SDPA_PATH]["routed"] == 1
    assert (out - math_sdpa(f64(q), f64(k), f64(v), f64(mask))).abs().max() < 1e-12


def test_calls_inside_a_trace_are_not_counted(patch_restored, monkeypatch):
    """patch.py 98: nothing is counted while torch.compile traces (a counter read in the graph would be a guard)."""
    patch_mod.reset_stats()
    patch_mod.record(patch_mod.SDPA_PATH, "passed")
    assert patch_mod.stats() == {patch_mod.SDPA_PATH: {"routed": 0, "passed": 1, "deferred": 0, "total": 1,
                                                       "compiled": 0}}
    patch_mod.reset_stats()
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
    q, k, v = _qkv()
    with attention_core.patched(force=False, min_tokens=10**6):
        out = F.scaled_dot_product_attention(q, k, v)
        patch_mod.record(patch_mod.SDPA_PATH, "deferred")
    assert patch_mod.stats() == {}
    assert (out - math_sdpa(q, k, v)).abs().max() < 1e-12


def test_a_traced_pass_through_goes_to_the_latest_function_under_ours(monkeypatch, torch_sdpa):
    """patch.py 153: inside a trace a call the patch passes goes to the latest function ours was put over: here
    another library's function (installed while ours was on, holding torch's own), not torch's own."""
    calls = []

    def theirs(*args, **kwargs):
        calls.append(1)
        return torch_sdpa(*args, **kwargs)
    q, k, v = _qkv()
    attention_core.enable(min_tokens=10**6)
    F.scaled_dot_product_attention = theirs  # the other library installs its function over ours...
    attention_core.disable()  # ...so ours stays under it, switched off
    assert F.scaled_dot_product_attention is theirs
    attention_core.enable(min_tokens=10**6)  # ours goes over theirs
    assert patch_mod._state.fallbacks == (torch_sdpa, theirs)
    with monkeypatch.context() as mp:
        mp.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
        out = F.scaled_dot_product_attention(q, k, v)
    # torch 2.5's dynamo cannot count re-entries (patch.TRACED_STORES_SEEN): there, torch's own, never a loop
    assert calls == ([1] if patch_mod.TRACED_STORES_SEEN else []) and torch.equal(out, torch_sdpa(q, k, v))


@pytest.mark.parametrize("theirs_holds", ["ours", "torch"])
def test_compiled_pass_through_under_a_foreign_wrapper_neither_loops_nor_changes_the_answer(monkeypatch, torch_sdpa,
                                                                                             theirs_holds):
    """Another library puts its function over ours while ours is on (holding ours, as a wrapper of what it found,
    or torch's own, captured earlier), ours is switched off (it stays inside theirs), then on again (over theirs).
    A call the patch passes on goes to theirs; when theirs holds ours, ours passes it one further back (to torch's
    own), in eager code by a thread-local count and in a real torch.compile(fullgraph=True) trace by a module
    global: before, the trace looped without end (RecursionError). torch 2.5's dynamo cannot count, so there a
    traced pass-through goes to torch's own directly (theirs is skipped in the graph)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    calls = []
    q = torch.randn(1, 2, 8, 4)
    try:
        attention_core.enable(min_tokens=10**6)
        inner = F.scaled_dot_product_attention if theirs_holds == "ours" else torch_sdpa

        def theirs(*args, **kwargs):
            calls.append(1)
            return inner(*args, **kwargs)
        F.scaled_dot_product_attention = theirs
        attention_core.disable()
        attention_core.enable(min_tokens=10**6)
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), torch_sdpa(q, q, q)) and len(calls) == 1
        calls.clear()
        torch._dynamo.reset()
        counters.clear()
        f = torch.compile(lambda x: F.scaled_dot_product_attention(x, x, x) * 2, backend="eager", fullgraph=True)
        out = f(q)
        assert dict(counters["graph_break"]) == {}
        assert torch.allclose(out, 2 * torch_sdpa(q, q, q), atol=1e-6)
        assert len(calls) == (1 if patch_mod.TRACED_STORES_SEEN else 0) and patch_mod._traced_passing == 0
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------- multidevice.py

def _cuda_stand_ins(monkeypatch, events, peaks):
    """CUDA devices stood in on the CPU: the device context, the peak statistics and the wait are recorded, and
    each group attends on the CPU."""
    real_attend = multidevice._attend

    def attend(group, *args):
        events.append((group.device.index, "attend"))
        return real_attend(dataclasses.replace(group, device=torch.device("cpu")), *args)
    monkeypatch.setattr(multidevice, "_attend", attend)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: events.append((dev.index, "reset")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev: events.append((dev.index, "sync")))

    def max_memory_allocated(dev):
        events.append((dev.index, "peak"))
        return peaks[dev.index]
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)


def test_cuda_devices_measure_their_peak_when_it_is_logged(monkeypatch, caplog):
    """multidevice.py 91, 95, 96: on CUDA devices, when the split is logged, each device thread resets the peak
    statistics before attending, waits for the device after, and reads the peak, which the log line gives in MB;
    unlogged, nothing is measured. The result is exact."""
    events, peaks = [], {0: 5 * 2**20, 1: 7 * 2**20}
    _cuda_stand_ins(monkeypatch, events, peaks)
    q, k, v = _qkv()
    with caplog.at_level(logging.INFO, logger="attention_core.multidevice"):
        out = on_devices(q, k, v, devices=["cuda:0", "cuda:1"], log_level=logging.INFO)
    assert (out - math_sdpa(q, k, v)).abs().max() < 1e-12
    for dev in (0, 1):
        assert [e for d, e in events if d == dev] == ["reset", "attend", "sync", "peak"]
    assert caplog.records[0].getMessage() == (
        "attention on 2 devices, (1, 2, 24, 8): cuda:0: query heads 0-0 (1), 0.0 MB in, peak 5 MB; "
        "cuda:1: query heads 1-1 (1), 0.0 MB in, peak 7 MB")
    events.clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attention_core.multidevice"):
        out = on_devices(q, k, v, devices=["cuda:0", "cuda:1"], log_level=logging.INFO)
    assert (out - math_sdpa(q, k, v)).abs().max() < 1e-12
    assert sorted(events) == [(0, "attend"), (1, "attend")] and caplog.records == []


def test_a_traced_split_joins_the_groups_without_logging(tracing, caplog, monkeypatch):
    """multidevice.py 105, 139: while torch.compile traces, the groups attend in the calling thread (no worker
    threads, no logging, no device switch) with their share of a per-head mask and are joined on the query's device (with return_lse, the lse too), nothing logged."""
    q, k, v = _qkv(n=12)
    q, k, v = (torch.cat([t, t.flip(-2)], dim=-3) for t in (q, k, v))  # 4 heads
    mask = torch.randn(1, 4, 12, 12, dtype=torch.float64)
    threads, real = [], multidevice.scaled_dot_product_attention
    monkeypatch.setattr(multidevice, "scaled_dot_product_attention",
                        lambda *a, **kw: threads.append(threading.get_ident()) or real(*a, **kw))
    with caplog.at_level(logging.DEBUG, logger="attention_core.multidevice"):
        out = on_devices(q, k, v, mask, devices=["cpu", "cpu"])
        out2, lse = on_devices(q, k, v, mask, devices=["cpu", "cpu"], return_lse=True)
    assert caplog.records == [] and threads == [threading.get_ident()] * 4
    ref = math_sdpa(q, k, v, mask)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-12 and torch.equal(out2, out)
    scores = (q @ k.transpose(-1, -2)) / 8 ** 0.5 + mask
    assert lse.shape == (1, 4, 12) and (lse - torch.logsumexp(scores, dim=-1)).abs().max() < 1e-5


def test_a_traced_pass_through_that_raises_leaves_no_count(monkeypatch, torch_sdpa):
    """An error in the function a traced call is passed to (the trace stood in) must not leave the re-entry count
    raised: the next call would skip a function it should reach."""
    monkeypatch.setattr(patch_mod, "TRACED_STORES_SEEN", True)
    q = torch.randn(1, 2, 8, 4)
    attention_core.enable(min_tokens=10**6)
    failing = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("theirs failed"))  # noqa: E731
    patch_mod._state = patch_mod._state._replace(fallbacks=(failing,) + patch_mod._state.fallbacks[1:])
    with monkeypatch.context() as mp:
        mp.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)
        with pytest.raises(RuntimeError, match="theirs failed"):
            F.scaled_dot_product_attention(q, q, q)
    assert patch_mod._traced_passing == 0


def test_a_reference_to_ours_kept_past_disable_is_torchs_function(monkeypatch, torch_sdpa):
    """h = F.scaled_dot_product_attention while the patch is on, then disable(): h is still ours, over nothing;
    calling it is torch's own SDPA (before: IndexError on the empty list of functions ours was put over)."""
    q = torch.randn(1, 2, 8, 4)
    attention_core.enable()
    kept = F.scaled_dot_product_attention
    attention_core.disable()
    assert kept is not torch_sdpa and F.scaled_dot_product_attention is torch_sdpa
    assert torch.equal(kept(q, q, q, is_causal=True), torch_sdpa(q, q, q, is_causal=True))


def test_another_threads_compile_does_not_change_this_threads_route(monkeypatch, torch_sdpa):
    """torch 2.14's torch.compiler.is_compiling() is a process-wide flag: it answers True on every thread while any
    thread compiles. The patch asks is_dynamo_compiling() (True only in the code dynamo traces), so an eager call
    in deferred() on another thread stays deferred (torch's own, counted), and counts are kept, during a compile
    (stood in by is_compiling answering True)."""
    q = torch.randn(1, 2, 8, 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    patch_mod.reset_stats()
    with attention_core.patched(force=True):
        with patch_mod.deferred():
            out = F.scaled_dot_product_attention(q, q, q)
    assert patch_mod.stats()[patch_mod.SDPA_PATH]["deferred"] == 1
    assert torch.equal(out, torch_sdpa(q, q, q))


def test_a_pass_through_two_wrappers_deep_reaches_torchs_own(torch_sdpa):
    """Two other libraries' functions under ours, each calling F.scaled_dot_product_attention again (ours, on
    top): every pass goes one function further back, theirs2 -> theirs1 -> torch's own, with no loop and no
    index past the chain (the third call is at depth 2 of three fallbacks). Seed 24328's survivor."""
    calls = []

    def make(name):
        def theirs(*args, **kwargs):
            calls.append(name)
            return F.scaled_dot_product_attention(*args, **kwargs)  # ours again: it passes one further back
        return theirs
    theirs1, theirs2 = make("theirs1"), make("theirs2")
    q, k, v = _qkv()
    attention_core.enable(min_tokens=10**6)  # every call passed on
    patch_mod._state = patch_mod._state._replace(fallbacks=(torch_sdpa, theirs1, theirs2))
    out = F.scaled_dot_product_attention(q, k, v)
    assert calls == ["theirs2", "theirs1"] and torch.equal(out, torch_sdpa(q, k, v))
