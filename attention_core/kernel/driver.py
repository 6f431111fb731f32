"""The one loop that runs a tiled pass: plan -> run -> on out-of-memory retry smaller -> next tier; head groups.

Shared by the forward (tiers chunked -> inplace -> online) and the recompute backward (one "backward" tier).
A plan that splits heads runs the pass head group by head group (each group builds its own TileSource, the
whole problem's is never built); each group's tier writes its results straight into the whole problem's outputs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from .memory import AttentionMemoryError, Plan, bytes_per_score, free_memory, plan_backward, plan_forward, tile_budget
from .numerics import Numerics
from .oom import is_oom, release_cached
from .problem import AttentionProblem
from .tiers import ORDER, TIERS
from .tiers.backward import backward as backward_tiles
from .tiles import TileOutputs, TileSource, lazy_source
from ..device.profiles import score_layout, tuned_blocks

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallConfig:
    """How the caller wants the call run: tier ("auto" or a name in tiers.ORDER), forced tile sizes, byte budget."""
    tier: str = "auto"
    block_q: Optional[int] = None
    block_kv: Optional[int] = None
    memory_budget: Optional[int] = None


def _with_retries(p: AttentionProblem, budget: int, plans, run: Callable, what: str):
    """run(plan) for the first plan that does not run out of memory; `plans` yields (tier, first plan or None)
    and each plan is halved (Plan.smaller) on out-of-memory before the next tier's is tried."""
    last_oom = None
    for tier, plan in plans:
        while plan is not None:
            try:
                return run(plan)
            except Exception as e:  # noqa: BLE001 - only out-of-memory is retried
                if not is_oom(e):
                    raise
                last_oom = e
                release_cached(p.device)
                smaller = plan.smaller()
                log.info("tiled attention %s: %s tier out of memory with %dx%d tiles of %d heads; %s", what, tier,
                         plan.block_q, plan.block_kv, plan.block_h,
                         "retrying smaller" if smaller else "trying the next tier")
                plan = smaller
    free = free_memory(p.device)
    free_txt = "unknown" if free is None else f"{free / 2**20:.0f} MB"
    cause = f" The last attempt failed with: {last_oom}" if last_oom is not None else ""
    raise AttentionMemoryError(
        f"Tiled attention {what}: not even the smallest tile (16 x 16) fits for {p.describe()} within a budget of "
        f"{budget / 2**20:.0f} MB (free memory found on {p.device}: {free_txt}). Free memory (fewer frames, lower "
        f"resolution, smaller batch, --lowvram) or pass a larger memory_budget.{cause}") from last_oom


def _head_groups(p: AttentionProblem, block_h: int):
    for h0 in range(0, p.Hkv, block_h):
        h1 = min(p.Hkv, h0 + block_h)
        yield h0, h1, p.head_group(h0, h1)


def run_forward(p: AttentionProblem, num: Numerics, cfg: CallConfig, need_stats: bool) -> TileOutputs:
    """The forward with the chosen tier ("auto": the largest that fits), retrying smaller, then the next tier."""
    whole = lazy_source(p, num)
    budget = tile_budget(p.device, cfg.memory_budget)
    start = 0 if cfg.tier == "auto" else ORDER.index(cfg.tier)

    def plans():
        for tier in ORDER[start:]:
            tuned = tuned_blocks(p.device, num.compute, p.Hkv, p.Lq, p.Lk, p.E, tier, budget, p.B * p.G,
                                 bytes_per_score(tier, p, num)) if cfg.tier == "auto" and not cfg.block_q else None
            plan = Plan(tier, *tuned) if tuned else plan_forward(p, num, tier, budget, cfg.block_q, cfg.block_kv)
            if plan is not None and tier == "chunked":
                plan = replace(plan, layout=score_layout(p.device, num.compute))
            if plan is None:
                log.debug("tier %s does not fit %d MB for %s", tier, budget >> 20, p.describe())
            if plan is None and cfg.tier == tier and tier != ORDER[-1]:
                log.warning("tiled attention: the %s tier does not fit in %d MB for %s; using the next tier down",
                            tier, budget >> 20, p.describe())
            yield tier, plan

    def run(plan):
        tier_fn = TIERS[plan.tier]
        fn = (lambda *a: tier_fn(*a, layout=plan.layout)) if plan.tier == "chunked" else tier_fn
        if plan.block_h >= p.Hkv:
            return fn(whole(), plan.block_q, plan.block_kv, need_stats)
        res = TileOutputs(p, num, need_stats)
        for h0, h1, sub in _head_groups(p, plan.block_h):
            fn(TileSource(sub, num, into=res), plan.block_q, plan.block_kv, need_stats)  # writes res's heads h0:h1
        return res

    return _with_retries(p, budget, plans(), run, "forward")


def run_backward(p: AttentionProblem, num: Numerics, cfg: CallConfig, out, lse, rowmax, dout, dlse=None,
                 need_dmask: bool = False):
    """(dq5, dk4, dv4, dmask5 or None) by the recompute backward; rowmax None: no flush-to-zero."""
    whole = lazy_source(p, num)
    budget = tile_budget(p.device, cfg.memory_budget)
    rowmax = rowmax if num.ftz else None

    def run(plan):
        if plan.block_h >= p.Hkv:
            return backward_tiles(whole(), out, lse, rowmax, dout, dlse, plan.block_q, plan.block_kv, need_dmask)
        dq = torch.empty(p.q5.shape, dtype=p.q5.dtype, device=p.device)
        dk = torch.empty(p.k4.shape, dtype=p.k4.dtype, device=p.device)
        dv = torch.empty(p.v4.shape, dtype=p.v4.dtype, device=p.device)
        dmask = torch.zeros(p.mask5.shape, dtype=p.mask5.dtype, device=p.device) if need_dmask else None
        for h0, h1, sub in _head_groups(p, plan.block_h):
            hs = slice(h0, h1)
            gq, gk, gv, gm = backward_tiles(TileSource(sub, num), out[:, hs], lse[:, hs],
                                            None if rowmax is None else rowmax[:, hs], dout[:, hs],
                                            None if dlse is None else dlse[:, hs], plan.block_q, plan.block_kv,
                                            need_dmask)
            dq[:, hs], dk[:, hs], dv[:, hs] = gq, gk, gv
            if dmask is not None:
                if dmask.shape[1] != 1:
                    dmask[:, hs] = gm
                else:
                    dmask += gm
        return dq, dk, dv, dmask

    plan = plan_backward(p, num, budget, cfg.block_q, cfg.block_kv)
    return _with_retries(p, budget, [("backward", plan)], run, "backward")
