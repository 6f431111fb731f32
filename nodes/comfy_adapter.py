"""The one place that knows ComfyUI's attention-override calling conventions (0.3.60 to today).

ComfyUI's `wrap_attn` calls `transformer_options["optimized_attention_override"](func, *args, **kwargs)` where
`func` is the backend the model would have run and args/kwargs are exactly what the call site passed:
    (q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs)
q/k/v are [B, N, H*D], or [B, H, N, D] with skip_reshape; the result is [B, N, H*D], or [B, H, N, D] with
skip_output_reshape. Newer versions add `scale`, `enable_gqa`, `low_precision_attention`, `preferred_attention`
and wrap q/k/v in `AttentionTensorContainer` (unwrapped by the wrapper before an override without a
`container_function` attribute is called; this override never has one). Masks follow attention_pytorch:
2-D -> (1, 1, Nq, Nk), 3-D -> (B, 1, Nq, Nk); bool means True = attend, float is added to the scores.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..attention_core import TIER_CHOICES, AttentionMemoryError, detect, scaled_dot_product_attention
from ..attention_core.kernel import counts
from ..attention_core.patch import deferred

log = logging.getLogger("tiled_attention")

OVERRIDE_KEY = "optimized_attention_override"
MARK = "_tiled_attention"
POSITIONAL = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")
# the engine's tiers (attention_core.TIER_CHOICES) plus "off", in the order saved workflows show them
MODES = ("auto", "chunked", "online", "inplace", "off")
if set(MODES) != set(TIER_CHOICES) | {"off"}:
    raise ImportError(f"tiled-attention: the node's modes {MODES} no longer match the engine's tiers {TIER_CHOICES}")
HALF_POLICIES = ("keep", "bf16_to_fp16", "fp32")  # saved in workflows: names fixed
# the node's "keep" (the model's dtype; bf16 -> fp16 where there is no bf16 hardware) is the engine's "auto",
# never the engine's old "keep" (now "input": the input dtype as it is, even on the CPU)
_PRECISION = {"keep": "auto", "bf16_to_fp16": "fp16", "fp32": "fp32"}
COUNT_PREFIX = "node:"  # the engine count keys (attention_core.kernel.counts) of the per-model routes
_count_keys = itertools.count(1)


def _new_count_key() -> str:
    return f"{COUNT_PREFIX}{next(_count_keys)}"


@dataclass
class PatchSettings:
    mode: str = "auto"
    memory_budget_mb: int = 0
    half_precision: str = "keep"
    min_tokens: int = 0
    node: str = "Patch Attention (tiled)"
    devices: tuple = ()  # more than one: heads split over these devices (attention_core.multidevice)
    # the engine counts this node's calls under count_key where they run (eager and inside torch.compile graphs);
    # counted: the calls count() saw in eager code ({"engine": announced, "passthrough": passed on})
    count_key: str = field(default_factory=_new_count_key, compare=False, repr=False)
    counted: dict = field(default_factory=lambda: {"engine": 0, "passthrough": 0}, compare=False, repr=False)

    def __deepcopy__(self, memo):  # shared across ModelPatcher clones: the settings never change after creation
        return self

    @property
    def stats(self) -> "CallCounts":
        """A live read-only mapping {"engine": calls the engine ran for these settings (eager and compiled),
        "passthrough": calls passed on in eager code (inside a torch.compile graph they are not seen)}."""
        return CallCounts(self)

    @property
    def compiled_calls(self) -> int:
        """How many of stats["engine"] ran inside torch.compile graphs."""
        return counts.calls(self.count_key)[1]


class CallCounts(Mapping):
    """PatchSettings.stats: read when looked at, so a reference kept while a model runs stays current."""
    KEYS = ("engine", "passthrough")

    def __init__(self, settings: PatchSettings):
        self._settings = settings

    def __getitem__(self, what):
        if what == "engine":
            return counts.calls(self._settings.count_key)[0]
        if what == "passthrough":
            return self._settings.counted["passthrough"]
        raise KeyError(what)

    def __iter__(self):
        return iter(self.KEYS)

    def __len__(self):
        return len(self.KEYS)

    def __repr__(self):
        return repr(dict(self))


def bind_call(args: tuple, kwargs: dict) -> dict:
    """Name the positional/keyword arguments of an optimized_attention call."""
    call = dict(zip(POSITIONAL, args))
    for name in POSITIONAL:
        if name in kwargs:
            call[name] = kwargs[name]
    for name, default in (("mask", None), ("attn_precision", None), ("skip_reshape", False),
                          ("skip_output_reshape", False)):
        call.setdefault(name, default)
    if len(args) > len(POSITIONAL):
        raise TypeError(f"optimized_attention takes at most {len(POSITIONAL)} positional arguments, got {len(args)}")
    for name in ("q", "k", "v", "heads"):
        if name not in call:
            raise TypeError(f"optimized_attention call without {name}")
    for name in ("q", "k", "v"):  # only when called outside ComfyUI's wrapper, which unwraps them itself
        t = call[name]
        if not isinstance(t, torch.Tensor) and hasattr(t, "take"):
            call[name] = t.take()
    return call


def to_heads(call: dict, enable_gqa: bool, node: str):
    """q, k, v as [B, H, N, D] plus what is needed to shape the result back. `node` names the route taking the call
    (the Patch Attention node, or Tiled Attention Everywhere) in the error for heads that do not split q."""
    q, k, v, heads = call["q"], call["k"], call["v"], int(call["heads"])
    if call["skip_reshape"]:
        return q, k, v
    b = q.shape[0]
    if heads <= 0 or q.shape[-1] % heads:
        raise ValueError(heads_error(node, q, k, heads))
    dim_head = q.shape[-1] // heads
    kv_heads = k.shape[-1] // dim_head if enable_gqa else heads
    q = q.reshape(b, -1, heads, dim_head).transpose(1, 2)
    k = k.reshape(b, -1, kv_heads, dim_head).transpose(1, 2)
    v = v.reshape(b, -1, kv_heads, v.shape[-1] // kv_heads).transpose(1, 2)
    return q, k, v


def heads_error(node: str, q: torch.Tensor, k: torch.Tensor, heads: int) -> str:
    """The error for an attention call whose q ([batch, tokens, heads * head_dim]) does not split into `heads`."""
    tokens = max(q.shape[-2], k.shape[-2])
    if node.startswith("attention backend"):
        change = "choose another attention backend for this model"
    else:
        change = (f"set {node}'s min_tokens to {tokens + 1} or more (or its mode to off) so that such calls keep "
                  f"ComfyUI's own attention")
    why = (f"the last axis, {q.shape[-1]}, is not a multiple of {heads}" if heads > 0 else
           "there must be at least one head")
    return (f"{node}: q of shape {tuple(q.shape)} (k {tuple(k.shape)}) does not split into {heads} heads: ComfyUI's "
            f"layout is [batch, tokens, heads * head_dim], and {why}. The code making this attention call (the "
            f"model, or the node that runs it) passed heads={heads} for that width. To run it anyway, {change}.")


def sdpa_mask(mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """ComfyUI mask conventions -> a mask broadcastable to (B, H, Nq, Nk), as attention_pytorch builds it."""
    if mask is None:
        return None
    if mask.ndim == 2:
        mask = mask.unsqueeze(0)
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    return mask


def wants_engine(settings: PatchSettings, q: torch.Tensor, lq: int, lk: int) -> bool:
    if settings.mode == "off":
        return False
    if max(lq, lk) < settings.min_tokens:
        return False
    if settings.mode == "auto":
        return _needs_tiled_attention(q.device)
    return True


@torch.compiler.assume_constant_result
def _needs_tiled_attention(device) -> bool:
    """detect(device)'s verdict. Inside a torch.compile trace dynamo runs this as plain Python (the device probe
    cannot be traced) and keeps the answer as a constant of the graph."""
    return detect(device).needs_tiled_attention


def _seq_lens(call: dict):
    if call["skip_reshape"]:
        return call["q"].shape[-2], call["k"].shape[-2]
    return call["q"].shape[1], call["k"].shape[1]


def count(settings: PatchSettings, what: str) -> int:
    """Count one eager call in settings.counted[what] ("engine": announced before run_engine, for the first-call
    log; "passthrough": passed on, reported in settings.stats) and return the new count; inside a torch.compile
    trace nothing is counted and 0 is returned: reading a Python counter there makes dynamo guard on its value (a
    recompile per call) and the first-call log would break the graph (fullgraph=True fails). The engine calls
    themselves are counted by the engine where they run (run_engine passes settings.count_key), compiled too."""
    if torch.compiler.is_dynamo_compiling():
        return 0
    settings.counted[what] += 1
    return settings.counted[what]


def pass_on(fn, *args, **kwargs):
    """fn(*args, **kwargs) for a call that this pack's per-model route passes on: the process-wide mode
    (attention_core.patch, nodes/everywhere.py) leaves what runs inside to ComfyUI and torch, so the node's settings
    win for its model and no call is routed twice. Inside a torch.compile trace (thread-local state is not traced)
    fn is called as it is."""
    if torch.compiler.is_dynamo_compiling():
        return fn(*args, **kwargs)
    with deferred():
        return fn(*args, **kwargs)


def make_override(settings: PatchSettings, previous=None):
    """The override installed on a model: the engine where settings say so, else `previous` or ComfyUI's own."""

    def tiled_attention_override(func, *args, **kwargs):
        call = bind_call(args, kwargs)
        lq, lk = _seq_lens(call)
        if not wants_engine(settings, call["q"], lq, lk):
            count(settings, "passthrough")
            args = tuple(call[n] for n in POSITIONAL[:len(args)])
            if previous is not None:
                return pass_on(previous, func, *args, **kwargs)
            return pass_on(func, *args, **kwargs)
        if count(settings, "engine") == 1:
            log.info("[tiled-attention] %s: tiled attention running (mode %s), first call q %s k %s, heads %s",
                     settings.node, settings.mode, tuple(call["q"].shape), tuple(call["k"].shape), call["heads"])
        return run_engine(settings, call, kwargs)

    setattr(tiled_attention_override, MARK, settings)
    tiled_attention_override.previous = previous
    return tiled_attention_override


def run_engine(settings: PatchSettings, call: dict, kwargs: dict) -> torch.Tensor:
    enable_gqa = bool(kwargs.get("enable_gqa", False))
    q, k, v = to_heads(call, enable_gqa, settings.node)
    precision = _PRECISION[settings.half_precision]
    if call["attn_precision"] == torch.float32 or (kwargs.get("low_precision_attention") is False
                                                   and precision == "fp16"):
        precision = "fp32"  # the model asks for fp32 scores / a full-precision path
    tier = "auto" if settings.mode == "auto" else settings.mode
    budget = settings.memory_budget_mb * (1 << 20) if settings.memory_budget_mb > 0 else None
    key = counts.traced_key(settings.count_key)  # the engine counts the call where it runs, once
    try:
        if settings.devices:  # one device: attention runs there; several: the heads are split over them
            from ..attention_core.multidevice import scaled_dot_product_attention_on_devices
            out = scaled_dot_product_attention_on_devices(q, k, v, sdpa_mask(call["mask"]), scale=kwargs.get("scale"),
                                                          enable_gqa=enable_gqa, devices=settings.devices, tier=tier,
                                                          memory_budget=budget, precision=precision, count_as=key)
        else:
            out = scaled_dot_product_attention(q, k, v, sdpa_mask(call["mask"]), scale=kwargs.get("scale"),
                                               enable_gqa=enable_gqa, tier=tier, memory_budget=budget,
                                               precision=precision, count_as=key)
    except AttentionMemoryError as e:
        raise AttentionMemoryError(
            f"{settings.node}: {e} Node settings: mode={settings.mode}, memory_budget_mb="
            f"{settings.memory_budget_mb or 'auto'}. Try memory_budget_mb=0 (auto), mode=online, fewer frames or "
            f"a lower resolution, or launch ComfyUI with --lowvram / --reserve-vram.") from e
    if call["skip_output_reshape"]:
        return out
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def install(model_patcher, settings: PatchSettings):
    """A clone of `model_patcher` with the engine as its attention override (the original is untouched).
    An override already on the model (another pack's) is kept as the fallback for calls we pass through;
    an earlier override of this pack is replaced, so the later node in a chain wins."""
    m = model_patcher.clone()
    to = m.model_options.setdefault("transformer_options", {})
    previous = to.get(OVERRIDE_KEY)
    while previous is not None and getattr(previous, MARK, None) is not None:
        previous = previous.previous
    if settings.mode == "off":
        if previous is None:
            to.pop(OVERRIDE_KEY, None)
        else:
            to[OVERRIDE_KEY] = previous
        return m
    to[OVERRIDE_KEY] = make_override(settings, previous)
    return m


def comfy_default_attention() -> str:
    """Name of the attention function ComfyUI picked at startup (e.g. attention_sub_quad)."""
    try:
        from comfy.ldm.modules import attention
        return getattr(attention.optimized_attention, "__name__", str(attention.optimized_attention))
    except Exception:  # noqa: BLE001 - outside ComfyUI
        return "unknown (ComfyUI not imported)"

