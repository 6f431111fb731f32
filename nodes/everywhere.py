"""Tiled Attention Everywhere: the process-wide mode, off unless the user turns it on.

On, every torch SDPA call in the ComfyUI process (attention_core.patch: packs with their own model code such as
kijai's WanVideoWrapper in its "sdpa" mode, diffusers- and transformers-based packs, ComfyUI's attention_pytorch)
and every call of ComfyUI's global attention functions (nodes/comfy_global_route.py: optimized_attention used
without transformer_options, e.g. the wrapper packs' "comfy" mode, and by models no Patch Attention patches) runs
through the engine where the device needs it (mode "auto", the same probe as the node's auto) or on every device
(a tier name). Calls whose longer sequence has fewer than `min_tokens` tokens, nested tensors and non-float inputs
stay with torch / ComfyUI; calls of models patched by Patch Attention are the node's (its settings win).

Set by the environment variable TILED_ATTENTION_EVERYWHERE when ComfyUI loads the pack (apply_environment(), once
per process; unset or "0": off, "auto", or a tier "chunked" / "online" / "inplace") and by the Tiled Attention
Everywhere node (set_mode()), which lasts until switched again. Switching is safe while another thread runs a
model: the options are replaced whole and a call already running finishes on the path it took.
"""
from __future__ import annotations

import logging
import os
import threading

from ..attention_core import patch
from . import comfy_global_route

ENV = "TILED_ATTENTION_EVERYWHERE"
MODES = ("off", "auto", "chunked", "online", "inplace")
OFF_WORDS = ("", "0", "off")
DEFAULT_MIN_TOKENS = 1024
log = logging.getLogger("tiled_attention")

_lock = threading.Lock()
_state = {"mode": "off", "min_tokens": DEFAULT_MIN_TOKENS, "source": "default", "env_applied": False}


def parse_env(value) -> str:
    """The mode a TILED_ATTENTION_EVERYWHERE value asks for; ValueError naming the accepted values otherwise."""
    v = (value or "").strip().lower()
    if v in OFF_WORDS:
        return "off"
    if v in MODES:
        return v
    raise ValueError(f"{ENV}={value!r} is not a mode: use 0 (off), auto (tiled attention where this GPU needs it) "
                     f"or a tier forced on every device: chunked, online, inplace")


def set_mode(mode: str, min_tokens: int = DEFAULT_MIN_TOKENS, source: str = "the Tiled Attention Everywhere node"):
    """Switch the process-wide mode (see the module docstring); returns state()."""
    if mode not in MODES:
        raise ValueError(f"Tiled Attention Everywhere: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"Tiled Attention Everywhere: min_tokens must be a whole number >= 0, got {min_tokens!r}")
    with _lock:
        was = (_state["mode"], _state["min_tokens"])
        if mode == "off":
            if _state["mode"] != "off":
                patch.disable(close_blocks=False)  # leave other code's open patched() blocks alone
            comfy_global_route.unroute()
        else:
            patch.enable(force=mode != "auto", min_tokens=min_tokens, tier=mode)
            comfy_global_route.route()
        _state.update(mode=mode, min_tokens=min_tokens, source=source)
        if (mode, min_tokens) != was:
            log.info("[tiled-attention] %s", describe(stats=False))
        return state()


def apply_environment(environ=None):
    """Apply TILED_ATTENTION_EVERYWHERE once per process (ComfyUI's loader calls the pack's entry point once; later
    calls change nothing). An invalid value is logged as an error and leaves the mode off: ComfyUI keeps starting."""
    environ = os.environ if environ is None else environ
    with _lock:
        if _state["env_applied"]:
            return state()
        _state["env_applied"] = True
    raw = environ.get(ENV)
    try:
        mode = parse_env(raw)
    except ValueError as e:
        log.error("[tiled-attention] %s; Tiled Attention Everywhere stays off", e)
        return state()
    if mode == "off":
        return state()
    return set_mode(mode, DEFAULT_MIN_TOKENS, source=f"{ENV}={raw.strip()}")


def state() -> dict:
    """{"mode", "min_tokens", "source", "on", "routed_functions", "stats"}: what is in force now."""
    return {"mode": _state["mode"], "min_tokens": _state["min_tokens"], "source": _state["source"],
            "on": _state["mode"] != "off", "routed_functions": comfy_global_route.routed(), "stats": patch.stats()}


def describe(stats: bool = True) -> str:
    """One line for the start log, Attention Info and the node: the mode, where it acts, and the calls counted."""
    s = state()
    if not s["on"]:
        return (f"Tiled Attention Everywhere: off (process-wide mode; set {ENV}=auto, or use the Tiled Attention "
                f"Everywhere node, to run every attention in this ComfyUI process tiled)")
    where = "where this device needs it" if s["mode"] == "auto" else f"on every device, tier {s['mode']}"
    text = (f"Tiled Attention Everywhere: ON, process-wide (mode {s['mode']}, set by {s['source']}): torch SDPA "
            f"calls and ComfyUI's attention functions in this process run tiled {where}, from "
            f"{s['min_tokens']} tokens; models patched by Patch Attention keep the node's settings")
    if stats:
        counted = [f"{path} {c['routed']} of {c['total']} routed" for path, c in sorted(s["stats"].items())]
        text += ". Calls since start: " + ("; ".join(counted) if counted else "none yet")
    return text
