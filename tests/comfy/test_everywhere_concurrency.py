"""Switching Tiled Attention Everywhere while other threads run attention or compile it, inside a real ComfyUI (issue
30, items 3 and 4), through every entry point that switches: nodes.everywhere.set_mode and apply_environment, the
Tiled Attention Everywhere node, nodes.comfy_global_route.route / unroute, and the pack's attention_core.enable /
disable. The calls: ComfyUI's global optimized_attention (held as models hold it: its wrap_attn wrapper, whose
cell the mode swaps) and torch SDPA (held as a wrapper pack's model code reaches it). A sys.settrace test switches
at every line of the routes (deterministic: every interleaving point of the code a call runs), threads call while
another switches, and a thread compiles (torch.compile) while another switches. Each call's answer must be ComfyUI's
/ torch's, whichever path it took. Threads are joined with a bound only a deadlock reaches."""
import asyncio
import itertools
import logging
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

from comfy_harness import PACK_NAME
from line_tracing import line_events

pytestmark = pytest.mark.comfy_inprocess
TORCH_SDPA = F.scaled_dot_product_attention
HUNG = 300
HEADS = 2


def mod(name):
    import importlib
    return importlib.import_module(f"{PACK_NAME}.{name}")


@pytest.fixture
def ew(pack, monkeypatch, caplog):
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    monkeypatch.delenv("TILED_ATTENTION", raising=False)
    monkeypatch.delenv(everywhere.ENV, raising=False)
    monkeypatch.setattr(everywhere, "_env_applied", True)  # restored after: the switches below reset it
    caplog.set_level(logging.WARNING, logger="tiled_attention")  # a log line per switch otherwise
    assert everywhere.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    yield everywhere
    everywhere.set_mode("off")
    patch.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.is_enabled()
    assert mod("nodes.comfy_global_route").routed() == []


def node(pack, node_id):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    return {n.GET_SCHEMA().node_id: n for n in nodes}[node_id]


_node_cache = {}


class ModeSwitcher:
    """Each call makes the next switch of a cycle through every entry point that switches."""

    def __init__(self, pack, ew, start=0):
        self.ew = ew
        everywhere_node = _node_cache.get("everywhere") or _node_cache.setdefault(
            "everywhere", node(pack, "TiledAttentionEverywhere"))
        route, core = mod("nodes.comfy_global_route"), mod("attention_core")
        kinds = [lambda: ew.set_mode("chunked", 0),
                 lambda: ew.set_mode("off"),
                 lambda: everywhere_node.execute("online", 0, None),
                 route.unroute,
                 lambda: ew.set_mode("auto", 10 ** 6),
                 route.route,
                 lambda: everywhere_node.execute("inplace", 0, None),
                 core.disable,
                 self.environment,
                 lambda: core.enable(force=True, tier="chunked"),
                 lambda: ew.set_mode("off")]
        self.kinds = kinds
        self.cycle = itertools.islice(itertools.cycle(kinds), start, None)
        self.made = 0

    def environment(self):
        self.ew._env_applied = False
        self.ew.apply_environment({self.ew.ENV: "online"})

    def __call__(self):
        next(self.cycle)()
        self.made += 1


def _inputs(seed=0, n=24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, HEADS * 8, generator=g) for _ in range(3)]


def _heads(t):
    return t.view(1, -1, HEADS, 8).transpose(1, 2)


@pytest.fixture
def calls(pack):
    """(comfy, sdpa, references): ComfyUI's optimized_attention wrapper and a call of F.scaled_dot_product_attention
    as model code makes it, on fixed inputs, with ComfyUI's and torch's answers."""
    import comfy.ldm.modules.attention as attention
    q, k, v = _inputs()
    wrapper = attention.optimized_attention

    def comfy():
        return wrapper(q, k, v, HEADS)

    def sdpa(fn=None):
        return (fn or F.scaled_dot_product_attention)(_heads(q), _heads(k), _heads(v))
    return comfy, sdpa, (comfy(), TORCH_SDPA(_heads(q), _heads(k), _heads(v)))


def _close(a, b):
    return (a - b).abs().max() < 1e-5




def test_one_switch_of_each_kind_at_each_line_of_the_routes(pack, ew, calls):
    """Exhaustive for one switch: from each starting state (the mode routing, passing every call on, off, with
    torch SDPA held while on), each kind of switch (every entry point) made at each line the routes run (nodes/comfy_global_route.py,
    nodes/comfy_adapter.py, attention_core/patch.py), for ComfyUI's optimized_attention and for torch SDPA: every
    call returns ComfyUI's / torch's answer and raises nothing."""
    comfy, sdpa, (ref_comfy, ref_sdpa) = calls
    files = {mod(m).__file__ for m in ("nodes.comfy_global_route", "nodes.comfy_adapter", "attention_core.patch")}
    # one of each effect: the mode off, on (the node), on passing every call (min_tokens), ComfyUI's functions
    # un-routed and routed, the patch disabled and replaced by other code, the environment applied
    kinds = (1, 2, 3, 4, 5, 7, 8, 9)
    starts = {"routing": lambda: None, "passing": lambda: ew.set_mode("online", 10 ** 6),
              "off": lambda: ew.set_mode("off")}
    runs = 0
    for start, then in starts.items():
        for which, ref in (("comfy", ref_comfy), ("sdpa", ref_sdpa)):
            def reset():
                mod("attention_core").disable()
                ew.set_mode("chunked", 0)
                held = F.scaled_dot_product_attention  # ours, as the model code holds it
                then()
                return (lambda: comfy()) if which == "comfy" else (lambda: sdpa(held))
            _, lines = line_events(reset(), files)
            assert lines >= (0 if (start, which) == ("off", "comfy") else 3), (start, which, lines)
            for at in range(lines):
                for kind in kinds:
                    out, _ = line_events(reset(), files, at, ModeSwitcher(pack, ew, kind))
                    assert _close(out, ref), (start, which, at, kind)
                    runs += 1
    print(f"\n{runs} calls, each with one switch")


def test_a_switch_at_every_line_of_the_routes_never_breaks_a_call(pack, ew, calls):
    """Every line the routes run (nodes/comfy_global_route.py, nodes/comfy_adapter.py, attention_core/patch.py) is
    interrupted by the next switch of the cycle, from every starting point: each call returns ComfyUI's / torch's
    answer and raises nothing. Before: IndexError in the SDPA patch's pass-through."""
    comfy, sdpa, (ref_comfy, ref_sdpa) = calls
    files = {mod(m).__file__ for m in ("nodes.comfy_global_route", "nodes.comfy_adapter", "attention_core.patch")}
    points = runs = 0
    for start in range(11):
        for which in ("comfy", "sdpa"):
            switch = ModeSwitcher(pack, ew, start)
            ew.set_mode("chunked", 0)
            held = F.scaled_dot_product_attention  # ours, held by the model code

            def local(frame, event, arg):
                if event == "line":
                    switch()
                return local
            previous_trace = sys.gettrace()  # coverage.py's tracer under ./dev mutate: put back after
            sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
            try:
                out = comfy() if which == "comfy" else sdpa(held)
            finally:
                sys.settrace(previous_trace)
            ew.set_mode("off")
            mod("attention_core").disable()
            assert _close(out, ref_comfy if which == "comfy" else ref_sdpa), (start, which)
            points += switch.made
            runs += 1
    assert points >= runs * 4, (points, runs)
    print(f"\n{runs} calls interrupted at {points} lines in all")


def _run_threads(targets):
    errors = []

    def guarded(fn):
        def body():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        return body
    threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HUNG)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    return errors


def _until(done, switch, made):
    def body():
        try:
            while not done.is_set():
                switch()
        finally:
            made.append(switch.made)
    return body


def test_threads_calling_attention_while_another_switches(pack, ew, calls):
    """Two threads make 150 calls each of ComfyUI's optimized_attention and of torch SDPA while a third switches
    through every entry point until they are done: every answer is ComfyUI's / torch's, nothing raises."""
    comfy, sdpa, (ref_comfy, ref_sdpa) = calls
    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    done, made = threading.Event(), []

    def caller():
        for _ in range(150):
            assert _close(comfy(), ref_comfy)
            assert _close(sdpa(), ref_sdpa)

    def callers():
        try:
            assert not _run_threads([caller, caller])
        finally:
            done.set()
    try:
        errors = _run_threads([callers, _until(done, ModeSwitcher(pack, ew), made)])
    finally:
        sys.setswitchinterval(was)
    assert not errors, errors
    assert made[0] > 0
    print(f"\n600 calls, {made[0]} switches meanwhile")


def test_compiles_while_another_thread_switches(pack, ew, calls):
    """12 fresh torch.compile runs (backend eager) of a function calling ComfyUI's optimized_attention and torch
    SDPA, on one thread, while another switches through every entry point until they are done: every compile
    succeeds with ComfyUI's and torch's answers (a switch waits for a trace in progress)."""
    import torch._dynamo
    comfy, sdpa, (ref_comfy, ref_sdpa) = calls
    done, made = threading.Event(), []

    def compiler():
        try:
            for _ in range(12):
                torch._dynamo.reset()
                a, b = torch.compile(lambda: (comfy(), sdpa()), backend="eager")()
                assert _close(a, ref_comfy) and _close(b, ref_sdpa)
        finally:
            done.set()
    try:
        errors = _run_threads([compiler, _until(done, ModeSwitcher(pack, ew), made)])
    finally:
        torch._dynamo.reset()
    assert not errors, errors
    assert made[0] > 0
    print(f"\n12 compiles, {made[0]} switches meanwhile")
