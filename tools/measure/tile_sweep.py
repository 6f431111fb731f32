"""CPU tile-default sweep (issue 24): the chunked tier at several forward / backward tile targets and score layouts,
in one process per shape, every configuration once per round, rounds interleaved, medians.

    python -m tools.measure.tile_sweep wan 8      # Wan 2.2 5B 480p forward (B1 H24 N4290 D128), with ComfyUI
                                                  # sub-quadratic
    python -m tools.measure.tile_sweep seed 6     # N4096, 16 x 64 forward, with math SDPA
    python -m tools.measure.tile_sweep bwd 8      # forward + backward, N2048, 8 x 64, with math SDPA
    python -m tools.measure.tile_sweep small 8    # the training forward alone at the fwd+bwd shape

Configurations are named qE / kE (queries- / keys-major, forward target 2^E scores) and bB (backward target
2^B). It patches attention_core.kernel.memory's targets in this process only. Timing, so: run it on a quiet machine
(docs/bench-tiles-cpu.md holds the runs that set the defaults). `wan` needs $COMFYUI_PATH (or NOSQ=1 to skip
sub-quadratic).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_core.kernel import memory
from attention_core import scaled_dot_product_attention as sdpa


def ours(e, layout, bwd=None, tier="chunked"):
    def f(q, k, v):
        memory.TARGET_TILE_ELEMS = dict(memory.TARGET_TILE_ELEMS, cpu=1 << e)
        if bwd is not None:
            memory.BACKWARD_TILE_ELEMS = dict(memory.BACKWARD_TILE_ELEMS, cpu=1 << bwd)
        os.environ["TILED_ATTENTION_LAYOUT"] = layout
        return sdpa(q, k, v, tier=tier)
    return f


def math_sdpa(q, k, v):
    with sdpa_kernel([SDPBackend.MATH]):
        return torch._C._nn.scaled_dot_product_attention(q, k, v)  # torch's own, even with the patch on


def configs(which):
    """(shape, mode, {name: fn})."""
    if which == "wan":
        cfgs = {}
        if not os.environ.get("NOSQ"):
            from attention_core.cli.bench_methods import comfy_attention
            sq = comfy_attention(os.environ["COMFYUI_PATH"], "comfy-subquad")
            cfgs["subquad"] = lambda q, k, v: sq(q, k, v, 24, skip_reshape=True, skip_output_reshape=True)
        for e in (21, 22, 23, 24):
            cfgs[f"q{e}"] = ours(e, "queries")
        for e in (21, 23):
            cfgs[f"k{e}"] = ours(e, "keys")
        return (1, 24, 4290, 128), "fwd", cfgs
    if which == "seed":
        cfgs = {"math": math_sdpa}
        for e in (19, 21, 22, 23):
            cfgs[f"q{e}"] = ours(e, "queries")
        cfgs["k21"] = ours(21, "keys")
        return (1, 16, 4096, 64), "fwd", cfgs
    if which == "small":
        cfgs = {"math": math_sdpa}
        for e in (20, 21, 22, 23):
            cfgs[f"q{e}"] = ours(e, "queries", bwd=21)
        return (1, 8, 2048, 64), "fwdgrad", cfgs
    if which == "bwd":
        cfgs = {"math": math_sdpa}
        for e, b in ((23, 21), (23, 22), (23, 23), (21, 21), (21, 22)):
            cfgs[f"q{e}b{b}"] = ours(e, "queries", bwd=b)
        return (1, 8, 2048, 64), "fwdbwd", cfgs
    raise SystemExit(f"error: unknown sweep {which!r}; choose wan, seed, small or bwd")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(__doc__)
    which, rounds = argv[0], int(argv[1]) if len(argv) > 1 else 5
    torch.manual_seed(0)
    shape, mode, cfgs = configs(which)
    q, k, v = (torch.randn(shape) for _ in range(3))
    g = torch.randn(shape)
    if mode != "fwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))

    def run(f):
        t0 = time.perf_counter()
        if mode == "fwd":
            with torch.no_grad():
                f(q, k, v)
        elif mode == "fwdgrad":
            f(q, k, v)
        else:
            f(q, k, v).backward(g)
            q.grad = k.grad = v.grad = None
        return time.perf_counter() - t0

    times = {n: [] for n in cfgs}
    for f in cfgs.values():
        run(f)  # warm-up
    for r in range(rounds):
        for n, f in cfgs.items():
            times[n].append(run(f))
        print("round", r, "load", " ".join(open("/proc/loadavg").read().split()[:3]), flush=True)
    for n, t in times.items():
        print(f"{which} {n:10s} median {statistics.median(t):.3f}  min {min(t):.3f} max {max(t):.3f}")


if __name__ == "__main__":
    main()
