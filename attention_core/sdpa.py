"""The drop-in entry point: torch's SDPA semantics, dtype policy, tier choice and out-of-memory retries."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from .autograd import TiledAttention
from .memory import AttentionMemoryError, plan_forward, tile_budget
from .numerics import Numerics, choose_numerics
from .oom import is_oom, release_cached
from .problem import AttentionProblem, normalize
from .tiers import ORDER, TIERS
from .tiles import TileOutputs, TileSource, lazy_source

log = logging.getLogger(__name__)

TIER_CHOICES = ("auto",) + ORDER


@dataclass(frozen=True)
class CallConfig:
    tier: str = "auto"
    block_q: Optional[int] = None
    block_kv: Optional[int] = None
    memory_budget: Optional[int] = None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, tier="auto", block_q=None, block_kv=None, memory_budget=None,
                                 precision="auto", flush_to_zero=None):
    """torch.nn.functional.scaled_dot_product_attention, computed in tiles with O(N) memory.

    Same arguments and result as torch's (math backend), plus:
      tier           "auto" (largest tier that fits free memory), "chunked", "inplace" or "online"
      block_q/_kv    force tile sizes (tests; "auto" sizes them from memory)
      memory_budget  bytes the tiles may use (default: a share of the device's free memory)
      precision      "auto" | "keep" | "fp16" | "fp32": compute dtype for half inputs (see numerics.choose_numerics)
      flush_to_zero  weights more than e^-20 below the row max become exactly 0 (default: on in half precision)
    """
    if tier not in TIER_CHOICES:
        raise ValueError(f"tier must be one of {TIER_CHOICES}, got {tier!r}")
    for name, b in (("block_q", block_q), ("block_kv", block_kv)):
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"scaled_dot_product_attention: query must be a tensor, got {type(query).__name__}")
    query, key, value = autocast_inputs(query, key, value)
    with no_autocast(query.device.type):
        p = normalize(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        num = choose_numerics(p.dtype, p.device, precision, (query, key, value), flush_to_zero)
        cfg = CallConfig(tier, block_q, block_kv, memory_budget)
        if p.Lq == 0 or p.B == 0 or p.Lk == 0 or p.dropout_p >= 1.0:
            out5 = _zeros(p)
        elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (p.q5, p.k4, p.v4, p.mask5)):
            out5 = TiledAttention.apply(p.q5, p.k4, p.v4, p.mask5, p, num, cfg)
        else:
            with torch.no_grad():
                out5 = run_forward(p, num, cfg, need_stats=False).out
        out = out5.reshape(p.out_shape)
    return out.squeeze(0) if p.squeeze_2d else out


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # older torch / a device type without autocast
        return device_type == "cuda" and torch.is_autocast_enabled()


def autocast_inputs(*tensors):
    """Under autocast torch's SDPA runs in the autocast dtype (fp32 inputs are cast down); so does this."""
    device_type = tensors[0].device.type
    if not _autocast_on(device_type):
        return tensors
    dt = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


def no_autocast(device_type: str):
    """The engine picks every dtype itself (fp32 tiles of the overflow guard must stay fp32)."""
    if not _autocast_on(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _zeros(p: AttentionProblem) -> torch.Tensor:
    """No key, no query or everything dropped: zeros, as torch returns, still connected to the graph."""
    z = torch.zeros(p.B, p.Hkv, p.G, p.Lq, p.Ev, dtype=p.dtype, device=p.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (p.q5, p.k4, p.v4)):
        z = z + 0.0 * (p.q5.sum() + p.k4.sum() + p.v4.sum())
    return z


def _run_tier(fn, p: AttentionProblem, num: Numerics, whole, plan, need_stats: bool) -> TileOutputs:
    """One tier over the whole problem (`whole()` gives its TileSource), head group by head group when the plan
    splits heads (then each group gets its own TileSource and the whole one is never built)."""
    if plan.block_h >= p.Hkv:
        return fn(whole(), plan.block_q, plan.block_kv, need_stats)
    res = TileOutputs(p, num, need_stats)
    for h0 in range(0, p.Hkv, plan.block_h):
        h1 = min(p.Hkv, h0 + plan.block_h)
        part = fn(TileSource(p.head_group(h0, h1), num), plan.block_q, plan.block_kv, need_stats)
        res.out[:, h0:h1] = part.out
        for name in ("lse", "rowmax"):
            if getattr(res, name) is not None:
                getattr(res, name)[:, h0:h1] = getattr(part, name)
        del part
    return res


def run_forward(p: AttentionProblem, num: Numerics, cfg: CallConfig, need_stats: bool) -> TileOutputs:
    """Run the chosen tier; on out-of-memory retry with smaller tiles, then the next tier down."""
    whole = lazy_source(p, num)
    budget = tile_budget(p.device, cfg.memory_budget)
    start = 0 if cfg.tier == "auto" else ORDER.index(cfg.tier)
    for tier in ORDER[start:]:
        plan = plan_forward(p, num, tier, budget, cfg.block_q, cfg.block_kv)
        if plan is None:
            log.debug("tier %s does not fit %d MB for %s", tier, budget >> 20, p.describe())
        while plan is not None:
            try:
                return _run_tier(TIERS[tier], p, num, whole, plan, need_stats)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
                if not is_oom(e):
                    raise
                release_cached(p.device)
                smaller = plan.smaller()
                log.info("tiled attention: %s tier out of memory with %dx%d tiles; %s", tier, plan.block_q,
                         plan.block_kv, "retrying smaller" if smaller else "trying the next tier")
                plan = smaller
        if cfg.tier != "auto" and tier == cfg.tier and tier != ORDER[-1]:
            log.warning("tiled attention: the %s tier does not fit in %d MB for %s; using the next tier down",
                        tier, budget >> 20, p.describe())
    raise AttentionMemoryError(
        f"Tiled attention: not even the smallest online tile (16 x 16 keys) fits for {p.describe()} within a "
        f"budget of {budget / 2**20:.0f} MB. Free memory on {p.device} (fewer frames, lower resolution, smaller "
        f"batch, --lowvram) or pass a larger memory_budget.")
