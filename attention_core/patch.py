"""Optional global patch of torch.nn.functional.scaled_dot_product_attention, for code outside ComfyUI and for the
pack's process-wide mode inside it.

enable() routes SDPA calls on devices that need tiled attention (or every device with force=True) through the
engine; calls it cannot serve (nested tensors, non-float inputs), calls over fewer than `min_tokens` tokens and
devices with fused attention go to the original. disable() restores the original. Nothing happens at import.

The patch is on while enable() is in force or any patched() block (in any thread) is open: every block holds a
token, so blocks can nest and overlap across threads in any order and the last one out restores torch's function
(unless enable() holds it). The options in force are the latest still-open block's, else enable()'s; they are
replaced whole, so a call on another thread sees either the old options or the new ones, never a mix, and a call
already running finishes on the path it took. All state changes happen under one lock.

deferred() marks calls that another route already decided (the pack's per-model Patch Attention: its settings win
for its model): SDPA calls made on that thread inside the block go to torch's own function, uncounted as routed.
stats() counts, per code path, the calls seen while the patch was on: "routed" (to the engine), "passed" (left to
the original) and "deferred"; record() lets another route of the same mode (ComfyUI's global attention function,
nodes/comfy_global_route.py) count into it. Calls inside a torch.compile trace are not counted.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections import namedtuple

import torch
import torch.nn.functional as F

from .device.torch_version import parse as parse_version

SDPA_PATH = "torch_sdpa"  # stats() key of the calls this patch sees
OUTCOMES = ("routed", "passed", "deferred")
Config = namedtuple("Config", "force min_tokens options")  # the options in force, replaced whole

_lock = threading.RLock()
# the functions ours was put over, oldest first (torch's own, then any other library's function found there at a
# later install): a call that passes through goes to the latest; one that re-enters ours from inside that function
# (a wrapper another library put around ours, still holding it after ours was switched off) goes one further back,
# so that ours and their wrapper never call each other without end
_fallbacks: list = []
_installed = False  # our function is (or was last put) in F.scaled_dot_product_attention
_traced_passing = 0  # _local.passing's count inside a torch.compile trace
# whether dynamo reads back a module global stored earlier in the same trace (torch 2.5's does not: a pass-through
# into a foreign wrapper that holds ours would loop while tracing)
TRACED_STORES_SEEN = parse_version(torch.__version__) >= (2, 6)
_global = None  # Config from enable(), None when not enabled
_blocks: list = []  # [(token, Config)] of open patched() blocks, in entry order
_config = Config(False, 0, {})  # the Config in force; replaced whole, read without the lock
_local = threading.local()  # .deferred: depth of deferred() blocks; .passing: of our calls passing through
_stats: dict = {}  # path -> {outcome: calls}
_stats_lock = threading.Lock()


def is_enabled() -> bool:
    return _installed


def config():
    """The Config (force, min_tokens, engine options) in force while the patch is on, else None."""
    return _config if _installed else None


def _servable(q, k, v) -> bool:
    return all(isinstance(t, torch.Tensor) and not t.is_nested and t.is_floating_point() and t.dim() >= 2
               for t in (q, k, v))


def _wants_engine(device: torch.device, force: bool) -> bool:
    if force:
        return True
    from .device.detection import needs_tiled
    return needs_tiled(device)


def _is_causal_bias(attn_mask) -> bool:
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:  # older torch
        return False
    return isinstance(attn_mask, CausalBias)


def is_deferred() -> bool:
    """True inside a deferred() block on this thread."""
    return getattr(_local, "deferred", 0) > 0


@contextlib.contextmanager
def deferred():
    """with deferred(): ... - SDPA calls made by this thread inside the block are another route's to decide: the
    patch hands them to torch's own function (counted "deferred"). Nests; other threads are not affected."""
    _local.deferred = getattr(_local, "deferred", 0) + 1
    try:
        yield
    finally:
        _local.deferred -= 1


def record(path: str, outcome: str) -> None:
    """Count one call of `path` as `outcome` ("routed", "passed" or "deferred"); nothing inside a torch.compile
    trace (a Python counter read there would make dynamo guard on it)."""
    if torch.compiler.is_dynamo_compiling():
        return
    with _stats_lock:
        per = _stats.setdefault(path, dict.fromkeys(OUTCOMES, 0))
        per[outcome] += 1


def stats() -> dict:
    """{path: {"routed", "passed", "deferred", "total"}} of the calls counted since the last reset_stats()."""
    with _stats_lock:
        return {path: {**per, "total": sum(per.values())} for path, per in _stats.items()}


def reset_stats() -> None:
    with _stats_lock:
        _stats.clear()


def _long_enough(query, key, min_tokens: int) -> bool:
    return min_tokens <= 0 or max(query.shape[-2], key.shape[-2]) >= min_tokens


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                  **kwargs):
    if not kwargs and _is_causal_bias(attn_mask):
        # torch dispatches CausalBias masks (which hold no values) through __torch_function__ only when the
        # function called IS torch's own; patched, its handler would run them as plain tensors. Call the handler:
        # it raises with is_causal, turns upper-left (and square lower-right) into is_causal=True and
        # materialises lower-right, calling F.scaled_dot_product_attention (this function) again.
        from torch.nn.attention.bias import CausalBias
        return CausalBias._dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                    scale=scale, enable_gqa=enable_gqa)
    cfg = _config
    if _installed:
        if not torch.compiler.is_dynamo_compiling() and is_deferred():  # thread-local state is not traced
            outcome = "deferred"
        elif (not kwargs and _servable(query, key, value) and _long_enough(query, key, cfg.min_tokens)
              and _wants_engine(query.device, cfg.force)):
            outcome = "routed"
        else:
            outcome = "passed"
        record(SDPA_PATH, outcome)
    else:
        outcome = "passed"
    if outcome != "routed":
        return _pass_through(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                             scale=scale, enable_gqa=enable_gqa, **kwargs)
    from .sdpa import scaled_dot_product_attention
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                        **cfg.options)


def _pass_through(*args, **kwargs):
    """The function ours was put over (see _fallbacks), one further back for each of our calls already passing
    through on this thread; torch's own when ours is over nothing (a reference to it kept past disable())."""
    if not _fallbacks:
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)
    if torch.compiler.is_dynamo_compiling():  # thread-local state is not traced: a module global counts (dynamo
        global _traced_passing  # replays the stores as side effects; a trace runs on one thread)
        if not TRACED_STORES_SEEN:  # torch 2.5's dynamo does not read back the store: torch's own, never a loop
            return _fallbacks[0](*args, **kwargs)
        depth = _traced_passing
        original = _fallbacks[-1 - depth] if depth < len(_fallbacks) else _fallbacks[0]
        _traced_passing = depth + 1
        try:
            return original(*args, **kwargs)
        finally:  # an error must not leave the count raised
            _traced_passing = depth
    depth = getattr(_local, "passing", 0)
    original = _fallbacks[-1 - depth] if depth < len(_fallbacks) else _fallbacks[0]
    _local.passing = depth + 1
    try:
        return original(*args, **kwargs)
    finally:
        _local.passing = depth


def _refresh() -> None:
    """Install or remove the patch and set the options in force from enable()'s and the open blocks' (lock held)."""
    global _installed, _config
    if _blocks:
        _config = _blocks[-1][1]
    elif _global is not None:
        _config = _global
    else:
        _config = Config(False, 0, {})
    want = _global is not None or bool(_blocks)
    if want and not _installed:
        current = F.scaled_dot_product_attention
        if current is not _patched_sdpa:
            if not _fallbacks:  # torch's own: our function takes its name and signature (once: a later function
                functools.update_wrapper(_patched_sdpa, current, updated=())  # may hold ours, a __wrapped__ loop)
            _fallbacks.append(current)
            F.scaled_dot_product_attention = _patched_sdpa
        _installed = True
    elif not want and _installed:
        if F.scaled_dot_product_attention is _patched_sdpa:  # never undo someone else's later wrapper
            F.scaled_dot_product_attention = _fallbacks.pop()
        # else: ours stays inside their wrapper, passing every call on
        _installed = False


def _make_config(force, min_tokens, options) -> Config:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"attention_core patch: min_tokens must be a whole number >= 0, got {min_tokens!r}")
    return Config(bool(force), min_tokens, dict(options))


def enable(force: bool = False, min_tokens: int = 0, **options) -> None:
    """Patch torch's SDPA. force=True uses the engine on every device; calls whose longer sequence (query or key)
    has fewer than min_tokens tokens keep torch's function; options (tier, memory_budget, precision, ...) are
    passed to attention_core.scaled_dot_product_attention. Calling it again updates the options."""
    global _global
    cfg = _make_config(force, min_tokens, options)
    with _lock:
        _global = cfg
        _refresh()


def disable(close_blocks: bool = True) -> None:
    """Restore torch's own SDPA now (open patched() blocks are closed too; their exits then change nothing). With
    close_blocks=False only enable()'s hold is dropped: open patched() blocks (other code's, maybe on other threads)
    keep the patch on until they exit."""
    global _global
    with _lock:
        _global = None
        if close_blocks:
            _blocks.clear()
        _refresh()


@contextlib.contextmanager
def patched(force: bool = False, min_tokens: int = 0, **options):
    """with patched(): ... - the patch for the block, then the previous state back. Safe to nest and to overlap
    across threads; a block inside enable() leaves the global patch on when it exits."""
    token = object()
    cfg = _make_config(force, min_tokens, options)
    with _lock:
        _blocks.append((token, cfg))
        _refresh()
    try:
        yield
    finally:
        with _lock:
            _blocks[:] = [b for b in _blocks if b[0] is not token]
            _refresh()
