"""Tiled Attention Everywhere: the process-wide mode, off unless the user turns it on.

On, every torch SDPA call in the ComfyUI process (attention_core.patch: packs with their own model code such as
kijai's WanVideoWrapper in its "sdpa" mode, diffusers- and transformers-based packs, ComfyUI's attention_pytorch)
and every call of ComfyUI's global attention functions (nodes/comfy_global_route.py: optimized_attention used
without transformer_options, e.g. the wrapper packs' "comfy" mode, and by models no Patch Attention patches) runs
through the engine where the device needs it (mode "auto", the same probe as the node's auto) or on every device
(a tier name). Calls whose longer sequence has fewer than `min_tokens` tokens, nested tensors and non-float inputs
stay with torch / ComfyUI; calls of models patched by Patch Attention are the node's (its settings win). In newer
ComfyUIs a layer's own attention chosen by its checkpoint (`preferred_attention`, ComfyAttention) is routed too
(nodes/comfy_preferred_route.py).

Set by the environment variable TILED_ATTENTION_EVERYWHERE when ComfyUI loads the pack (apply_environment(), once
per process; unset or "0": off, "auto", or a tier "chunked" / "online" / "inplace") and by the Tiled Attention
Everywhere node (set_mode()), which lasts until switched again. Switching is safe while other threads run or compile
a model: a switch holds attention_core.patch.switching() (torch.compile's lock, then the patch's) for its two steps,
the options are replaced whole, and a call already running finishes on the path it took.

Re-entrant: every lock here and in the switches it makes is an RLock (the counters are lock-free), so a signal
handler or a sys.settrace function that calls state(), describe() or set_mode() while this thread is inside a
switch or a count never waits on itself. A set_mode() made from inside a set_mode() on the same thread (which
finishes before the interrupted one resumes) is the later request and wins: the interrupted switch sees that a newer
request came (a request counter) and puts the newest in force again before it returns, so the mode, the patch and
ComfyUI's routed functions always end up agreeing.

One truth: state() and describe() (the node's output, the start line, Attention Info) report what is in force now,
read from the patch and the routes themselves, not what the pack last asked for: when other code switched the
patch off or replaced its options (attention_core.disable() / enable() on this copy), they say so and by whom.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import namedtuple

from ..attention_core import patch
from . import comfy_global_route, comfy_preferred_route

ENV = "TILED_ATTENTION_EVERYWHERE"
MODES = ("off", "auto", "chunked", "online", "inplace")
OFF_WORDS = ("", "0", "off")
DEFAULT_MIN_TOKENS = 1024
SHOWN_CHARS = 40  # at most this much of an invalid value is echoed into the log
log = logging.getLogger("tiled_attention")

# what the pack last set: the mode, its min_tokens, who set it, and the patch Config its enable() put in force
# (None while off); replaced whole under the locks
Setting = namedtuple("Setting", "mode min_tokens source config")
# held by set_mode (inside patch.switching()) and by state() / describe(), so a report never sees the pack's setting
# and the patch half-switched; reentrant: set_mode logs describe()
_lock = threading.RLock()
_setting = Setting("off", DEFAULT_MIN_TOKENS, "default", None)
_wanted = ("off", DEFAULT_MIN_TOKENS, "default")  # the latest set_mode() request: (mode, min_tokens, source)
_requests = 0  # set_mode() requests so far: a switch that sees it change under it was interrupted by a newer one
_env_applied = False


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """`value` as the log may echo it: control and other unprintable characters as '?', at most `limit`
    characters, then how long it really was."""
    text = "".join(c if c.isprintable() else "?" for c in str(value)[:limit])
    n = len(str(value))
    return repr(text) + (f"... ({n} characters)" if n > limit else "")


def parse_env(value) -> str:
    """The mode a TILED_ATTENTION_EVERYWHERE value asks for; ValueError naming the accepted values otherwise (the
    value echoed bounded: shown())."""
    v = (value or "").strip().lower()
    if v in OFF_WORDS:
        return "off"
    if v in MODES:
        return v
    raise ValueError(f"{ENV}={shown(value)} is not a mode: use 0 (off), auto (tiled attention where this GPU needs "
                     f"it) or a tier forced on every device: chunked, online, inplace")


def set_mode(mode: str, min_tokens: int = DEFAULT_MIN_TOKENS, source: str = "the Tiled Attention Everywhere node"):
    """Switch the process-wide mode (see the module docstring); returns state(). Waits for a torch.compile trace
    in progress on another thread."""
    global _wanted, _requests
    if mode not in MODES:
        raise ValueError(f"Tiled Attention Everywhere: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"Tiled Attention Everywhere: min_tokens must be a whole number >= 0, got {min_tokens!r}")
    with patch.switching(), _lock:  # the order every switch takes: compile lock, the patch's lock, then ours
        before = describe(stats=False)
        _wanted = (mode, min_tokens, source)
        _requests += 1
        _put_in_force()
        now = describe(stats=False)
        if now != before:
            log.info("[tiled-attention] %s", now)
        return state()


def _put_in_force() -> None:
    """Make the patch, ComfyUI's routed functions and _setting agree with the latest request (_wanted), again until
    no newer request came while doing it (a set_mode() from code that interrupted this one on the same thread: it
    ran to its end, and every step here is idempotent, so doing the newest again leaves everything agreeing)."""
    global _setting
    while True:
        seen = _requests
        mode, min_tokens, source = _wanted
        if mode == "off":
            was = _setting
            if was.config is not None and patch.enabled_config() is was.config:  # ours, still in force
                patch.disable(close_blocks=False)  # leave other code's open patched() blocks alone
            comfy_global_route.unroute()
            comfy_preferred_route.unroute()
            _setting = Setting(mode, min_tokens, source, None)
        else:
            patch.enable(force=mode != "auto", min_tokens=min_tokens, tier=mode)
            _setting = Setting(mode, min_tokens, source, patch.enabled_config())
            comfy_global_route.route()
            comfy_preferred_route.route()  # per-layer attention a checkpoint chose (ComfyUI after 0.33.0)
        if _requests == seen:  # a request after this look is a switch that runs whole before this one returns
            return


def apply_environment(environ=None):
    """Apply TILED_ATTENTION_EVERYWHERE once per process (ComfyUI's loader calls the pack's entry point once; later
    calls change nothing). An invalid value is logged as an error (echoed bounded) and leaves the mode off:
    ComfyUI keeps starting."""
    global _env_applied
    environ = os.environ if environ is None else environ
    with _lock:
        if _env_applied:
            return state()
        _env_applied = True
    raw = environ.get(ENV)
    try:
        mode = parse_env(raw)
    except ValueError as e:
        log.error("[tiled-attention] %s; Tiled Attention Everywhere stays off", e)
        return state()
    if mode == "off":
        return state()
    return set_mode(mode, DEFAULT_MIN_TOKENS, source=f"{ENV}={mode}")


def state() -> dict:
    """What is in force now: {"mode" (the mode in force: "off" when other code switched the patch off), "set"
    (the mode the pack last set), "min_tokens", "source" (who set it), "on", "switched_by" (when the pack's setting
    is not in force: the switch that replaced it, e.g. "disable() at myscript.py:12 in main"; else None),
    "options_from_block" (a patched() block of other code is open and its options are in force), "routed_functions"
    (ComfyUI's attention functions routed now), "stats" (attention_core.patch.stats())}."""
    with _lock:
        s = _setting
        in_force = s.config is not None and patch.enabled_config() == s.config
        switched_by = None
        if s.config is not None and not in_force:
            what, by = patch.last_switch() or ("a switch", "unknown")
            switched_by = f"{what} at {by}"
        return {"mode": s.mode if in_force else "off", "set": s.mode, "min_tokens": s.min_tokens,
                "source": s.source, "on": in_force, "switched_by": switched_by,
                "options_from_block": in_force and patch.config() != s.config,
                "routed_functions": comfy_global_route.routed(), "stats": patch.stats()}


def _counted(stats: dict) -> str:
    parts = []
    for path, c in sorted(stats.items()):
        text = f"{path} {c['routed']} of {c['total']} routed"
        if c.get("compiled"):
            text += (f" ({c['compiled']} of them inside torch.compile graphs, where calls passed on to torch or "
                     f"ComfyUI are not seen)")
        parts.append(text)
    return "; ".join(parts) if parts else "none yet"


def describe(stats: bool = True) -> str:
    """One line for the start log, Attention Info and the node: the mode in force, where it acts, and the calls
    counted; who switched it off when that was not the pack."""
    with _lock:
        return _describe(state(), stats)


def _describe(s: dict, stats: bool) -> str:
    if s["switched_by"]:
        cfg = patch.enabled_config()
        done = ("switched the route of torch SDPA and ComfyUI's attention functions off (every call goes to torch "
                "and ComfyUI)" if cfg is None else
                f"put its own options in force for them (force={cfg.force}, min_tokens={cfg.min_tokens}, "
                f"{dict(cfg.options)})")
        text = (f"Tiled Attention Everywhere: OFF, switched off by other code: set to {s['set']} by {s['source']}, "
                f"then attention_core {s['switched_by']} {done}. Set the mode again (the node, or {ENV} at start) "
                f"to turn it back on")
    elif not s["on"]:
        text = (f"Tiled Attention Everywhere: off (process-wide mode; set {ENV}=auto, or use the Tiled Attention "
                f"Everywhere node, to run every attention in this ComfyUI process tiled)")
        if patch.enabled_config() is not None:  # the latest enable() / disable() was other code's enable()
            what, by = patch.last_switch() or ("enable()", "unknown")
            text += f"; torch SDPA is routed by other code nonetheless (attention_core {what} at {by})"
        elif patch.is_enabled():
            text += "; torch SDPA is routed by an open attention_core.patched() block of other code nonetheless"
        return text
    else:
        where = "where this device needs it" if s["mode"] == "auto" else f"on every device, tier {s['mode']}"
        text = (f"Tiled Attention Everywhere: ON, process-wide (mode {s['mode']}, set by {s['source']}): torch SDPA "
                f"calls and ComfyUI's attention functions in this process run tiled {where}, from "
                f"{s['min_tokens']} tokens; models patched by Patch Attention keep the node's settings")
        if s["options_from_block"]:
            text += "; an attention_core.patched() block of other code is open: its options are in force until it exits"
        if not s["routed_functions"]:
            text += "; ComfyUI's attention functions are not routed now (other code put their own functions back)"
    if stats:
        text += ". Calls since start: " + _counted(s["stats"])
    return text
