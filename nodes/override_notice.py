"""Says when a model patched by Patch Attention samples without the node's attention override in force.

ComfyUI keeps one per-model attention override, `transformer_options["optimized_attention_override"]`, and any node
may write it: core ModelAttentionBackend (ComfyUI 0.33.0, through `ModelPatcher.set_model_optimized_attention`) and
other packs' attention patchers (KJNodes' Patch Sage Attention, ...). Placed after Patch Attention on the MODEL wire
they replace the node's override without a word. So Patch Attention registers a check on its clone: an OUTER_SAMPLE
wrapper (comfy.patcher_extension, present in every supported ComfyUI; ModelPatcher.clone() copies wrappers, so every
later clone of the model carries it, and a later Patch Attention replaces it by its own under the same key). When
sampling starts it reads the override in the sampler's own model options, the ones the model's attention calls will
get, and compares it with the override that node installed:

    in force          the override is the node's, or holds it (another pack's override that wraps it and calls it):
                      nothing is said (the second case is logged at info level)
    not in force      anything else: ComfyUI's own attention (no override) or another node's override. Logged as a
                      warning once per prompt, naming what is in force (see describe()), and kept for Attention Info

Patch Attention's mode off removes the check with the override (choosing ComfyUI's attention is no accident), and a
later Patch Attention replacing an earlier one is the chain rule (info level, when the later node runs).

"Once per prompt": notices are keyed on the id of the prompt ComfyUI is executing (comfy_execution.utils'
executing context, else the server's last prompt id), so the sampler calls of one prompt (several stages, several
samplers on the same model) say it once and the next prompt says it again. Outside a prompt every sampling says it.
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from .comfy_adapter import MARK, OVERRIDE_KEY, comfy_default_attention

KEY = "tiled-attention-override-check"  # the wrapper key on the model patcher
MAB_QUALNAME = "set_model_optimized_attention.<locals>.optimized_attention_override"
log = logging.getLogger("tiled_attention")

_lock = threading.RLock()  # re-entrant: a signal handler or trace function may log a notice from inside one
_seen = {"prompt": None, "keys": set()}  # the notices said for the prompt being executed
_latest: dict = {"notice": None}  # the latest warning, for Attention Info


@dataclass(frozen=True)
class Notice:
    prompt_id: Optional[str]
    text: str
    when: float


# ---------------------------------------------------------------------------------------------------- registration

def earlier_patch(model_patcher):
    """The settings of the Patch Attention override on `model_patcher` (the node's input), or None."""
    to = getattr(model_patcher, "model_options", {}).get("transformer_options", {})
    return getattr(to.get(OVERRIDE_KEY), MARK, None)


def watch(model_patcher, override, node: str, replaced=None) -> bool:
    """Make `model_patcher` (Patch Attention's clone) check, each time it starts sampling, that `override` is in
    force; override=None (mode off) removes the check. `replaced`: the settings of an earlier Patch Attention this
    node replaces (said at info level: the chain rule). Returns whether a check is registered."""
    node = node_label(node)
    if replaced is not None:
        log.info("[tiled-attention] %s %s the attention override of an earlier %s (mode %s) on this model: the "
                 "later node in a chain wins", node, "removes" if override is None else "replaces", replaced.node,
                 replaced.mode)
    try:
        from comfy.patcher_extension import WrappersMP
    except ImportError:  # not inside ComfyUI
        return False
    if not hasattr(model_patcher, "add_wrapper_with_key"):
        return False
    model_patcher.remove_wrappers_with_key(WrappersMP.OUTER_SAMPLE, KEY)
    if override is None:
        return False
    model_patcher.add_wrapper_with_key(WrappersMP.OUTER_SAMPLE, KEY, OverrideCheck(override, node))
    return True


def node_label(node: str) -> str:
    """`node` with the id of the graph node ComfyUI is executing, as its frontend shows it ("... #12")."""
    get = getattr(sys.modules.get("comfy_execution.utils"), "get_executing_context", None)
    context = get() if get is not None else None
    node_id = getattr(context, "node_id", None)
    return f"{node} #{node_id}" if node_id is not None else node


class OverrideCheck:
    """OUTER_SAMPLE wrapper: check() on the sampler's model options, then sampling as it was."""

    def __init__(self, expected, node: str):
        self.expected = expected
        self.node = node

    def __deepcopy__(self, memo):  # model options are deep-copied by some clones: the check stays one object
        return self

    def __call__(self, executor, *args, **kwargs):
        try:
            options = getattr(executor.class_obj, "model_options", None) or {}
            check(options.get("transformer_options", {}).get(OVERRIDE_KEY), self.expected, self.node)
        except Exception as e:  # noqa: BLE001 - a notice must never stop a prompt
            log.debug("[tiled-attention] override check failed: %r", e)
        return executor(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- the check

def holds(fn, target, depth: int = 4, budget: int = 256) -> bool:
    """Whether `fn` is `target` or reaches it through what wrappers keep their inner function in: closure cells,
    `__wrapped__`, functools.partial's func/args/keywords, a bound method's object, a callable object's attributes,
    this pack's `previous`, and lists, tuples and dicts of those (at most `depth` levels, `budget` objects)."""
    seen, frontier = set(), [fn]
    for _ in range(depth + 1):
        nxt = []
        for obj in frontier:
            if obj is target:
                return True
            if id(obj) in seen or len(seen) >= budget:
                continue
            seen.add(id(obj))
            nxt.extend(_inner_objects(obj))
        frontier = nxt
    return False


def _inner_objects(obj) -> list:
    if isinstance(obj, (list, tuple)):
        return list(obj)
    if isinstance(obj, dict):
        return list(obj.values())
    if not callable(obj) or isinstance(obj, type):
        return []
    found = []
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            found.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    for name in ("__wrapped__", "__func__", "__self__", "func", "args", "keywords", "previous", "inner"):
        value = getattr(obj, name, None)
        if value is not None and value is not obj:
            found.append(value)
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not hasattr(obj, "__code__"):  # a callable object: its attributes
        found.extend(attrs.values())
    return found


def check(current, expected, node: str) -> str:
    """Compare the override in force (`current`) with the one Patch Attention installed (`expected`); say it when
    it is not in force. Returns "in force", "other patch" (another Patch Attention's override: the chain rule,
    info level), "wrapped" (another pack's override holds ours: info level) or "not in force" (a warning)."""
    if current is expected:
        return "in force"
    settings = getattr(current, MARK, None)
    if settings is not None:  # another Patch Attention's override: the chain rule, not an accident
        _say(("chain", id(expected), id(current)), logging.INFO,
             f"{node}: the override of another {settings.node} (mode {settings.mode}) is in force on this model "
             f"(the later attention node wins)")
        return "other patch"
    if current is not None and holds(current, expected):
        _say(("wrapped", id(expected), describe(current)), logging.INFO,
             f"{node}: its attention override runs inside {describe(current)}, which wraps it (the other node "
             f"decides which calls reach it)")
        return "wrapped"
    what = describe(current)
    ours = getattr(expected, MARK, None)
    mode = f" (mode {ours.mode})" if ours is not None else ""
    text = (f"{node}{mode} is not in force while this model samples: its attention override "
            f"(transformer_options['{OVERRIDE_KEY}']) was replaced by {what}, which now answers this model's "
            f"attention calls. The later node that writes the override wins: put Patch Attention after that node "
            f"(it then hands the calls it does not take to that node's override) or remove that node.")
    _say(("replaced", id(expected), what), logging.WARNING, text, keep=True)
    return "not in force"


def describe(fn) -> str:
    """What an attention override is, in words: ComfyUI's own attention (None), core ModelAttentionBackend with the
    backend it chose, this pack's Patch Attention, or another pack's override named by its custom node folder and
    the function's qualified name."""
    if fn is None:
        return f"no override at all (ComfyUI's own attention, {comfy_default_attention()})"
    settings = getattr(fn, MARK, None)
    if settings is not None:
        return f"another {settings.node} override (mode {settings.mode})"
    fn = defining(fn)
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    if module == "comfy.model_patcher" and qualname.endswith(MAB_QUALNAME):
        inner = _mab_inner(fn)
        # a backend in ComfyUI's registry is ModelAttentionBackend's choice, looked up as registered (a wrap_attn
        # wrapper), whoever wrote the function under it; anything else was handed over by a pack
        own = inner if _registered_name(inner) is not None else defining(inner)
        folder = custom_node_folder(own)
        if folder is not None:  # a pack handing its own function to ModelPatcher.set_model_optimized_attention
            return (f"custom node '{folder}' (through ModelPatcher.set_model_optimized_attention): "
                    f"{getattr(own, '__qualname__', type(own).__qualname__)}")
        return f"ModelAttentionBackend (ComfyUI core), {_mab_backend(inner)}"
    folder = custom_node_folder(fn)
    where = f"custom node '{folder}'" if folder else f"module {module}"
    return f"{where}: {qualname}"


def defining(fn, depth: int = 8):
    """The function whose code a pack wrote, under wrappers no pack wrote: functools.partial (its func), a function
    torch.compiler.disable / torch._dynamo wrapped (_torchdynamo_orig_callable, __wrapped__) and other wrappers made
    outside any custom node folder that keep their inner function in __wrapped__ (functools.wraps). A wrapper a pack
    wrote itself is that pack's and is kept: it decides what runs. At most `depth` levels; None stays None."""
    for _ in range(depth):
        if fn is None:
            return None
        if isinstance(fn, functools.partial):
            fn = fn.func
            continue
        if custom_node_folder(fn) is not None:
            return fn
        inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
        if inner is None or inner is fn:
            return fn
        fn = inner
    return fn


def _mab_inner(fn):
    """The attention function a ModelPatcher.set_model_optimized_attention closure calls, or None."""
    code = getattr(fn, "__code__", None)
    try:
        return fn.__closure__[code.co_freevars.index("optimized_attention")].cell_contents
    except (AttributeError, TypeError, ValueError, IndexError):
        return None


def _registered_name(inner) -> Optional[str]:
    """The name `inner` is registered under in ComfyUI's attention registry (by identity), or None."""
    if inner is None:
        return None
    registry = getattr(sys.modules.get("comfy.ldm.modules.attention"), "REGISTERED_ATTENTION_FUNCTIONS", {}) or {}
    return {id(f): k for k, f in registry.items()}.get(id(inner))


def _mab_backend(inner) -> str:
    """The backend ModelAttentionBackend chose: its name in ComfyUI's registry and its function."""
    if inner is None:
        return "backend unknown"
    name = getattr(inner, "__name__", type(inner).__name__)
    key = _registered_name(inner)
    if key is None:
        return f"backend {name}"
    if key == "pytorch":
        return (f"backend 'pytorch' ({name}: torch's SDPA, which is math SDPA with memory growing as tokens² on GPUs "
                f"without fused attention)")
    return f"backend '{key}' ({name})"


def custom_node_folder(fn) -> Optional[str]:
    """The custom node whose code defines `fn`: the folder (or single file) right under a `custom_nodes` directory,
    else the longest folder pack ComfyUI loaded (nodes.LOADED_MODULE_DIRS: its name -> its folder) holding the file;
    None for code elsewhere (ComfyUI itself, comfy_extras, site-packages, also where a venv sits inside a pack)."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    path = getattr(code, "co_filename", None)
    if not path:
        return None
    path = os.path.abspath(path)
    root = _comfy_root()
    if root is not None and path.startswith(root + os.sep):
        # inside ComfyUI's own tree: only its custom_nodes folder holds packs (ComfyUI itself may be installed
        # inside a pack's folder, as this pack's test checkouts are, so the first rule must be ComfyUI's own)
        inner = path[len(root) + 1:].split(os.sep)
        return os.path.splitext(inner[1])[0] if len(inner) >= 2 and inner[0] == "custom_nodes" else None
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return None  # an installed library (torch's disable wrapper, functools' helpers), even in a venv that lives
        # inside a pack's folder (this pack's test checkouts keep theirs in custom_nodes/tiled-attention/.venv)
    if "custom_nodes" in parts[:-1]:
        i = len(parts) - 1 - parts[::-1].index("custom_nodes")
        return os.path.splitext(parts[i + 1])[0]
    loaded = getattr(sys.modules.get("nodes"), "LOADED_MODULE_DIRS", None) or {}
    best = None
    for name, folder in loaded.items():
        if os.path.basename(folder) != os.path.basename(name):
            continue  # a single-file module (its entry is the folder holding it) or one of ComfyUI's own
        for f in {os.path.abspath(folder), os.path.realpath(folder)}:
            if path.startswith(f + os.sep) and (best is None or len(f) > best[0]):
                best = (len(f), os.path.basename(name))
    return best[1] if best else None


def _comfy_root() -> Optional[str]:
    """The folder of the running ComfyUI (the one holding its `comfy` package), or None outside ComfyUI."""
    comfy = sys.modules.get("comfy")
    path = getattr(comfy, "__file__", None) or next(iter(getattr(comfy, "__path__", []) or []), None)
    if not path:
        return None
    path = os.path.abspath(path)
    package = os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path
    return os.path.dirname(package)


# ---------------------------------------------------------------------------------------------------- once per prompt

def current_prompt_id() -> Optional[str]:
    """The id of the prompt ComfyUI is executing on this thread (its executing context, ComfyUI 0.3.4x on), else the
    server's last prompt id, else None (outside a prompt)."""
    utils = sys.modules.get("comfy_execution.utils")
    get = getattr(utils, "get_executing_context", None)
    if get is not None:
        context = get()
        if context is not None and getattr(context, "prompt_id", None) is not None:
            return str(context.prompt_id)
    server = getattr(sys.modules.get("server"), "PromptServer", None)
    instance = getattr(server, "instance", None)
    pid = getattr(instance, "last_prompt_id", None)
    return None if pid is None else str(pid)


def _say(key, level: int, text: str, keep: bool = False) -> None:
    """Log `text` unless it was said for `key` in the prompt being executed (outside a prompt: always); keep=True
    also keeps it as the latest notice."""
    prompt_id = current_prompt_id()
    with _lock:
        if prompt_id is None or prompt_id != _seen["prompt"]:
            _seen.update(prompt=prompt_id, keys=set())
        if prompt_id is not None and key in _seen["keys"]:
            return
        _seen["keys"].add(key)
        if keep:
            _latest["notice"] = Notice(prompt_id, text, time.time())
    log.log(level, "[tiled-attention] %s", text)


def latest() -> Optional[Notice]:
    return _latest["notice"]


def report_line() -> str:
    """Attention Info's line: the latest notice, or that none occurred since ComfyUI started."""
    n = latest()
    if n is None:
        return ("Patch Attention override: no notice (no model patched by Patch Attention sampled without its "
                "override in force since ComfyUI started)")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(n.when))
    prompt = f"prompt {n.prompt_id}" if n.prompt_id else "outside a prompt"
    return f"Patch Attention override: latest notice ({prompt}, {when}): {n.text}"
