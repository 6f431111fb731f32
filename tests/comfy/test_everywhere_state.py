"""One truth for Tiled Attention Everywhere (issue 30, items 10 and 12): what state(), describe(), the node's
output, the start line and Attention Info say is what is in force, read from the patch itself, and when other
code switched the pack's mode off or replaced its options through the copy of attention_core the pack uses (inside
ComfyUI: `<pack folder>.attention_core`), they say so and where that call came from. An invalid
TILED_ATTENTION_EVERYWHERE is reported bounded (a 100 KB value is not echoed whole) and without control
characters."""
import asyncio
import logging

import pytest
import torch.nn.functional as F

from comfy_harness import PACK_NAME

pytestmark = pytest.mark.comfy_inprocess
TORCH_SDPA = F.scaled_dot_product_attention


def mod(name):
    import importlib
    return importlib.import_module(f"{PACK_NAME}.{name}")


@pytest.fixture
def ew(pack, monkeypatch):
    everywhere, patch = mod("nodes.everywhere"), mod("attention_core.patch")
    monkeypatch.delenv("TILED_ATTENTION", raising=False)
    assert everywhere.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    yield everywhere
    everywhere.set_mode("off")
    patch.disable()
    assert F.scaled_dot_product_attention is TORCH_SDPA and not patch.is_enabled()
    assert mod("nodes.comfy_global_route").routed() == []


def node(pack, node_id):
    nodes = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
    return {n.GET_SCHEMA().node_id: n for n in nodes}[node_id]


def everywhere_lines(pack):
    """The Everywhere line of each place that reports it: describe(), the start line, Attention Info."""
    info = [line for line in node(pack, "TiledAttentionInfo").execute()[0].splitlines()
            if "Tiled Attention Everywhere" in line]
    return [mod("nodes.everywhere").describe(), mod("nodes.info").startup_line(), *info]


def test_disable_on_the_packs_copy_shows_as_off_everywhere_with_who_did_it(pack, ew):
    """The mode on (the node), then `<pack>.attention_core.disable()` from other code: state() is off with the
    switch that did it, describe(), the start line and Attention Info all say OFF and name disable() and this
    file; the node switching it on again is ON everywhere. Before: everything still said ON."""
    core = mod("attention_core")
    node(pack, "TiledAttentionEverywhere").execute("chunked", 0, None)
    assert all("Tiled Attention Everywhere: ON" in line for line in everywhere_lines(pack))
    core.disable()  # other code, behind the pack's back
    s = ew.state()
    assert s["on"] is False and s["mode"] == "off" and s["set"] == "chunked"
    assert s["switched_by"].startswith("disable() at comfy/test_everywhere_state.py:"), s["switched_by"]
    for line in everywhere_lines(pack):
        assert "Tiled Attention Everywhere: OFF, switched off by other code: set to chunked by the Tiled " \
               "Attention Everywhere node, then attention_core disable() at comfy/test_everywhere_state.py:" in line, \
            line
        assert "Everywhere: ON" not in line
    text = node(pack, "TiledAttentionEverywhere").execute("chunked", 0, None)[1]
    assert "Tiled Attention Everywhere: ON" in text and ew.state()["switched_by"] is None
    assert F.scaled_dot_product_attention is not TORCH_SDPA


def test_enable_with_other_options_on_the_packs_copy_is_named_and_left_alone(pack, ew):
    """Other code's enable() with its own options replaces the mode's: reported as off for the mode, naming
    enable() and the options now in force; switching the mode off then leaves the other code's patch on (it is
    not the pack's to undo); an open patched() block of other code is reported while the mode is on."""
    core, patch = mod("attention_core"), mod("attention_core.patch")
    ew.set_mode("off")
    assert not ew.state()["on"] and not ew.state()["options_from_block"]  # off: no block's options in force
    ew.set_mode("auto", 1024)
    assert not ew.state()["options_from_block"]
    with core.patched(force=True, tier="online"):
        s = ew.state()
        assert s["on"] and s["options_from_block"]
        assert "an attention_core.patched() block of other code is open" in ew.describe()
    core.enable(force=True, tier="inplace", min_tokens=7)
    line = ew.describe(stats=False)
    assert "OFF, switched off by other code: set to auto by the Tiled Attention Everywhere node, then " \
           "attention_core enable() at comfy/test_everywhere_state.py:" in line, line
    assert "put its own options in force for them (force=True, min_tokens=7, {'tier': 'inplace'})" in line, line
    ew.set_mode("off")
    assert patch.is_enabled() and patch.enabled_config().options == {"tier": "inplace"}
    assert "torch SDPA is routed by other code nonetheless (attention_core enable() at " \
           "comfy/test_everywhere_state.py:" in ew.describe(), ew.describe()  # the call and where it came from
    core.disable()
    assert ew.describe(stats=False).startswith("Tiled Attention Everywhere: off (process-wide mode")
    with core.patched(force=True):
        assert ew.describe(stats=False).endswith(
            "; torch SDPA is routed by an open attention_core.patched() block of other code nonetheless")


def test_a_report_never_sees_the_pack_half_switched(pack, ew):
    """At every line a switch of the mode runs (set_mode on, to another tier, off: the patch, the routes, the
    pack's setting, the log line), another thread reads state(): it either waits for the switch to finish (the
    switching thread holds the pack's lock: that reader is parked at the lock) or reads a state that is not
    half-switched. No reading may say "switched off by other code" (only the pack switches here). Before state()
    took the pack's lock, the readings taken between the patch's switch and the pack's setting did."""
    import linecache
    import sys
    import threading
    everywhere = mod("nodes.everywhere")
    files = {everywhere.__file__, mod("nodes.comfy_global_route").__file__, mod("attention_core.patch").__file__}
    readings, readers = [], []

    patch = mod("attention_core.patch")
    locks = {(everywhere.__file__, "with _lock:"): everywhere._lock}  # the patch's counts take no lock (lock-free)

    def parked(t):
        """Whether the reader waits at a `with <lock>:` whose lock this thread holds (it cannot pass it until this
        thread's switch is over)."""
        frame = sys._current_frames().get(t.ident)
        if frame is None:
            return False
        lock = locks.get((frame.f_code.co_filename, linecache.getline(frame.f_code.co_filename,
                                                                      frame.f_lineno).strip()))
        return lock is not None and lock._is_owned()

    def local(frame, event, arg):
        if event == "line":
            t = threading.Thread(target=lambda: readings.append(everywhere.state()), daemon=True)
            t.start()
            readers.append(t)
            for _ in range(300_000):  # a bound only a deadlock reaches
                if not t.is_alive() or parked(t):
                    break
                t.join(0.001)
            else:
                raise AssertionError("a reader neither finished nor waits for this thread's switch")
        return local
    for mode in ("chunked", "online", "off"):
        previous_trace = sys.gettrace()  # coverage.py's tracer under ./dev mutate: put back after
        sys.settrace(lambda frame, event, arg: local if frame.f_code.co_filename in files else None)
        try:
            everywhere.set_mode(mode, 0)
        finally:
            sys.settrace(previous_trace)
    for t in readers:
        t.join(300)
    assert not any(t.is_alive() for t in readers)
    assert len(readings) == len(readers) > 30, len(readings)
    assert [r for r in readings if r["switched_by"] is not None] == []
    assert all((r["mode"] != "off") == r["on"] for r in readings)


def test_routes_put_back_by_other_code_are_reported(pack, ew):
    """ComfyUI's attention functions un-routed by other code while the mode is on: the line says so."""
    ew.set_mode("online", 0)
    mod("nodes.comfy_global_route").unroute()
    assert "ComfyUI's attention functions are not routed now" in ew.describe()


def test_an_invalid_environment_value_is_echoed_bounded(pack, ew, monkeypatch, caplog):
    """A 100 KB TILED_ATTENTION_EVERYWHERE with control characters: one error line of a few hundred characters,
    no control character, still naming the variable, what it starts with, its length and the accepted values; the
    mode stays off. Before: the whole value was echoed (a 100 KB log line)."""
    value = "fast\x1b[31m\n" + "x" * 100_000
    monkeypatch.setattr(ew, "_env_applied", False)
    monkeypatch.setenv(ew.ENV, value)
    caplog.set_level(logging.INFO, logger="tiled_attention")
    asyncio.run(pack.comfy_entrypoint())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    msg = errors[0]
    assert len(msg) < 400, len(msg)
    assert all(c.isprintable() for c in msg), repr(msg)
    assert "TILED_ATTENTION_EVERYWHERE='fast?[31m?xxx" in msg and f"({len(value)} characters)" in msg, msg
    assert "0 (off), auto" in msg and "stays off" in msg
    assert ew.state()["mode"] == "off" and F.scaled_dot_product_attention is TORCH_SDPA
    with pytest.raises(ValueError) as e:
        ew.parse_env("on")
    assert "TILED_ATTENTION_EVERYWHERE='on' is not a mode" in str(e.value)
