"""Optional global patch of torch.nn.functional.scaled_dot_product_attention, for code outside ComfyUI and for the
pack's process-wide mode inside it.

enable() routes SDPA calls on devices that need tiled attention (or every device with force=True) through the
engine; calls it cannot serve (nested tensors, non-float inputs), calls over fewer than `min_tokens` tokens and
devices with fused attention go to the original. disable() restores the original. Nothing happens at import.

The patch is on while enable() is in force or any patched() block (in any thread) is open: every block holds a
token, so blocks can nest and overlap across threads in any order and the last one out restores torch's function
(unless enable() holds it). The options in force are the latest still-open block's, else enable()'s.

Switching is safe while other threads call SDPA or compile: the patch's state (installed?, the Config in force, the
functions ours was put over) is one immutable State, replaced whole under the lock; each call reads it once, so it
never sees a mix, and a call already running finishes on the path it took. Every switch (enable, disable, a block's
entry and exit, and the pack's switches through switching()) first takes torch.compile's compile lock (dynamo holds
it for a whole trace and its guard check), then this module's lock: a switch waits for a trace in progress instead
of changing what it reads mid-trace (which failed the compile), and the guards on the state make the next call
recompile. Always in that order, so nothing deadlocks.

Re-entrant: every lock the patch takes is an RLock and its counters are lock-free, so code that interrupts this
thread inside a switch or a count (a signal handler, a sys.settrace function: a debugger, a coverage tool) may call
stats(), config(), enable(), disable() or open a patched() block without waiting on itself. A switch made from
inside a switch on the same thread changes what is asked for (enable()'s Config, the open blocks) at once and is put
in force by the interrupted switch before it returns (_refresh() runs again until nothing changed under it): the
later request wins, and the state (installed?, the Config, torch's function) is never left half-switched.

deferred() marks calls that another route already decided (the pack's per-model Patch Attention: its settings win
for its model): SDPA calls made on that thread inside the block go to torch's own function, uncounted as routed.
stats() counts, per code path, the calls seen while the patch was on: "routed" (to the engine), "passed" (left to
the original) and "deferred"; record() lets another route of the same mode (ComfyUI's global attention function,
nodes/comfy_global_route.py) count its passed and deferred calls into it, and count_key() names its engine calls.
Routed calls are counted by the engine's op where it runs (kernel/counts.py), so they are counted inside
torch.compile graphs too ("compiled": how many of them ran there); passed and deferred calls are counted in eager
code only (inside a graph a Python counter would be a guard), so the ones a compiled graph passes on are not seen.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
import threading
from collections import namedtuple

import torch
import torch.nn.functional as F

from .device.torch_version import parse as parse_version
from .kernel import counts

SDPA_PATH = "torch_sdpa"  # stats() key of the calls this patch sees
OUTCOMES = ("routed", "passed", "deferred")
COUNT_PREFIX = "patch:"  # the engine count keys (kernel/counts.py) of the paths stats() reports
Config = namedtuple("Config", "force min_tokens options")  # the options in force, replaced whole
# what a call reads, once: whether our function is (or was last put) in F.scaled_dot_product_attention, the Config
# in force, and the functions ours was put over, oldest first (torch's own, then any other library's function found
# there at a later install): a call that passes through goes to the latest; one that re-enters ours from inside that
# function (a wrapper another library put around ours, still holding it after ours was switched off) goes one further
# back, so that ours and their wrapper never call each other without end
State = namedtuple("State", "installed config fallbacks")
OFF = Config(False, 0, {})

_lock = threading.RLock()
_state = State(False, OFF, ())  # replaced whole under _lock, read without it
_refreshing = False  # a _refresh() is running (on the thread holding _lock)
_dirty = False  # what is asked for changed since the running _refresh() read it
_traced_passing = 0  # _local.passing's count inside a torch.compile trace
# whether dynamo reads back a module global stored earlier in the same trace (torch 2.5's does not: a pass-through
# into a foreign wrapper that holds ours would loop while tracing)
TRACED_STORES_SEEN = parse_version(torch.__version__) >= (2, 6)
_global = None  # Config from enable(), None when not enabled
_blocks: list = []  # [(token, Config)] of open patched() blocks, in entry order
_last_switch = None  # (what, by): the latest enable() / disable() and where it was called from
_local = threading.local()  # .deferred: depth of deferred() blocks; .passing: of our calls passing through
_stats: dict = {}  # (path, outcome) -> itertools.count of the passed and deferred calls (lock-free: counts.py)


def _compile_lock():
    """torch.compile's compile lock (torch._dynamo.convert_frame.compile_lock, an RLock that dynamo holds while it
    traces a frame and checks the new guards: torch 2.5 to 2.14 have it), or a null context on a torch without."""
    try:
        from torch._dynamo import convert_frame
    except ImportError:  # a torch built without dynamo
        return contextlib.nullcontext()
    lock = getattr(convert_frame, "compile_lock", None)
    return lock if lock is not None else contextlib.nullcontext()


@contextlib.contextmanager
def switching():
    """with switching(): ... - hold what every switch of the patch holds (the compile lock, then this module's lock)
    for a switch made of several steps (the pack's process-wide mode: the patch and ComfyUI's attention functions
    together), so no call and no torch.compile trace sees half of it. Reentrant; take it before any lock of your
    own that you also hold around a switch."""
    with _compile_lock(), _lock:
        yield


def is_enabled() -> bool:
    return _state.installed


def config():
    """The Config (force, min_tokens, engine options) in force while the patch is on, else None."""
    st = _state
    return st.config if st.installed else None


def enabled_config():
    """The Config enable() put in force (the same object until the next enable() or disable()), else None;
    patched() blocks do not change it."""
    return _global


def last_switch():
    """(what, by) of the latest enable() or disable() in this process, e.g. ("disable()", "myscript.py:12 in
    main"), or None before the first."""
    return _last_switch


def _caller() -> str:
    """Where the switch was called from: the first frame outside this module and contextlib, as file:line in
    function (the file's folder and name only)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename in (__file__, contextlib.__file__):
        f = f.f_back
    if f is None:
        return "unknown"
    path = f.f_code.co_filename
    short = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
    return f"{short}:{f.f_lineno} in {f.f_code.co_name}"


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
    """Count one call of `path` as `outcome` ("passed" or "deferred"; routed calls are counted by the engine under
    count_key(path)); nothing inside a torch.compile trace (a Python counter read there would make dynamo guard on
    it)."""
    if outcome not in OUTCOMES[1:]:
        raise ValueError(f"attention_core patch: record() counts 'passed' or 'deferred' calls, got {outcome!r} "
                         "(routed calls are counted by the engine: pass count_as=count_key(path))")
    if torch.compiler.is_dynamo_compiling():
        return
    counter = _stats.get((path, outcome))
    if counter is None:
        counter = _stats.setdefault((path, outcome), itertools.count())
    next(counter)  # one C call: nothing interrupts it (see kernel/counts.py)


def count_key(path: str) -> str:
    """The count_as key (attention_core.scaled_dot_product_attention) of an engine call routed on `path`, made
    now: the engine counts it where it runs, and stats() reports it as routed (compiled when traced)."""
    return counts.traced_key(COUNT_PREFIX + path)


def stats() -> dict:
    """{path: {"routed", "passed", "deferred", "total", "compiled"}} of the calls counted since the last
    reset_stats(); "compiled": how many of the routed calls ran inside torch.compile graphs (there the calls passed on
    are not seen, so "total" counts eager calls plus the compiled graphs' routed ones)."""
    engine = counts.counted(COUNT_PREFIX)
    eager = {}
    for (path, outcome), counter in _stats.copy().items():  # a copy taken by one C call
        eager.setdefault(path, {})[outcome] = counts._value(counter)
    out = {}
    for path in sorted(set(eager) | {k[len(COUNT_PREFIX):] for k in engine}):
        routed, compiled = engine.get(COUNT_PREFIX + path, (0, 0))
        per = eager.get(path, {})
        passed, deferred = per.get("passed", 0), per.get("deferred", 0)
        out[path] = {"routed": routed, "passed": passed, "deferred": deferred, "total": routed + passed + deferred,
                     "compiled": compiled}
    return out


def reset_stats() -> None:
    _stats.clear()
    counts.reset(COUNT_PREFIX)


def _long_enough(query, key, min_tokens: int) -> bool:
    return min_tokens <= 0 or max(query.shape[-2], key.shape[-2]) >= min_tokens


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False,
                  **kwargs):  # torch's signature: scale and enable_gqa keyword-only
    if not kwargs and _is_causal_bias(attn_mask):
        # torch dispatches CausalBias masks (which hold no values) through __torch_function__ only when the
        # function called IS torch's own; patched, its handler would run them as plain tensors. Call the handler:
        # it raises with is_causal, turns upper-left (and square lower-right) into is_causal=True and
        # materialises lower-right, calling F.scaled_dot_product_attention (this function) again.
        from torch.nn.attention.bias import CausalBias
        return CausalBias._dispatch(query, key, value, attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                    scale=scale, enable_gqa=enable_gqa)
    st = _state  # once: a switch on another thread replaces it whole, this call keeps what it read
    cfg = st.config
    if st.installed:
        if not torch.compiler.is_dynamo_compiling() and is_deferred():  # thread-local state is not traced
            outcome = "deferred"
        elif (not kwargs and _servable(query, key, value) and _long_enough(query, key, cfg.min_tokens)
              and _wants_engine(query.device, cfg.force)):
            outcome = "routed"
        else:
            outcome = "passed"
        if outcome != "routed":
            record(SDPA_PATH, outcome)
    else:
        outcome = "passed"
    if outcome != "routed":
        return _pass_through(st.fallbacks, query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kwargs)
    from .sdpa import scaled_dot_product_attention
    return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                        enable_gqa=enable_gqa, count_as=count_key(SDPA_PATH), **cfg.options)


def _pass_through(fallbacks: tuple, *args, **kwargs):
    """The function ours was put over (the State's fallbacks), one further back for each of our calls already
    passing through on this thread; torch's own when ours is over nothing (a reference to it kept past disable())."""
    if not fallbacks:
        return torch._C._nn.scaled_dot_product_attention(*args, **kwargs)
    if torch.compiler.is_dynamo_compiling():  # thread-local state is not traced: a module global counts (dynamo
        global _traced_passing  # replays the stores as side effects; a trace runs on one thread)
        if not TRACED_STORES_SEEN:  # torch 2.5's dynamo does not read back the store: torch's own, never a loop
            return fallbacks[0](*args, **kwargs)
        depth = _traced_passing
        original = fallbacks[-1 - depth] if depth < len(fallbacks) else fallbacks[0]
        _traced_passing = depth + 1
        try:
            return original(*args, **kwargs)
        finally:  # an error must not leave the count raised
            _traced_passing = depth
    depth = getattr(_local, "passing", 0)
    original = fallbacks[-1 - depth] if depth < len(fallbacks) else fallbacks[0]
    _local.passing = depth + 1
    try:
        return original(*args, **kwargs)
    finally:
        _local.passing = depth


def _refresh() -> None:
    """Put in force what enable() and the open blocks ask for (both locks held), again and again until nothing
    changed under it. Called from code that interrupted a _refresh() on this thread (the only thread that can: it
    holds the lock), it only marks the request: the interrupted one, which never interleaves its writes with
    another's, runs again before it returns (see the module docstring)."""
    global _refreshing, _dirty
    _dirty = True
    if _refreshing:
        return
    while _dirty:
        _refreshing = True
        try:
            while _dirty:
                _dirty = False
                _refresh_once()
        finally:
            _refreshing = False
        # a request that came after the inner loop's last look, while _refreshing was still set, is seen here


def _refresh_once() -> None:
    """Install or remove the patch and set the options in force from enable()'s and the open blocks': a new State,
    put in place whole before our function is installed and after it is removed, so a call that reaches ours always
    finds the functions ours was put over."""
    global _state
    st = _state
    blocks, enabled = tuple(_blocks), _global  # read once: a switch interrupting this one changes them
    cfg = blocks[-1][1] if blocks else (enabled if enabled is not None else OFF)
    want = enabled is not None or bool(blocks)
    if want and not st.installed:
        current = F.scaled_dot_product_attention
        if current is not _patched_sdpa:
            if not st.fallbacks:  # torch's own: our function takes its name and signature (once: a later
                functools.update_wrapper(_patched_sdpa, current, updated=())  # function may hold ours: a loop)
            _state = State(True, cfg, st.fallbacks + (current,))
            F.scaled_dot_product_attention = _patched_sdpa
        else:
            _state = State(True, cfg, st.fallbacks)
    elif not want and st.installed:
        fallbacks = st.fallbacks
        if F.scaled_dot_product_attention is _patched_sdpa:  # never undo someone else's later wrapper
            F.scaled_dot_product_attention = fallbacks[-1]
            fallbacks = fallbacks[:-1]
        # else: ours stays inside their wrapper, passing every call on
        _state = State(False, OFF, fallbacks)
    elif cfg != st.config:  # only a change replaces it (a new object fails dynamo's guards: a recompile)
        _state = State(st.installed, cfg, st.fallbacks)


def _make_config(force, min_tokens, options) -> Config:
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"attention_core patch: min_tokens must be a whole number >= 0, got {min_tokens!r}")
    if "count_as" in options:
        raise ValueError("attention_core patch: count_as is the patch's own (its calls count under stats()); "
                         "leave it out of the options")
    return Config(bool(force), min_tokens, dict(options))


def enable(force: bool = False, min_tokens: int = 0, **options) -> None:
    """Patch torch's SDPA. force=True uses the engine on every device; calls whose longer sequence (query or key)
    has fewer than min_tokens tokens keep torch's function; options (tier, memory_budget, precision, ...) are
    passed to attention_core.scaled_dot_product_attention. Calling it again updates the options. Waits for a
    torch.compile trace in progress on another thread (see the module docstring)."""
    global _global, _last_switch
    cfg = _make_config(force, min_tokens, options)
    by = _caller()
    with switching():
        _global = cfg
        _last_switch = ("enable()", by)
        _refresh()


def disable(close_blocks: bool = True) -> None:
    """Restore torch's own SDPA now (open patched() blocks are closed too; their exits then change nothing). With
    close_blocks=False only enable()'s hold is dropped: open patched() blocks (other code's, maybe on other threads)
    keep the patch on until they exit. Waits for a torch.compile trace in progress on another thread."""
    global _global, _last_switch
    by = _caller()
    with switching():
        _global = None
        _last_switch = ("disable()", by)
        if close_blocks:
            _blocks.clear()
        _refresh()


@contextlib.contextmanager
def patched(force: bool = False, min_tokens: int = 0, **options):
    """with patched(): ... - the patch for the block, then the previous state back. Safe to nest and to overlap
    across threads; a block inside enable() leaves the global patch on when it exits."""
    entry = (object(), _make_config(force, min_tokens, options))
    with switching():
        _blocks.append(entry)  # one C call each way: a block opened or closed by code interrupting this one is kept
        _refresh()
    try:
        yield
    finally:
        with switching():
            try:
                _blocks.remove(entry)  # compared by identity of the token first: no Python code runs
            except ValueError:  # disable() closed it already
                pass
            _refresh()
