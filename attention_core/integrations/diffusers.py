"""One diffusers model's (or pipeline's) attention on the engine, and back: a switch scoped to that model alone.

    use_tiled(model_or_pipeline, **options)  every attention call of the model(s) runs in the engine from now on;
                                             options: the engine's tier, block_q, block_kv, memory_budget,
                                             precision, flush_to_zero (attention_core.scaled_dot_product_attention);
                                             returns {name: attention sites switched} ("" for a bare model)
    reset(model_or_pipeline)                 the model exactly as before: its own processor objects, its own forwards
    tiled(model_or_pipeline, **options)      with-block: use_tiled for the block, then the state before it back
    is_tiled(model), calls(model)            switched?; (all, compiled) engine calls counted for that model
    count_key(model)                         the attention_core.kernel.counts key those calls are counted under

Why not diffusers' own switch: diffusers (0.35 to 0.42) chooses attention per processor through
attention_dispatch's registry, whose backend names are a closed Enum (AttentionBackendName): a third-party backend
cannot be registered, and ModelMixin.set_attention_backend also sets the process-wide active backend, which every
other model whose processors name no backend then follows. So the switch is the model's own:
  * each attention module's processor (diffusers' Attention / AttentionModuleMixin classes: WanAttnProcessor,
    LTXVideoAttnProcessor, LTX2AudioVideoAttnProcessor, ZSingleStreamAttnProcessor, FluxAttnProcessor,
    AttnProcessor2_0, ...) is replaced, in that module only, by a copy of it whose class's __call__ is the same code
    run with two names bound to the engine: `dispatch_attention_fn` (diffusers' dispatcher; ours takes its
    arguments and its [batch, tokens, heads, dim] layout) and `F` (torch.nn.functional, whose
    scaled_dot_product_attention becomes the engine's);
  * a module whose own forward calls torch's SDPA (the Wan VAE's WanAttentionBlock) gets the same rebinding as an
    instance forward.
Nothing global changes: other models, other instances of the same classes, torch's function and diffusers'
registry stay as they are; the code that runs is diffusers' own, line for line, but the attention call.

Every routed call is counted by the engine where it runs (kernel/counts.py, inside torch.compile graphs too) under
count_key(model). A call routed here never reaches torch.nn.functional.scaled_dot_product_attention, so the
process-wide patch (attention_core.enable / patched) does not see it and never routes it a second time.
torch.compile of a switched model compiles the rebound code (the engine is a custom op); switching a model that is
already compiled needs a recompile (torch.compiler.reset() or a new torch.compile of the switched model).

A submodule object that is also part of another model (a processor that is a torch module, shared through
set_attn_processor(one_object)) is switched for both: it is one object; plain processor objects are copied per module.
Switch between calls, not while another thread runs the model (a call in flight may see some layers switched).

Refusals, at use_tiled, before anything changes (ValueError naming the module, the processor and what to use): an
attention whose code reaches torch's SDPA other than through those two names, a processor that computes attention
without SDPA (AttnProcessor's explicit matmuls: set model.set_attn_processor(AttnProcessor2_0()) first), a model
with context parallelism on (diffusers' parallel_config: use its "native" backend). At the first call
(NotImplementedError): a parallel_config or an attention_kwargs entry diffusers passes that the engine lacks.
"""
from __future__ import annotations

import contextlib
import copy
import dis
import types

import torch
import torch.nn.functional as F

from ..kernel import counts
from ..kernel.ops import TILE_OPTIONS, check_options

__all__ = ["use_tiled", "reset", "tiled", "is_tiled", "calls", "count_key"]

COUNT_PREFIX = "diffusers:"
SDPA = "scaled_dot_product_attention"
DISPATCH = "dispatch_attention_fn"
_ROUTE_ATTR = "_tiled_attention_route"  # set on a switched model: its Route


class Route:
    """One model's switch: its count key, the engine options, and what was replaced (to put it back)."""

    def __init__(self, key: str, options: dict):
        self.key = key
        self.options = dict(options)
        self.processors = []  # [(attention module, its own processor, the copy put in its place)]
        self.forwards = []  # [(module, the bound method put in its __dict__)]
        self.sdpa = _engine_sdpa(key, self.options)
        self.dispatch = _engine_dispatch(self.sdpa, key)
        self.functional = _functional_with(self.sdpa)
        self._functions = {}  # original function -> rebound copy
        self._classes = {}  # processor class -> its subclass with the rebound __call__

    def rebound(self, fn, names):
        """fn's code with its globals `names` bound to the engine (one copy per function per route)."""
        if fn not in self._functions:
            repl = {}
            for name in names:
                if name == DISPATCH:
                    repl[name] = self.dispatch
                elif name == SDPA:
                    repl[name] = self.sdpa
                else:  # a global holding torch.nn.functional
                    repl[name] = self.functional
            glob = dict(fn.__globals__)
            glob.update(repl)
            # no __name__: torch.compile (torch 2.5's dynamo) reads a function's globals through the module of that
            # name when there is one (the original module, without our names: wrong guards, a failed compile), and
            # through the dict itself when there is none
            glob.pop("__name__", None)
            new = types.FunctionType(fn.__code__, glob, fn.__name__, fn.__defaults__, fn.__closure__)
            new.__kwdefaults__ = copy.copy(fn.__kwdefaults__)
            new.__dict__.update(fn.__dict__)
            new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
            new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
            self._functions[fn] = new
        return self._functions[fn]

    def processor_class(self, cls, names):
        if cls not in self._classes:
            call = self.rebound(cls.__call__, names)
            self._classes[cls] = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__,
                                                             "_tiled_attention_original": cls})
        return self._classes[cls]


def _engine_sdpa(key: str, options: dict):
    """torch.nn.functional.scaled_dot_product_attention's signature, run by the engine, counted under `key`."""
    from ..sdpa import scaled_dot_product_attention as engine

    def scaled_dot_product_attention(query, key_, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                     scale=None, enable_gqa=False):  # torch's: scale and enable_gqa keyword-only
        return engine(query, key_, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                      count_as=counts.traced_key(key), **options)
    return scaled_dot_product_attention


def _engine_dispatch(sdpa, where: str):
    """diffusers' dispatch_attention_fn (attention_dispatch.py) with its native backend's semantics: q, k, v as
    [batch, tokens, heads, dim], a [batch, key tokens] mask taken as [batch, 1, 1, key tokens], the output in the
    same layout; run by the engine."""

    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if parallel_config is not None:
            raise NotImplementedError(
                f"tiled attention ({where}): this attention call has diffusers' context parallelism on "
                f"(parallel_config); the tiled switch runs attention on one device. Call "
                f"attention_core.integrations.diffusers.reset(model) and use diffusers' 'native' backend for "
                f"context parallelism.")
        extra = sorted(k for k, v in (attention_kwargs or {}).items() if v is not None and v is not False)
        if extra:
            raise NotImplementedError(
                f"tiled attention ({where}): diffusers passed attention_kwargs {extra}, which the engine does not "
                f"take; reset(model) and use diffusers' 'native' backend for this model.")
        if (attn_mask is not None and attn_mask.ndim == 2 and attn_mask.shape[0] == query.shape[0]
                and attn_mask.shape[1] == key.shape[1]):
            attn_mask = attn_mask[:, None, None, :]  # [batch, key tokens], as diffusers' native backend reads it
        out = sdpa(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p,
                   is_causal, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)
    return dispatch_attention_fn


def _functional_with(sdpa):
    """A module object holding torch.nn.functional's names, its scaled_dot_product_attention the engine's."""
    mod = types.ModuleType("attention_core.integrations.diffusers.functional",
                           "torch.nn.functional with the engine's scaled_dot_product_attention")
    for name, value in vars(F).items():
        if not name.startswith("__"):
            setattr(mod, name, value)
    mod.scaled_dot_product_attention = sdpa
    return mod


def _is_functional(value) -> bool:
    return value is F or (isinstance(value, types.ModuleType) and getattr(value, "__name__", "") == F.__name__)


def _codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def attention_names(fn):
    """(names, unreachable) of a function's attention calls: `names` the globals to bind to the engine
    (dispatch_attention_fn, a global holding torch.nn.functional, scaled_dot_product_attention itself), `unreachable`
    a description of an SDPA or dispatcher reached some other way (e.g. torch.nn.functional.X by its full path),
    "" when none. Nested functions (defined inside fn) are read too: they run with fn's globals."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return set(), ""
    glob = getattr(fn, "__globals__", {})
    names, unreachable = set(), ""
    for c in _codes(code):
        prev = None
        for ins in dis.get_instructions(c):
            if ins.opname == "EXTENDED_ARG":
                continue
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in (SDPA, DISPATCH):
                names.add(ins.argval)
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval in (SDPA, DISPATCH):
                if (ins.argval == SDPA and prev is not None and prev.opname in ("LOAD_GLOBAL", "LOAD_NAME")
                        and _is_functional(glob.get(prev.argval))):
                    names.add(prev.argval)
                elif not unreachable:
                    via = f"{prev.argval}." if prev is not None and isinstance(prev.argval, str) else ""
                    unreachable = f"calls {via}{ins.argval} (line {c.co_firstlineno} of {c.co_filename})"
            prev = ins
    return names, unreachable


def count_key(model) -> str:
    """The counts key (attention_core.kernel.counts) of the engine calls routed for `model`."""
    return f"{COUNT_PREFIX}{type(model).__name__}@{id(model):x}"


def calls(model) -> tuple:
    """(all, compiled): the engine calls counted for `model` since this process started (kernel/counts.py)."""
    return counts.calls(count_key(model))


def is_tiled(model) -> bool:
    return isinstance(getattr(model, "__dict__", {}).get(_ROUTE_ATTR), Route)


def _models(obj) -> dict:
    """{name: torch module}: a pipeline's torch-module components (DiffusionPipeline.components), or {"": obj}."""
    if isinstance(obj, torch.nn.Module):
        return {"": obj}
    components = getattr(obj, "components", None)
    if isinstance(components, dict):
        found = {name: m for name, m in components.items() if isinstance(m, torch.nn.Module)}
        if found:
            return found
    raise TypeError(f"tiled attention: use_tiled takes a diffusers model (a torch.nn.Module) or a pipeline with "
                    f"model components, got {type(obj).__name__}")


def _processor_of(module):
    proc = module._modules.get("processor") if isinstance(module, torch.nn.Module) else None
    return proc if proc is not None else module.__dict__.get("processor")


def _plan(model):
    """(processor sites [(path, module, processor, names)], forward sites [(path, module, names)], refusals)."""
    procs, forwards, refusals = [], [], []
    read = {}  # function -> attention_names(function): each class's code is read once

    def names_of(fn):
        if fn not in read:
            read[fn] = attention_names(fn)
        return read[fn]
    for path, module in model.named_modules():
        where = f"{type(model).__name__}.{path}" if path else type(model).__name__
        proc = _processor_of(module)
        # a processor that is a torch module computing in its forward is one of named_modules(): its forward is read
        # (and rebound) below, as any module's
        if proc is not None and type(proc).__call__ is not torch.nn.Module.__call__:
            cls = getattr(type(proc), "_tiled_attention_original", type(proc))
            if getattr(proc, "_parallel_config", None) is not None:
                refusals.append(f"{where}: context parallelism is on (parallel_config of {cls.__name__}); the "
                                f"tiled switch runs attention on one device: use diffusers' 'native' backend")
                continue
            names, unreachable = names_of(cls.__call__)
            if unreachable:
                refusals.append(f"{where}: processor {cls.__name__} {unreachable}, which the tiled switch cannot "
                                f"reach; use attention_core.patched() (process-wide) instead")
            elif not names:
                refusals.append(f"{where}: processor {cls.__name__} computes attention without torch's SDPA or "
                                f"diffusers' dispatcher; set model.set_attn_processor(AttnProcessor2_0()) (or the "
                                f"model's default SDPA processor) first")
            else:
                procs.append((where, module, proc, names))
        forward = type(module).forward
        names, unreachable = names_of(forward)
        if unreachable:
            refusals.append(f"{where}: {type(module).__name__}.forward {unreachable}, which the tiled switch cannot "
                            f"reach; use attention_core.patched() (process-wide) instead")
        elif names:
            forwards.append((where, module, names))
    return procs, forwards, refusals


def _refusal(model, refusals) -> ValueError:
    more = f" (and {len(refusals) - 5} more)" if len(refusals) > 5 else ""
    return ValueError(f"tiled attention cannot switch {type(model).__name__}: " + "; ".join(refusals[:5]) + more)


def _switch(model, options: dict) -> int:
    procs, forwards, refusals = _plan(model)
    if refusals:
        raise _refusal(model, refusals)
    if not procs and not forwards:
        return 0
    route = Route(count_key(model), options)
    for _, module, proc, names in procs:
        cls = getattr(type(proc), "_tiled_attention_original", type(proc))
        new = copy.copy(proc)  # the module's own copy: a processor object shared with another model stays as it is
        new.__class__ = route.processor_class(cls, names)
        setattr(module, "processor", new)
        route.processors.append((module, proc, new))
    for _, module, names in forwards:
        bound = types.MethodType(route.rebound(type(module).forward, names), module)
        module.__dict__["forward"] = bound
        route.forwards.append((module, bound))
    model.__dict__[_ROUTE_ATTR] = route
    return len(route.processors) + len(route.forwards)


def _unswitch(model) -> None:
    route = model.__dict__.pop(_ROUTE_ATTR, None)
    if not isinstance(route, Route):
        return
    for module, original, ours in reversed(route.processors):
        if _processor_of(module) is ours:  # a processor set since (set_attn_processor) stays
            setattr(module, "processor", original)
    for module, bound in reversed(route.forwards):
        if module.__dict__.get("forward") is bound:
            del module.__dict__["forward"]


def _check(options: dict) -> dict:
    unknown = sorted(set(options) - set(TILE_OPTIONS))
    if unknown:
        raise TypeError(f"tiled attention: use_tiled takes the engine options {list(TILE_OPTIONS)}, got {unknown}")
    check_options(**options)
    return options


def use_tiled(model_or_pipeline, **options) -> dict:
    """Put every attention call of the model (each model component of a pipeline) on the engine; see the module
    docstring. Returns {component name: attention sites switched} ("" names a bare model); a pipeline's
    components without attention the switch reaches (a text encoder of transformers: use its
    attn_implementation) are left as they are and listed with 0. Calling it again replaces the options."""
    _check(options)
    models = _models(model_or_pipeline)
    found = {}
    for name, model in models.items():  # every refusal before anything changes
        procs, forwards, refusals = _plan(model)
        if refusals:
            raise _refusal(model, refusals)
        found[name] = len(procs) + len(forwards)
    if not any(found.values()):
        raise ValueError(f"tiled attention: found no attention in {type(model_or_pipeline).__name__} that calls "
                         f"torch's SDPA or diffusers' dispatch_attention_fn: nothing to switch (a transformers "
                         f"model chooses its attention with attn_implementation)")
    for model in models.values():
        _unswitch(model)
        _switch(model, options)
    return found


def reset(model_or_pipeline) -> None:
    """Undo use_tiled: each attention module gets its own processor object back (unless another was set since),
    each rebound forward goes; a model never switched is left as it is."""
    for model in _models(model_or_pipeline).values():
        _unswitch(model)


@contextlib.contextmanager
def tiled(model_or_pipeline, **options):
    """with tiled(pipe): ... - use_tiled for the block, then each model as it was before it (switched with its
    earlier options, or native)."""
    before = {name: (m.__dict__[_ROUTE_ATTR].options if is_tiled(m) else None)
              for name, m in _models(model_or_pipeline).items()}
    done = use_tiled(model_or_pipeline, **options)
    try:
        yield done
    finally:
        for name, model in _models(model_or_pipeline).items():
            _unswitch(model)
            if before.get(name) is not None:
                _switch(model, before[name])
