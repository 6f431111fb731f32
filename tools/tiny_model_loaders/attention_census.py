"""Test-only census of where attention runs inside a ComfyUI server, per prompt and per call site.

Counters, each {call site: {query length: calls}}:
  engine      calls the pack's engine computed (the `scaled_dot_product_attention` that nodes/comfy_adapter.py calls,
              and the one in the pack's attention_core.sdpa, which the process-wide SDPA patch calls);
  comfy       calls that reached ComfyUI's own attention functions (the functions behind every @wrap_attn wrapper in
              comfy.ldm.modules.attention: optimized_attention, optimized_attention_masked, attention_pytorch, ...),
              i.e. calls that bypassed the pack or that it passed through;
  torch_sdpa  direct torch.nn.functional.scaled_dot_product_attention calls (not the ones ComfyUI's functions make);
  engine_masked, comfy_masked   the calls of the first two that carried an attention mask;
  everywhere  the process-wide mode's own counts during the prompt (attention_core.patch.stats(): {code path:
              {"routed", "passed", "deferred", "total"}}), for the paths that saw calls.
A call site is "<Owner>.<attribute>" of the attention module that made the call (for example
"BasicAVTransformerBlock.audio_to_video_attn", "TransformerBlockGemma2.self_attn"), found from the caller's frames;
"file:line" when no module owns it. After each prompt the server log gets one line
    [attention-census] {"prompt_id": ..., "engine": {...}, "comfy": {...}, "torch_sdpa": {...}, ...}
(`parse_log` reads them back). Code that bound torch's SDPA to a local name before this module was imported is not
seen by the torch counter.

Enabled by env TILED_ATTENTION_TEST_CENSUS=1 (installed once, for the server's life). A prompt queued with
extra_data {"tiled_attention_test_break": "uniform"|"swapheads"} (or env TILED_ATTENTION_TEST_BREAK, for
every prompt) gets a wrong engine result on purpose (uniform attention, heads rotated by one), so that
tests can show they notice a broken engine.
"""
import json
import logging
import os
import sys
import threading
from collections import defaultdict

import torch

CENSUS_ENV = "TILED_ATTENTION_TEST_CENSUS"
BREAK_ENV = "TILED_ATTENTION_TEST_BREAK"
LOG_TAG = "[attention-census]"
BREAK_KEY = "tiled_attention_test_break"  # in a prompt's extra_data: break the engine for that prompt only
BREAKS = ("uniform", "swapheads")
_MARK = "_attention_census"

KINDS = ("engine", "comfy", "torch_sdpa", "engine_masked", "comfy_masked")
_counts = {kind: defaultdict(lambda: defaultdict(int)) for kind in KINDS}
_local = threading.local()
_state = {"breaking": None}  # the running prompt's break mode (ComfyUI runs one prompt at a time)
_SKIP_PARTS = (os.sep + "torch" + os.sep, os.path.join("comfy", "ldm", "modules", "attention.py"),
               os.sep + "attention_core" + os.sep, os.path.join("nodes", "comfy_adapter.py"),
               os.path.join("nodes", "comfy_global_route.py"), __file__)


def enabled():
    return os.environ.get(CENSUS_ENV, "") == "1"


def _owner_name(owner, module):
    for name, child in owner.named_children():
        if child is module:
            return name
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)):
            for sub, grand in child.named_children():
                if grand is module:
                    return f"{name}.{sub}"
    return None


def call_site():
    """ "<Owner>.<attribute>" of the attention module whose forward made this call, else "file:line"."""
    frame = sys._getframe(2)
    while frame is not None and any(p in frame.f_code.co_filename for p in _SKIP_PARTS):
        frame = frame.f_back
    if frame is None:
        return "unknown"
    module = frame.f_locals.get("self")
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
    if not isinstance(module, torch.nn.Module):
        return where
    outer = frame.f_back
    while outer is not None and (not isinstance(outer.f_locals.get("self"), torch.nn.Module)
                                 or outer.f_locals.get("self") is module):
        outer = outer.f_back
    name = _owner_name(outer.f_locals["self"], module) if outer is not None else None
    return f"{type(outer.f_locals['self']).__name__}.{name}" if name else f"{type(module).__name__} ({where})"


def _count(kind, q, seq_dim, masked=False):
    try:
        lq = int(q.shape[seq_dim])
    except Exception:  # noqa: BLE001 - a container or odd argument: still count the call
        lq = -1
    site = call_site()
    _counts[kind][site][lq] += 1
    if masked:
        _counts[kind + "_masked"][site][lq] += 1


def _inside():
    return getattr(_local, "depth", 0) > 0


class _Depth:
    def __enter__(self):
        _local.depth = getattr(_local, "depth", 0) + 1

    def __exit__(self, *exc):
        _local.depth -= 1


def _comfy_counter(func):
    def counted(*args, **kwargs):
        if not _inside():
            q = args[0] if args else kwargs.get("q")
            skip = kwargs.get("skip_reshape", args[6] if len(args) > 6 else False)
            mask = kwargs.get("mask", args[4] if len(args) > 4 else None)
            _count("comfy", q, -2 if skip else 1, masked=mask is not None)
        with _Depth():
            return func(*args, **kwargs)
    setattr(counted, _MARK, func)
    counted.__name__ = getattr(func, "__name__", "attention")
    return counted


def _torch_counter(func):
    def counted(*args, **kwargs):  # diffusers passes query=, key=, value= by keyword
        if not _inside():
            _count("torch_sdpa", args[0] if args else kwargs.get("query"), -2)
        with _Depth():
            return func(*args, **kwargs)
    setattr(counted, _MARK, func)
    return counted


def _broken(out, q, v, how):
    """The engine's result made wrong on purpose: every query averaging all values, or heads rotated by one."""
    if how == "uniform":
        return v.mean(dim=-2, keepdim=True).expand(*q.shape[:-1], v.shape[-1]).to(out.dtype).contiguous()
    if how == "swapheads" and out.ndim == 4 and out.shape[1] > 1:
        return out.roll(1, dims=1)
    return out


def _engine_counter(func):
    def counted(q, k, v, attn_mask=None, *args, **kwargs):
        _count("engine", q, -2, masked=attn_mask is not None)
        how = _state["breaking"] or os.environ.get(BREAK_ENV, "")
        with _Depth():
            out = func(q, k, v, attn_mask, *args, **kwargs)
        return _broken(out, q, v, how) if how else out
    setattr(counted, _MARK, func)
    return counted


def _wrap_comfy_functions():
    import comfy.ldm.modules.attention as attention
    for value in list(vars(attention).values()):
        code = getattr(value, "__code__", None)
        if code is None or "func" not in code.co_freevars or not hasattr(value, "__wrapped__"):
            continue
        cell = value.__closure__[code.co_freevars.index("func")]
        holder = cell.cell_contents
        if type(holder).__name__ == "GlobalAttentionRoute":  # the process-wide mode's route: count beneath it,
            if not hasattr(holder.inner, _MARK):               # so that only the calls it passes on count as comfy
                holder.inner = _comfy_counter(holder.inner)
        elif not hasattr(holder, _MARK):
            cell.cell_contents = _comfy_counter(holder)


def _wrap_engine():
    """The engine's entry in the pack's adapter (the nodes' routes, ComfyUI's global attention route) and in the
    pack's attention_core.sdpa (where the process-wide SDPA patch looks it up at each call)."""
    for name, mod in list(sys.modules.items()):
        names = getattr(mod, "__dict__", None)  # not getattr(mod, ...): some modules (torch.classes) resolve any name
        if not isinstance(names, dict):
            continue
        adapter = "run_engine" in names and "OVERRIDE_KEY" in names
        if not adapter and not (name.endswith(".attention_core.sdpa") and "tiled_attention" in names):
            continue
        fn = names.get("scaled_dot_product_attention")
        if fn is not None and _MARK not in getattr(fn, "__dict__", {}):
            mod.scaled_dot_product_attention = _engine_counter(fn)


def install():
    """Wrap the counters in (idempotent; the pack may be imported after this module)."""
    _wrap_comfy_functions()
    _wrap_engine()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if not hasattr(sdpa, _MARK):
        torch.nn.functional.scaled_dot_product_attention = _torch_counter(sdpa)


def _everywhere_stats():
    """attention_core.patch.stats() of the pack loaded in this process ({} before it is): the process-wide mode's
    calls per code path (routed / passed / deferred / total)."""
    for mod in list(sys.modules.values()):
        names = getattr(mod, "__dict__", None)
        if isinstance(names, dict) and "_patched_sdpa" in names and callable(names.get("stats")):
            return names["stats"]()
    return {}


def _delta(after, before):
    return {path: {k: n - before.get(path, {}).get(k, 0) for k, n in per.items()} for path, per in after.items()
            if per.get("total", 0) != before.get(path, {}).get("total", 0)}


def snapshot():
    out = {kind: {site: dict(per) for site, per in sites.items()} for kind, sites in _counts.items()}
    out["everywhere"] = _delta(_everywhere_stats(), _state.get("everywhere_start", {}))
    return out


def reset():
    for sites in _counts.values():
        sites.clear()
    _state["everywhere_start"] = _everywhere_stats()


def hook_prompts():
    """Reset the counts when a prompt starts and log them when it ends."""
    import execution
    real = execution.PromptExecutor.execute_async
    if hasattr(real, _MARK):
        return

    async def execute_async(self, prompt, prompt_id, extra_data={}, *args, **kwargs):
        install()
        reset()
        how = (extra_data or {}).get(BREAK_KEY)
        if how is not None and how not in BREAKS:
            raise ValueError(f"attention_census: extra_data[{BREAK_KEY!r}] must be one of {BREAKS}, got {how!r}")
        _state["breaking"] = how
        try:
            return await real(self, prompt, prompt_id, extra_data, *args, **kwargs)
        finally:
            _state["breaking"] = None
            logging.info("%s %s", LOG_TAG, json.dumps({"prompt_id": prompt_id, **snapshot()}))
    setattr(execute_async, _MARK, real)
    execution.PromptExecutor.execute_async = execute_async


def parse_log(text):
    """{prompt_id: {"engine": {site: {lq: n}}, "comfy": ..., "torch_sdpa": ...}} from a server log."""
    out, decoder = {}, json.JSONDecoder()
    for line in text.splitlines():
        rest = line.split(LOG_TAG, 1)[1].strip() if LOG_TAG in line else ""
        if rest.startswith("{"):
            entry = decoder.raw_decode(rest)[0]
            prompt_id = entry.pop("prompt_id")
            everywhere = entry.pop("everywhere", {})
            out[prompt_id] = {kind: {site: {int(lq): n for lq, n in per.items()}
                                     for site, per in sites.items()} for kind, sites in entry.items()}
            out[prompt_id]["everywhere"] = everywhere
    return out


def totals(census, kind):
    """{site: calls} summed over query lengths."""
    return {site: sum(per.values()) for site, per in census.get(kind, {}).items()}
