"""Tiled Attention Everywhere called from code that interrupts it on the same thread (issue 38 item 1), inside a real
ComfyUI: a real signal handler (SIGUSR1 sent while the interrupted code is at a given line; SIGPROF from a
setitimer while a model samples) and a real sys.settrace function call describe(), state(), Attention Info's report,
attention_core.patch.stats() and set_mode() at every line of the switches and counts (nodes/everywhere.py,
nodes/comfy_global_route.py, attention_core/patch.py, attention_core/kernel/counts.py), during a switch and during
sampling. Nothing waits on its own thread (each run is under a SIGALRM deadline: a deadlock fails), and a set_mode()
made inside a set_mode() is the later request and wins: the mode, the patch and ComfyUI's routed functions agree.
Red before: comfy_global_route's and counts.py's locks were threading.Locks (describe() from a handler interrupting
a route or a count waited forever); a set_mode("auto") from a handler interrupting set_mode("off") left the patch
on and the mode off.
"""
import importlib
import logging
import signal

import pytest
import torch
import torch.nn.functional as F

from comfy_harness import PACK_NAME, load_tiny
from line_tracing import line_events
from reentry import Handler, deadline, patch_agrees, trace_calls

pytestmark = pytest.mark.comfy_inprocess
TORCH_SDPA = F.scaled_dot_product_attention
SECONDS = 300  # sampling
SWITCH_SECONDS = 60  # one switching run (under a second unless deadlocked)


def mod(name):
    return importlib.import_module(f"{PACK_NAME}.{name}")


@pytest.fixture
def ew(pack, monkeypatch, caplog):
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    monkeypatch.delenv("TILED_ATTENTION", raising=False)
    monkeypatch.delenv(everywhere.ENV, raising=False)
    monkeypatch.setattr(everywhere, "_env_applied", True)
    caplog.set_level(logging.WARNING, logger="tiled_attention")  # a log line per switch otherwise
    assert everywhere.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    yield everywhere
    everywhere.set_mode("off")
    patch.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.is_enabled()
    assert mod("nodes.comfy_global_route").routed() == []


def files():
    return {mod(m).__file__ for m in ("nodes.everywhere", "nodes.comfy_global_route", "attention_core.patch",
                                      "attention_core.kernel.counts")}


def mode_agrees(ew):
    """The mode asked for last, the patch and ComfyUI's routed functions agree; a reason when they do not."""
    patch, route = mod("attention_core.patch"), mod("nodes.comfy_global_route")
    wanted = getattr(ew, "_wanted", (ew._setting.mode,))[0]  # (before the fix: the setting)
    s = ew.state()
    if s["set"] != wanted:
        return f"set {s['set']}, asked for {wanted}"
    if wanted == "off":
        if s["on"] or route.routed() or patch.enabled_config() is not None:
            return f"off, but on={s['on']} routed={route.routed()} patch={patch.enabled_config()}"
    else:
        cfg = patch.enabled_config()
        if not s["on"] or not route.routed() or cfg is None or cfg != ew._setting.config:
            return f"{wanted}, but on={s['on']} routed={route.routed()} patch={cfg} setting={ew._setting}"
        if cfg.force != (wanted != "auto") or cfg.options.get("tier") != wanted:
            return f"{wanted}, but the patch's Config is {cfg}"
    return patch_agrees(patch, F, TORCH_SDPA)


def reader(ew):
    info = mod("nodes.info")

    def read():
        return ew.describe(), ew.state(), info.report_text(), mod("attention_core.patch").stats()
    return read


def switcher(ew, mode):
    def switch():
        return ew.set_mode(mode, 0)
    return switch


def switching(ew):
    """Switches of every kind: on (a tier), on (auto, passing every call), off."""
    ew.set_mode("chunked", 0)
    ew.set_mode("auto", 10 ** 6)
    ew.set_mode("off")
    return ew.state()


@pytest.mark.parametrize("how,inner", [("trace function", "read"), ("signal handler", "read"),
                                       ("trace function", "online"), ("signal handler", "off"),
                                       ("signal handler", "inplace")])
def test_reports_and_switches_from_inside_every_line_of_a_switch(pack, ew, how, inner):
    lines = line_events(lambda: switching(ew), files())[1]
    assert lines >= 100, lines
    fired = 0
    for at in range(lines):
        ew.set_mode("off")
        action = reader(ew) if inner == "read" else switcher(ew, inner)
        with deadline(SWITCH_SECONDS, f"a {how} ({inner}) at line event {at}"):
            if how == "trace function":
                results = []
                line_events(lambda: switching(ew), files(), at, lambda: results.append(action()))
            else:
                with Handler(action) as handler:
                    line_events(lambda: switching(ew), files(), at, handler.fire)
                assert not handler.errors, (at, handler.errors)
                results = handler.results
        if not results:  # not reached
            continue
        fired += 1
        assert len(results) == 1, (at, results)
        assert mode_agrees(ew) is None, (at, mode_agrees(ew))
        if inner == "read":
            assert "Tiled Attention Everywhere" in results[0][0] and "Tiled Attention Everywhere" in results[0][2]
    assert fired >= lines // 2, (fired, lines)


@pytest.fixture(scope="module")
def wan(tmp_path_factory, pack):
    from tools.fixtures.tiny_models import write_wan22_5b
    return load_tiny(tmp_path_factory, write_wan22_5b, "wan22_tiny.safetensors", "WAN22_T2V")


def sample(model):
    import nodes
    g = torch.Generator().manual_seed(1)
    latent, cond = torch.randn(1, 48, 3, 16, 16, generator=g), torch.randn(1, 12, 4096, generator=g)
    return nodes.KSampler().sample(model, 0, 1, 3.0, "euler", "simple", [[cond, {}]],
                                   [[torch.zeros_like(cond), {}]], {"samples": latent})[0]["samples"]


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_during_sampling_reports_and_switches_from_signals_and_a_trace_function(pack, ew, wan):
    """A Wan model samples with the mode on while (1) a trace function reads describe(), state(), Attention Info and
    the stats at every line of the routes and counts, and (2) a SIGPROF handler (setitimer, every 2 ms of CPU time)
    reads them and switches the mode between two tiers: the sampling finishes with ComfyUI's answer and the routes'
    counts, and the mode agrees with the last switch."""
    ref = sample(wan)
    ew.set_mode("chunked", 0)
    patch = mod("attention_core.patch")
    patch.reset_stats()
    read = reader(ew)
    calls = [0]

    def traced():
        calls[0] += 1
        read()
    with deadline(SECONDS, "sampling under a trace function"):
        out = trace_calls(lambda: sample(wan), files(), traced)
    assert rel(out, ref) < 1e-4 and calls[0] > 20, calls
    s = patch.stats()["comfy_attention"]
    assert s["routed"] == s["total"] > 0, s
    assert mode_agrees(ew) is None, mode_agrees(ew)

    tiers = iter(["online", "chunked"] * 100000)

    def interrupt():
        read()
        return ew.set_mode(next(tiers), 0)["mode"]
    with deadline(SECONDS, "sampling under SIGPROF"), Handler(interrupt, signal.SIGPROF) as handler:
        signal.setitimer(signal.ITIMER_PROF, 0.002, 0.002)
        try:
            out = sample(wan)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    assert not handler.errors, handler.errors
    assert rel(out, ref) < 1e-4 and handler.results, len(handler.results)
    assert mode_agrees(ew) is None and ew.state()["mode"] == handler.results[-1], mode_agrees(ew)
    print(f"\n{calls[0]} trace-function reads and {len(handler.results)} SIGPROF switches during sampling")
