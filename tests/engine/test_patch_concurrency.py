"""Switching the global patch (enable / disable / patched() blocks) while other threads call SDPA or compile.

The patch's state is one immutable State read once per call, and every switch first takes torch.compile's compile
lock (attention_core/patch.py). Here: a sys.settrace test that switches at every line the router runs (each
interleaving point, deterministically), threads calling SDPA while another switches, a switch that must wait for a
torch.compile trace in progress, compiles on one thread while another switches, and the cases that could deadlock.
Each thread is joined with a generous bound that only a deadlock reaches (no result depends on timing)."""
import contextlib
import itertools
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import attention_core
import attention_core.patch as patch_mod
from line_tracing import line_events

TORCH_SDPA = F.scaled_dot_product_attention
HUNG = 300  # seconds: a thread still running after this is deadlocked (never reached when the code works)


@pytest.fixture(autouse=True)
def _restore():
    yield
    attention_core.disable()
    F.scaled_dot_product_attention = TORCH_SDPA
    assert not attention_core.is_enabled()


@pytest.fixture
def fine_switching():
    """The interpreter switches threads every 10 us instead of every 5 ms: many more interleavings per run."""
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(was)


def _qkv(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 4, generator=g) for _ in range(3)]


class Switcher:
    """Each next() makes the next switch of a cycle through every kind of switch: enable (passing every call on, or
    routing them to the engine with some tier), disable (closing blocks or not), a patched() block entered or
    exited."""

    def __init__(self, start=0):
        self.blocks = []
        kinds = [lambda: attention_core.enable(min_tokens=10 ** 6),
                 self.enter_block,
                 attention_core.disable,
                 lambda: attention_core.enable(force=True, tier="online"),
                 self.enter_block,
                 self.exit_block,
                 lambda: patch_mod.disable(close_blocks=False),
                 lambda: attention_core.enable(force=True, tier="chunked", min_tokens=4),
                 self.exit_block]
        self.kinds = kinds
        self.cycle = itertools.islice(itertools.cycle(kinds), start, None)
        self.made = 0

    def enter_block(self):
        block = attention_core.patched(force=True, tier="inplace")
        block.__enter__()
        self.blocks.append(block)

    def exit_block(self):
        if self.blocks:
            self.blocks.pop().__exit__(None, None, None)

    def __call__(self):
        next(self.cycle)()
        self.made += 1

    def close(self):
        while self.blocks:
            self.exit_block()


@contextlib.contextmanager
def switching_at_every_line(switch, files):
    """sys.settrace on this thread: `switch()` runs at every line event in a frame of one of `files` (the switch
    itself is not traced: Python turns tracing off inside a trace function)."""
    def local(frame, event, arg):
        if event == "line":
            switch()
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None
    previous_trace = sys.gettrace()  # coverage.py's tracer under ./dev mutate: put back after
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous_trace)


@pytest.mark.parametrize("start_on", ["passing", "routing", "block"])
def test_a_switch_at_every_line_of_the_router_never_breaks_a_call(start_on):
    """The router (attention_core/patch.py: _patched_sdpa, _pass_through, record, ...) is interrupted at each of
    its lines by a switch of every kind in turn, from every starting point of the cycle: each call still returns
    torch's answer (routed or passed on, whatever it read first) and raises nothing. Before: IndexError (the
    pass-through checked the list of functions ours was put over, a switch emptied it, then it read [0])."""
    q, k, v = _qkv()
    want = TORCH_SDPA(q, k, v)
    runs = points = 0
    for start in range(9):
        for call in range(3):
            switch = Switcher(start + call)
            with contextlib.ExitStack() as stack:
                if start_on == "passing":
                    attention_core.enable(min_tokens=10 ** 6)
                elif start_on == "routing":
                    attention_core.enable(force=True, tier="online")
                else:
                    stack.enter_context(attention_core.patched(force=True, tier="chunked"))
                sdpa = F.scaled_dot_product_attention  # ours, as a caller holds it
                assert sdpa is not TORCH_SDPA
                try:
                    with switching_at_every_line(switch, {patch_mod.__file__}):
                        out = sdpa(q, k, v)
                finally:
                    switch.close()
                    attention_core.disable()
            assert torch.allclose(out, want, atol=1e-5), (start_on, start, call)
            runs += 1
            points += switch.made
    assert F.scaled_dot_product_attention is TORCH_SDPA
    assert points >= runs * 4, (points, runs)  # every call was interrupted at several lines
    print(f"\n{runs} calls interrupted at {points} lines in all ({start_on})")


def _line_events(fn, at=None, switch=None):
    """fn() with the line events of attention_core/patch.py counted, switch() at the one numbered `at`."""
    return line_events(fn, {patch_mod.__file__}, at, switch)


@pytest.mark.parametrize("start_on", ["passing", "routing", "block", "deferred"])
def test_one_switch_of_each_kind_at_each_line_of_the_router(start_on):
    """Exhaustive for one switch: each kind of switch made at each line the router runs, from each starting state:
    every call is torch's answer, nothing raises (before: IndexError when a disable() came between the
    pass-through's check of the functions ours was put over and its read of them)."""
    q, k, v = _qkv(7)
    want = TORCH_SDPA(q, k, v)
    kinds = len(Switcher().kinds)
    runs = 0

    def reset():
        attention_core.disable()
        if start_on == "routing":
            attention_core.enable(force=True, tier="online")
        else:
            attention_core.enable(min_tokens=10 ** 6)
        sdpa = F.scaled_dot_product_attention
        if start_on == "block":
            return lambda: _in_block(sdpa)
        if start_on == "deferred":
            return lambda: _deferred(sdpa)
        return lambda: sdpa(q, k, v)

    def _in_block(sdpa):
        with attention_core.patched(force=True, tier="chunked"):
            return sdpa(q, k, v)

    def _deferred(sdpa):
        with patch_mod.deferred():
            return sdpa(q, k, v)
    _, lines = _line_events(reset())
    assert lines >= 5, lines
    for at in range(lines):
        for kind in range(kinds):
            switch = Switcher(kind)
            try:
                out, _ = _line_events(reset(), at, switch)
            finally:
                switch.close()
            assert torch.allclose(out, want, atol=1e-5), (start_on, at, kind)
            runs += 1
    attention_core.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA
    print(f"\n{runs} calls, each with one switch ({start_on})")


def test_a_switch_at_every_line_under_a_foreign_wrapper_never_loops_or_breaks():
    """Another library's function over ours (holding ours) while ours is switched on, off and on at every line the
    router runs: each call is torch's answer, no error, no endless loop between the two."""
    q, k, v = _qkv(1)
    want = TORCH_SDPA(q, k, v)
    attention_core.enable(min_tokens=10 ** 6)
    ours = F.scaled_dot_product_attention

    def theirs(*a, **kw):
        return ours(*a, **kw)
    F.scaled_dot_product_attention = theirs
    points = 0
    try:
        for start in range(9):
            switch = Switcher(start)
            attention_core.enable(min_tokens=10 ** 6)  # ours over theirs: ours -> theirs -> ours -> torch
            top = F.scaled_dot_product_attention
            try:
                with switching_at_every_line(switch, {patch_mod.__file__}):
                    out = top(q, k, v)
            finally:
                switch.close()
                attention_core.disable()
            assert torch.allclose(out, want, atol=1e-5), start
            points += switch.made
    finally:
        F.scaled_dot_product_attention = TORCH_SDPA
    assert points >= 9 * 4


def _run_threads(targets):
    """Start a thread per target, join them (a deadlock shows as a thread still alive); returns the errors."""
    errors = []

    def guarded(fn):
        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)
        return body
    threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HUNG)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    return errors


def test_threads_calling_sdpa_while_another_switches(fine_switching):
    """Three threads make 300 SDPA calls each (holding ours, as model code does) while a fourth switches through
    every kind of switch until they are done: every answer is torch's, nothing raises, and torch's function is
    back after."""
    q, k, v = _qkv(2)
    want = TORCH_SDPA(q, k, v)
    attention_core.enable(min_tokens=10 ** 6)
    sdpa = F.scaled_dot_product_attention
    done = threading.Event()
    made = []

    def caller():
        for _ in range(300):
            assert torch.allclose(sdpa(q, k, v), want, atol=1e-5)

    def callers_then_done():
        try:
            assert not _run_threads([caller] * 3)
        finally:
            done.set()

    def switcher():
        switch = Switcher()
        try:
            while not done.is_set():
                switch()
        finally:
            switch.close()
            made.append(switch.made)
    errors = _run_threads([callers_then_done, switcher])
    assert not errors, errors
    attention_core.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and made[0] > 0
    print(f"\n900 calls, {made[0]} switches meanwhile")


# --- torch.compile ---------------------------------------------------------------------------------------------------

def _blocked_in_switching(thread) -> bool:
    """Whether `thread` is waiting inside patch.switching() (for the compile lock)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is patch_mod.switching.__wrapped__.__code__:
            return True
        frame = frame.f_back
    return False


def test_a_switch_waits_for_a_trace_in_progress_and_the_next_call_recompiles():
    """While torch.compile compiles a function that calls SDPA (its backend running, the trace done, the guards
    not yet checked), another thread's enable() waits until the compile is over instead of changing what the trace
    read (before: it did not wait, and the compile failed with "Guard failed on the same frame it was created");
    the compiled call gives torch's answer, and the next call, the patch now on, recompiles into the engine."""
    import torch._dynamo
    q, k, v = _qkv(3)
    want = TORCH_SDPA(q, k, v)
    in_backend, switched, order = threading.Event(), threading.Event(), []
    holder = {}

    def backend(gm, example_inputs):
        if not in_backend.is_set():
            in_backend.set()
            # until the switch is either done (it did not wait) or waiting for the compile lock (it waits)
            while not switched.is_set() and not _blocked_in_switching(holder["switcher"]):
                switched.wait(0.001)
            order.append("compiled")
        return gm.forward

    def switcher():
        assert in_backend.wait(HUNG)
        attention_core.enable(force=True, tier="online")
        order.append("switched")
        switched.set()

    torch._dynamo.reset()
    patch_mod.reset_stats()
    try:
        f = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c) * 2, backend=backend)
        outs = []
        holder["switcher"] = threading.Thread(target=switcher, daemon=True)
        holder["switcher"].start()
        errors = _run_threads([lambda: outs.append(f(q, k, v))])
        holder["switcher"].join(HUNG)
        assert not errors, errors
        assert order == ["compiled", "switched"], order
        assert torch.allclose(outs[0], 2 * want, atol=1e-5)
        assert torch.allclose(f(q, k, v), 2 * want, atol=1e-5)  # recompiled: the engine in the graph
        assert patch_mod.stats()[patch_mod.SDPA_PATH]["compiled"] == 1
    finally:
        torch._dynamo.reset()


def test_compiles_on_one_thread_while_another_switches(fine_switching):
    """25 fresh torch.compile runs (backend eager) of a function calling SDPA on one thread while another thread
    switches through every kind of switch until they are done: every compile succeeds with torch's answer
    (before: AssertionError "Guard failed on the same frame it was created" on torch 2.14, "Guard check failed"
    on 2.5.1, within the first few)."""
    import torch._dynamo
    q, k, v = _qkv(4)
    want = TORCH_SDPA(q, k, v)
    done = threading.Event()
    made = []

    def compiler():
        try:
            for _ in range(25):
                torch._dynamo.reset()
                f = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c) * 2, backend="eager")
                assert torch.allclose(f(q, k, v), 2 * want, atol=1e-5)
        finally:
            done.set()

    def switcher():
        switch = Switcher()
        try:
            while not done.is_set():
                switch()
        finally:
            switch.close()
            made.append(switch.made)
    try:
        errors = _run_threads([compiler, switcher])
    finally:
        torch._dynamo.reset()
    assert not errors, errors
    assert made[0] > 0
    print(f"\n25 compiles, {made[0]} switches meanwhile")


def _compiled_and_switching(q, k, v):
    """A compiled function that switches the patch itself (dynamo breaks the graph at each switch and runs it
    eagerly): enable, a call, disable, a patched() block around a call."""
    def fn(a, b, c):
        attention_core.enable(force=True, tier="online")
        y = F.scaled_dot_product_attention(a, b, c)
        attention_core.disable()
        with attention_core.patched(force=True):
            z = F.scaled_dot_product_attention(a, b, c)
        return y + z
    return torch.compile(fn, backend="eager")(q, k, v)


def test_switches_that_could_deadlock_do_not():
    """The switch lock is taken in one order only (compile lock, then the patch's), and both are reentrant: a
    switch from code that torch.compile compiles (graph breaks), a switch from inside a compile on the same thread
    (a backend that switches, holding the compile lock), and a thread that switches and compiles while another
    does the same all finish, with torch's answers."""
    import torch._dynamo
    q, k, v = _qkv(5)
    want = TORCH_SDPA(q, k, v)
    torch._dynamo.reset()

    def inside_compiled_code(alone=False):
        for _ in range(3):
            assert torch.allclose(_compiled_and_switching(q, k, v), 2 * want, atol=1e-5)
        assert not (alone and attention_core.is_enabled())  # other threads' blocks may be open otherwise

    def backend(gm, example_inputs):
        attention_core.enable(force=True, tier="chunked")  # this thread holds the compile lock here
        attention_core.disable()
        return gm.forward

    def inside_a_backend():
        f = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c) + 1, backend=backend)
        for _ in range(2):
            assert torch.allclose(f(q, k, v), want + 1, atol=1e-5)

    def switch_and_compile():
        for i in range(4):
            with attention_core.patched(force=True, tier="online"):
                f = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c) - i, backend="eager")
                assert torch.allclose(f(q, k, v), want - i, atol=1e-5)
    try:
        assert not _run_threads([lambda: inside_compiled_code(alone=True)])
        assert not _run_threads([inside_a_backend])
        errors = _run_threads([switch_and_compile, switch_and_compile, inside_compiled_code])
    finally:
        torch._dynamo.reset()
    assert not errors, errors
    assert F.scaled_dot_product_attention is TORCH_SDPA


def test_a_torch_without_a_compile_lock_still_switches(monkeypatch):
    """A torch whose dynamo has no compile_lock (or no dynamo): switching takes the patch's lock alone."""
    from torch._dynamo import convert_frame
    monkeypatch.delattr(convert_frame, "compile_lock")
    assert isinstance(patch_mod._compile_lock(), contextlib.nullcontext)
    q, k, v = _qkv(6)
    attention_core.enable(force=True, tier="online")
    with attention_core.patched(force=True, tier="chunked"):
        out = F.scaled_dot_product_attention(q, k, v)
    attention_core.disable()
    assert torch.allclose(out, TORCH_SDPA(q, k, v), atol=1e-5) and F.scaled_dot_product_attention is TORCH_SDPA
    monkeypatch.setitem(sys.modules, "torch._dynamo", None)  # a torch built without dynamo
    assert isinstance(patch_mod._compile_lock(), contextlib.nullcontext)
