"""Free memory per device and tile sizes from a budget.

A tile of r score rows by c keys costs about r * c * bytes_per_score(...) bytes on top of the inputs and the
output; `plan_forward` / `plan_backward` pick the tallest tile that fits the budget, capped at a size that keeps
the GEMMs efficient (bigger tiles buy nothing past that, and on the CPU they fall out of cache).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..device.tile_bytes import CHUNKED_SCORE_BUFFERS, tile_bytes_per_score  # noqa: F401  (re-exported)
from .numerics import Numerics
from .problem import AttentionProblem

MIN_BLOCK = 16
# query rows per head a tile keeps before it splits heads into groups: the GEMMs stay efficient above this
PREF_ROWS = 64
# the same for forward tiles on the CPU (heads of more than HEAD_CAP_MAX_DIM dims): a batched GEMM of 80 rows a
# head ran 1.2-1.35x torch's fused kernel at the Wan 2.2 480p shape where 256-320 rows of a head group ran 1.08-1.12x
# (24, 30 and 40 heads of 128 dims, quiet, interleaved: docs/bench-tiles-cpu.md, issue 38.6). Head groups there are
# a multiple of torch's thread count (a batched GEMM shares its heads out among the threads: 3 heads on 2 threads
# ran 1.39x, 2 or 4 ran 1.08-1.10x) and even (24 heads as 6+6+6+6, not 7+7+7+3)
FORWARD_PREF_ROWS = {"cpu": 256, "other": PREF_ROWS}
# score elements per forward tile we aim for (full rows for chunked / inplace, bq x bk for online) when the device
# has no tuned profile. CPU: 2^23 (32 MB of fp32 scores; the chunked tier's softmax runs over them in place there),
# the fastest target within 3 % of ComfyUI sub-quadratic attention's memory at the Wan 2.2 480p shape in quiet
# interleaved timings on two kinds of 2-core machine (docs/bench-tiles-cpu.md: larger tiles mean fewer, longer
# parallel regions; 2^19 was 1.2-1.4x slower). A tuned profile (python -m attention_core.tune) replaces it with the
# smallest tile within 3 % of the fastest on the device.
TARGET_TILE_ELEMS = {"cpu": 1 << 23, "other": 1 << 27}
# at most this many scores of one kv head (its batch x GQA rows included) in a forward tile of heads of at most
# HEAD_CAP_MAX_DIM dims, so each head's slice of the tile stays near a core's L2 (2 MB of fp32): at N=2048, 8 heads
# of 64 dims a 2^23 tile of 512 rows a head ran 1.15x slower than one of 256 quiet (docs/bench-tiles-cpu.md); None:
# no cap. Heads of 128 dims (every video model's) do twice the GEMM work a score, and there the cap bought nothing
# quiet (N=4096, 8 heads: 159 vs 161 GFLOP/s) and cost 10-20 % with the CPU loaded (a one-block run at 4,096
# tokens lost to ComfyUI's sub-quadratic attention: twice the tiles, each parallel region waiting for a thread
# another process had taken; docs/bench-busy-cpu.md, issue 24.3)
HEAD_TILE_ELEMS = {"cpu": 1 << 19, "other": None}
HEAD_CAP_MAX_DIM = 64
# score elements per backward tile: five score-sized GEMMs a tile instead of two, and on the CPU 2^21 was as fast
# as 2^22 and faster than 2^23 quiet (docs/bench-tiles-cpu.md); fwd + bwd at N=2048, 8 heads stays within 15 % of
# math SDPA's peak RSS (LiveBytes test)
BACKWARD_TILE_ELEMS = {"cpu": 1 << 21, "other": 1 << 27}
ONLINE_BLOCK_KV = {"cpu": 1024, "other": 4096}
# score elements per online tile (bq x bk): a quarter of the full-row tiers' target on the CPU, a 32nd elsewhere
# (half precision there: online's weights are fp32, 3x the bytes of an fp16 score), so that at the default tile
# size the online tier holds the least memory of the three for any call past one tile (its purpose: memory
# independent of the key count); `auto` takes it only when nothing else fits, and then at the size the budget allows
ONLINE_TILE_ELEMS = {"cpu": 1 << 21, "other": 1 << 22}
# share of the free memory the tiles may take when no budget is given
FREE_FRACTION = {"cpu": 0.5, "other": 0.7}


class AttentionMemoryError(MemoryError):
    """Even the smallest online tile does not fit; __cause__ is the last out-of-memory error, if any."""


@dataclass(frozen=True)
class Plan:
    """A tile: block_q query rows of block_h kv heads (with their GQA groups and the batch) x block_kv keys."""
    tier: str
    block_q: int
    block_kv: int
    block_h: int
    layout: str = "queries"  # chunked tier's score layout (profiles.score_layout); other tiers ignore it

    def smaller(self) -> Optional["Plan"]:
        """Halve the tile (heads first, then query rows, then the keys of online tiles); None at the floor."""
        if self.block_h > 1:
            return replace(self, block_h=self.block_h // 2)
        if self.block_q > MIN_BLOCK:
            return replace(self, block_q=max(MIN_BLOCK, self.block_q // 2))
        if self.tier in ("online", "backward") and self.block_kv > MIN_BLOCK:
            return replace(self, block_kv=max(MIN_BLOCK, self.block_kv // 2))
        return None


def _kind(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else "other"


def free_memory(device: torch.device) -> Optional[int]:
    """Bytes the tiles could take on `device` now: the driver's free memory plus PyTorch's cached-but-unused
    blocks (CUDA / ROCm), available RAM (CPU), or None when the backend cannot tell."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(free + max(0, cached))
        if device.type == "cpu":
            import psutil
            return int(psutil.virtual_memory().available)
        if device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
            free, _ = torch.xpu.mem_get_info(device)
            return int(free)
        if device.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    except Exception:  # a backend without the query: fall through to "unknown"
        return None
    return None


def tile_budget(device: torch.device, memory_budget: Optional[int] = None) -> int:
    """Bytes one call's tiles may use: `memory_budget` when given, else a share of the free memory."""
    if memory_budget is not None:
        ok = isinstance(memory_budget, (int, float)) and not isinstance(memory_budget, bool)
        if not ok or not math.isfinite(memory_budget) or memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive, finite number of bytes (or None for a share of "
                             f"the free memory), got {memory_budget!r}")
        return int(memory_budget)
    free = free_memory(device)
    if free is None:
        free = 4 << 30
    return int(free * FREE_FRACTION[_kind(device)])


def bytes_per_score(tier: str, p: AttentionProblem, num: Numerics, backward: bool = False) -> int:
    """Transient bytes per score element of one tile for `tier` (or the backward): tile_bytes_per_score plus the
    mask and dropout temporaries."""
    st = torch.empty((), dtype=num.stats).element_size()
    extra = 0
    if p.mask5 is not None and p.mask5.dtype == torch.bool:
        extra += 1
    if p.dropout_p > 0:
        extra += 3 * 8 + 1  # int64 hash temporaries and the keep bits
    if backward:  # the fp32 scores/weights/dS tile, dP (compute dtype, then fp32), flush/temporaries
        return 3 * st + extra
    cs = torch.empty((), dtype=num.compute).element_size()
    return tile_bytes_per_score(tier, cs, num.compute == torch.float16, _kind(p.device)) + extra


def forward_block_kv(tier: str, keys: int, kind: str) -> int:
    """The key block a forward tile of `tier` starts from: every key for chunked and inplace (full rows), at most
    ONLINE_BLOCK_KV[kind] for online."""
    return max(1, keys) if tier in ("chunked", "inplace") else min(max(1, keys), ONLINE_BLOCK_KV[kind])


def forward_tile(lq: int, hkv: int, pairs_per_row: int, per: int, budget: int, keys: int, kind: str, tier: str,
                 block_q=None, block_kv=None, head_dim: Optional[int] = None):
    """tile_for of a forward tile of `tier` over `keys` keys: chunked and inplace take full key rows; online takes
    block_kv keys (default: forward_block_kv, halved until MIN_BLOCK rows fit) and aims at ONLINE_TILE_ELEMS
    scores. The one rule the engine (plan_forward), `plan` and `tune` size forward tiles by."""
    if tier in ("chunked", "inplace"):
        return tile_for(lq, hkv, pairs_per_row, per, budget, forward_block_kv(tier, keys, kind), kind, block_q,
                        head_dim=head_dim)
    bk = block_kv or forward_block_kv(tier, keys, kind)
    return tile_for(lq, hkv, pairs_per_row, per, budget, bk, kind, block_q, shrink_kv=block_kv is None,
                    target=ONLINE_TILE_ELEMS[kind], head_dim=head_dim, forward=True)


def _round(b: int) -> int:
    return b if b < 64 else b - b % 16


def balanced_heads(heads: int, hkv: int, threads: int) -> int:
    """At most `heads` kv heads a group, a multiple of `threads` where that leaves one, then evened out over the
    groups hkv needs while it stays such a multiple (24 heads with at most 7 a group on 2 threads: 6, four groups
    of 6; 14 heads: 6 + 6 + 2, not 5 + 5 + 4: an odd group on 2 threads ran 1.35x torch's time, 6 a group 1.22x)."""
    heads = max(1, min(heads, hkv))
    multiple = heads >= threads > 0
    if multiple:
        heads -= heads % threads
    groups = -(-hkv // heads)
    even = -(-hkv // groups)
    if multiple:
        even += -even % threads  # back up to a multiple of the threads: never past heads, itself one
    return min(heads, even)


def tile_for(lq: int, hkv: int, pairs_per_row: int, per: int, budget: int, bk: int, kind: str, block_q=None,
             shrink_kv: bool = False, target: Optional[int] = None, head_dim: Optional[int] = None,
             forward: Optional[bool] = None, threads: Optional[int] = None):
    """(bq, bk, heads) for tiles of `per` bytes a score within `budget`, or None; halves bk while allowed.

    Shapes only (attention_core.cli.plan reports the same tiles): lq query rows, hkv kv heads, each (kv head, query
    row) pair holding pairs_per_row * bk scores (B * G: batch and the GQA group). The tile takes as many pairs as
    TARGET_TILE_ELEMS[kind] and the budget allow, all heads when that leaves PREF_ROWS rows per head, else fewer
    heads with more rows, and (forward, heads of `head_dim` <= HEAD_CAP_MAX_DIM) no more than HEAD_TILE_ELEMS[kind]
    scores a head where that leaves PREF_ROWS rows. CPU forward tiles of larger heads keep FORWARD_PREF_ROWS rows
    instead, in balanced_heads groups of `threads` (default: torch's thread count), their rows filling the target.
    `target`: another number of scores to aim for (the online tier's: forward_tile; the backward's). forward:
    whether the head cap and FORWARD_PREF_ROWS apply (default: only without a target, i.e. not for the backward).
    head_dim None: unknown, no cap."""
    lq, hkv = max(1, lq), max(1, hkv)
    forward = target is None if forward is None else forward
    capped = forward and head_dim is not None and head_dim <= HEAD_CAP_MAX_DIM  # forward tiles only
    head_cap = HEAD_TILE_ELEMS[kind] if capped else None
    grouped = forward and not capped and kind == "cpu"  # CPU forward tiles of larger heads: FORWARD_PREF_ROWS
    pref = FORWARD_PREF_ROWS[kind] if grouped else PREF_ROWS
    target = target or TARGET_TILE_ELEMS[kind]
    while True:
        per_pair = max(1, pairs_per_row) * bk
        if block_q is not None:
            return min(block_q, lq), bk, hkv
        fit = budget // (per_pair * per)
        if fit >= min(MIN_BLOCK, lq):
            pairs = min(max(MIN_BLOCK, target // per_pair), fit)
            if pairs >= hkv * min(pref, lq):
                rows = min(lq, pairs // hkv)
                if head_cap is not None:
                    rows = min(rows, max(PREF_ROWS, head_cap // per_pair))
                return max(1, _round(rows)), bk, hkv
            bq = min(lq, max(min(MIN_BLOCK, lq), min(pref, pairs)))
            heads = max(1, min(hkv, pairs // bq))
            if grouped:
                heads = balanced_heads(heads, hkv, torch.get_num_threads() if threads is None else threads)
                bq = min(lq, max(bq, pairs // heads))
            return max(1, _round(bq)), bk, heads
        if not shrink_kv or bk <= MIN_BLOCK:
            return None
        bk = max(MIN_BLOCK, bk // 2)


def _tile(p: AttentionProblem, per: int, budget: int, bk: int, block_q, shrink_kv: bool, target=None):
    return tile_for(p.Lq, p.Hkv, p.B * p.G, per, budget, bk, _kind(p.device), block_q, shrink_kv, target, p.E)


def plan_forward(p: AttentionProblem, num: Numerics, tier: str, budget: int, block_q=None,
                 block_kv=None) -> Optional[Plan]:
    """The tile for `tier` within `budget` bytes, honouring user block sizes; None if MIN_BLOCK rows do not fit."""
    t = forward_tile(p.Lq, p.Hkv, p.B * p.G, bytes_per_score(tier, p, num), budget, p.Lk, _kind(p.device), tier,
                     block_q, block_kv, p.E)
    return None if t is None else Plan(tier, *t)


def plan_backward(p: AttentionProblem, num: Numerics, budget: int, block_q=None, block_kv=None) -> Optional[Plan]:
    """Backward tiles: full key rows when they fit (fewer, larger GEMMs), else bq x bk tiles."""
    per = bytes_per_score("online", p, num, backward=True)
    target = BACKWARD_TILE_ELEMS[_kind(p.device)]
    t = _tile(p, per, budget, block_kv or max(1, p.Lk), block_q, shrink_kv=block_kv is None, target=target)
    return None if t is None else Plan("backward", *t)
