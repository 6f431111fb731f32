"""Bytes per score element a forward tile holds, by tier, compute dtype and device kind: what the engine sizes its
tiles by (kernel.memory), what `plan` reports and what a tuned profile is checked against (device.profiles). Pure
arithmetic on sizes; no torch."""
from __future__ import annotations

# score-sized buffers of a chunked tile: S and P, one buffer on the CPU where P overwrites S (kernel/tiers/chunked.py)
CHUNKED_SCORE_BUFFERS = {"cpu": 1, "other": 2}


def tile_bytes_per_score(tier: str, compute_bytes: int, fp16: bool, kind: str) -> int:
    """Bytes per score element one forward tile of `tier` holds at its peak (attention_core/kernel/tiers/*.py),
    without mask or dropout, for tiles computed in a dtype of `compute_bytes` bytes (fp16: True when that is fp16,
    whose overflow guard scores a flagged tile in fp32). Row statistics are fp32 (fp64 for fp64 tiles).
      chunked  S (and P beside it on a GPU: CHUNKED_SCORE_BUFFERS) in the score dtype, plus P cast back to fp16 for
               the P V GEMM when the guard scored it in fp32
      inplace  S in the score dtype, plus that cast
      online   the scores with their fp32 weights beside them (computed from half scores), or the fp32 weights with
               their cast to the compute dtype for the P V GEMM: max of the two (the previous key tile is let go)"""
    cs = compute_bytes
    st = 8 if cs == 8 else 4
    ss = 4 if fp16 else cs  # score tile: an fp16 tile the overflow guard flags is scored in fp32
    cast = cs if ss != cs else 0
    if tier == "chunked":
        return CHUNKED_SCORE_BUFFERS[kind] * ss + cast
    if tier == "inplace":
        return ss + cast
    if tier == "online":
        weights = (lambda score: score + (st if score != st else 0))
        return max(weights(cs), weights(ss), st + (cs if cs != st else 0))
    raise ValueError(f"unknown tier {tier!r}; choose from chunked, inplace, online")
