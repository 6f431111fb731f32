"""ComfyUI's global attention functions through the engine, in the process-wide mode (nodes/everywhere.py).

Every attention function of `comfy.ldm.modules.attention` is a `wrap_attn` wrapper: a closure that looks for a
`transformer_options` override and otherwise calls the function it wraps, held in the closure's `func` cell and read
at each call. Models and packs hold the wrappers themselves: `optimized_attention` is read by attribute at call time
by some (LTX), bound by name at import by most (`from comfy.ldm.modules.attention import optimized_attention`: Wan,
Flux, HunyuanVideo, ..., and kijai's wrapper packs in their "comfy" attention mode), and handed out by
`optimized_attention_for_device` (text encoders, CPU devices). Swapping the module attribute would reach the first
kind only; swapping what the wrapper calls reaches every holder of the same object, with nothing of ComfyUI's
files edited. So route() puts a GlobalAttentionRoute in the `func` cell of the wrappers named in ATTRIBUTES (the
function ComfyUI chose at start and the exact backends the others hand out), and unroute() puts back exactly what
was there.

A call that carries a per-model override (Patch Attention) never reaches the cell: ComfyUI's wrapper hands it to the
override, which wins. The override's own pass-through calls reach the route inside attention_core.patch.deferred()
and go to ComfyUI's function untouched, so no call is routed twice and the node's settings win for its model.

Switching is safe while other threads call attention or compile: a route reads the patch's Config once per call (a
switch replaces it whole), route() and unroute() swap each cell in one store and run under
attention_core.patch.switching() (torch.compile's lock, then the patch's: they wait for a trace in progress), and a
call that already holds a route finishes on it. Re-entrant: code that interrupts a switch on the same thread (a
signal handler, a trace function) may switch again without waiting on itself (RLocks; each cell and the list of
routes change by single stores, appends and pops); the pack's set_mode() then puts the later request in force.
Engine calls are counted by the engine where they run (compiled
graphs too) under patch.count_key(PATH); passed and deferred calls in eager code (patch.record).
"""
from __future__ import annotations

import threading

import torch

from ..attention_core import patch
from .comfy_adapter import PatchSettings, _seq_lens, bind_call, run_engine, wants_engine

PATH = "comfy_attention"  # attention_core.patch.stats() key of the calls these routes see
# the wrappers whose function is routed: ComfyUI's start-up choice (optimized_attention, also used masked), and the
# backends optimized_attention_for_device returns (attention_basic / attention_pytorch for small inputs such as
# text encoders, attention_sub_quad for CPU devices) or --use-split-cross-attention picks. Fused or quantised
# backends (sage, flash, xformers) are routed only when ComfyUI chose one as optimized_attention.
ATTRIBUTES = ("optimized_attention", "optimized_attention_masked", "attention_basic", "attention_sub_quad",
              "attention_split", "attention_pytorch")
NODE = "Tiled Attention Everywhere"
_lock = threading.RLock()  # re-entrant: a signal handler or trace function that switches from inside a switch
_routes: list = []  # [(cell, route)] put in place by route(), in order


class GlobalAttentionRoute:
    """The function a wrap_attn wrapper calls, (q, k, v, heads, mask=None, ...) as ComfyUI passes it: the engine
    while the process-wide mode is on and wants the call, else `inner` (what the cell held)."""

    def __init__(self, inner, name: str):
        self.inner = inner
        self.name = name
        self.__name__ = getattr(inner, "__name__", name)  # ComfyUI and other packs log the function's name

    def __call__(self, *args, **kwargs):
        cfg = patch.config()  # once: the options in force for this call, whatever another thread switches meanwhile
        if cfg is None:
            return self.inner(*args, **kwargs)
        if not torch.compiler.is_dynamo_compiling() and patch.is_deferred():
            patch.record(PATH, "deferred")
            return self.inner(*args, **kwargs)
        try:
            call = bind_call(args, kwargs)
        except TypeError:  # a call this route does not understand: ComfyUI's function answers it as before
            call = None
        settings = settings_for(cfg)
        if call is None or not (torch.is_tensor(call["q"]) and call["q"].is_floating_point()) \
                or not wants_engine(settings, call["q"], *_seq_lens(call)):
            patch.record(PATH, "passed")
            return self.inner(*args, **kwargs)
        return run_engine(settings, call, kwargs)  # counted by the engine under settings.count_key


def settings_for(cfg) -> PatchSettings:
    """The Patch Attention settings that the process-wide mode's Config stands for; its engine calls count in
    patch.stats() as PATH's routed calls."""
    return PatchSettings(mode="auto" if not cfg.force else cfg.options.get("tier", "chunked"),
                         min_tokens=cfg.min_tokens, node=NODE, count_key=patch.COUNT_PREFIX + PATH)


def _wrap_attn_wrapper(fn, attention):
    """The wrap_attn wrapper `fn` is, or holds through __wrapped__ (another tool may have put its own wrapper in the
    module attribute), else None."""
    for _ in range(8):
        code = getattr(fn, "__code__", None)
        if code is not None and "func" in code.co_freevars and code.co_filename == attention.__file__:
            return fn
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def _wrappers():
    """[(attribute, wrapper, its `func` cell)] of the distinct wrap_attn wrappers ATTRIBUTES name in this ComfyUI."""
    from comfy.ldm.modules import attention
    found, seen = [], set()
    for name in ATTRIBUTES:
        fn = _wrap_attn_wrapper(getattr(attention, name, None), attention)
        if fn is None or id(fn) in seen:
            continue  # absent in this version, not a wrap_attn wrapper, or seen under another name
        seen.add(id(fn))
        code = fn.__code__
        found.append((name, fn, fn.__closure__[code.co_freevars.index("func")]))
    return found


def route() -> list:
    """Put a route in each wrapper's cell (idempotent). Returns the attribute names routed."""
    with patch.switching(), _lock:
        names = []
        for name, _, cell in _wrappers():
            current = cell.cell_contents
            if not isinstance(current, GlobalAttentionRoute):
                r = GlobalAttentionRoute(current, name)
                cell.cell_contents = r
                _routes.append((cell, r))
            names.append(name)
        return names


def unroute() -> int:
    """Give each wrapper back what its cell held before route() (what is inside our route now: the original, or a
    wrapper another tool put around it since). Returns the number of cells restored."""
    with patch.switching(), _lock:
        n = 0
        while True:
            try:
                cell, r = _routes.pop()  # one call: an unroute() interrupting this one may have emptied the list
            except IndexError:
                break
            if cell.cell_contents is r:
                cell.cell_contents = r.inner
                n += 1
            # else: another wrapper now holds our route; left there, it passes every call on while the mode is off
        return n


def routed() -> list:
    """The attribute names whose wrapper currently calls a route."""
    return [name for name, _, cell in _wrappers() if isinstance(cell.cell_contents, GlobalAttentionRoute)]
