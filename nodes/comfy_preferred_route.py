"""Per-layer attention chosen by a checkpoint (ComfyUI after 0.33.0) through the engine, in the process-wide mode.

Newer ComfyUIs (comfy/ldm/modules/attention.py, 0.38 and later) give some layers a `ComfyAttention` module whose
`function` the checkpoint picks when it loads (today comfy-kitchen's int8 attention, where the device has it), and
the layer passes it to optimized_attention as `preferred_attention=`. wrap_attn's order there: a per-model override
in transformer_options (Patch Attention) wins; else, when the layer's `preferred_attention.function` is not None,
the wrapper returns `function(*args, **kwargs)` and never calls the function it wraps, so the `func` cell that
nodes/comfy_global_route.py routes is skipped; else the wrapped function runs as before. The preferred function is
itself a wrap_attn wrapper and is often handed AttentionTensorContainer inputs (single-owner q, k, v): then it runs
its `container_function` (the int8 path quantises straight from the containers), again not its cell.

So route() puts a data descriptor `function` on ComfyAttention (the class, not its instances): a layer's own
function stays where ComfyUI stores it (the instance's __dict__, written through the descriptor as before), and
reading it gives a PreferredAttentionRoute around it while it is not None (None stays None: ComfyUI then calls the
wrapped function, which the cell route sees). unroute() removes the descriptor (or puts back what the class held),
so reads see each layer's own function again: nothing copied, nothing left. A ComfyUI without ComfyAttention
(0.33.0 and older) has nothing to route: route() returns False.

The route decides as the cell route does (attention_core.patch's Config read once per call, deferred calls of a
Patch Attention override passed on, min_tokens, the device probe in mode auto) on the inputs peeked, not taken:
a call it passes reaches the layer's function with its containers untouched; a call it takes consumes the
containers (their single-owner contract) and runs the engine. Counted under comfy_global_route.PATH, as ComfyUI's
other attention calls. route()/unroute() are called by nodes/everywhere.set_mode under its locks.
"""
from __future__ import annotations

import torch

from ..attention_core import patch
from .comfy_adapter import _seq_lens, bind_call, run_engine, wants_engine
from .comfy_global_route import PATH, settings_for

_saved: dict = {}  # {class: what its __dict__ held under "function" before route() (_MISSING: nothing)}
_MISSING = object()


def _tensor(x):
    """The tensor an input is (an AttentionTensorContainer: peeked, not taken)."""
    return x if torch.is_tensor(x) or not hasattr(x, "peek") else x.peek()


class PreferredAttentionRoute:
    """A layer's preferred attention function, called as wrap_attn calls it (*args, **kwargs): the engine while the
    process-wide mode is on and wants the call, else the function itself with the arguments untouched."""

    def __init__(self, inner):
        self.inner = inner
        self.__name__ = getattr(inner, "__name__", "preferred_attention")

    def __call__(self, *args, **kwargs):
        cfg = patch.config()  # once per call, as the cell route reads it
        if cfg is None:
            return self.inner(*args, **kwargs)
        if not torch.compiler.is_dynamo_compiling() and patch.is_deferred():
            patch.record(PATH, "deferred")
            return self.inner(*args, **kwargs)
        peeked = tuple(_tensor(a) for a in args[:3]) + tuple(args[3:])
        qkv = {name: _tensor(kwargs[name]) for name in ("q", "k", "v") if name in kwargs}
        try:
            call = bind_call(peeked, {**kwargs, **qkv})
        except TypeError:  # a call this route does not understand: the layer's function answers it
            call = None
        settings = settings_for(cfg)
        if call is None or not (torch.is_tensor(call["q"]) and call["q"].is_floating_point()) \
                or not wants_engine(settings, call["q"], *_seq_lens(call)):
            patch.record(PATH, "passed")
            return self.inner(*args, **kwargs)
        for x in list(args[:3]) + [kwargs[n] for n in ("q", "k", "v") if n in kwargs]:
            if not torch.is_tensor(x) and hasattr(x, "take"):
                x.take()  # consumed here, as the layer's function would have
        return run_engine(settings, call, kwargs)  # counted by the engine under settings.count_key


class _RoutedFunction:
    """The data descriptor put on ComfyAttention as `function` while routed (see the module doc)."""

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        fn = obj.__dict__.get("function")
        return None if fn is None else PreferredAttentionRoute(fn)

    def __set__(self, obj, value):
        obj.__dict__["function"] = value


def _attention_class(attention=None):
    if attention is None:
        try:
            from comfy.ldm.modules import attention
        except ImportError:
            return None
    return getattr(attention, "ComfyAttention", None)


def route(attention=None) -> bool:
    """Route the preferred attention of every ComfyAttention layer (idempotent); False where this ComfyUI has no
    ComfyAttention. `attention`: the comfy.ldm.modules.attention module (default: the imported one)."""
    cls = _attention_class(attention)
    if cls is None:
        return False
    if not isinstance(cls.__dict__.get("function"), _RoutedFunction):
        _saved[cls] = cls.__dict__.get("function", _MISSING)
        cls.function = _RoutedFunction()
    return True


def unroute(attention=None) -> bool:
    """Remove the route route() put on ComfyAttention; True when one was removed."""
    cls = _attention_class(attention)
    if cls is None or not isinstance(cls.__dict__.get("function"), _RoutedFunction):
        return False
    before = _saved.pop(cls, _MISSING)
    if before is _MISSING:
        del cls.function
    else:
        cls.function = before
    return True


def routed(attention=None) -> bool:
    cls = _attention_class(attention)
    return cls is not None and isinstance(cls.__dict__.get("function"), _RoutedFunction)
